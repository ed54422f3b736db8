"""Run the Triton kernel tests through Triton's CPU interpreter, on CPU tensors.

Opt-in: ``PAGEDLLM_TRITON_INTERPRET=1 pytest tests/kernels``. Triton reads ``TRITON_INTERPRET`` when it is
first imported, so the interpreted tests (those named ``*_interpret``) run in a fresh pytest process with it
set. Skipped without Triton, and when not asked for (the interpreter takes a while).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


@pytest.mark.skipif(
    os.environ.get("PAGEDLLM_TRITON_INTERPRET") != "1", reason="set PAGEDLLM_TRITON_INTERPRET=1"
)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreting")
def test_kernels_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("PAGEDLLM_TRITON_INTERPRET")
    files = sorted(str(p) for p in HERE.glob("test_triton_*.py") if p.name != Path(__file__).name)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpret", *files],
        env=env,
        cwd=HERE.parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
