"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels; the policy is
:func:`pagedllm.platform.use_pdl`.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is still
finishing. Each of our kernels calls :func:`pdl_prologue` first: ``griddepcontrol.wait`` blocks until the
previous kernel has completed and its writes are visible (so nothing is read or written early), then
``griddepcontrol.launch_dependents`` lets the next PDL kernel start launching in turn. Without ``PDL`` both are
compiled out.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch_options(pdl: bool) -> dict:
    """The extra launch keyword for ``kernel[grid](...)``: ``launch_pdl=True`` under PDL, else nothing."""
    return {"launch_pdl": True} if pdl else {}
