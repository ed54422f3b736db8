"""Triton kernels for the GPU fast path: one op per file, each with a shape-checking launcher and a ``*_ref``
PyTorch twin that is also its test oracle.

Importing this package never imports Triton; importing one of its modules does.

Debug switch: with ``TRITON_INTERPRET=1`` (read by Triton at import) every kernel runs in Triton's CPU
interpreter on CPU tensors; :mod:`pagedllm.kernels._interpret` then patches an interpreter bug that makes
bf16 ``tl.dot`` wrong, so that interpreted results match the GPU ones.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from pagedllm.kernels._interpret import patch_interpreter

    patch_interpreter()
