"""Triton W4A16 GEMM (GPTQ layout) vs its PyTorch twin, and the twin vs the GPTQ layer's dequantization.

Without Triton (CI) the module is skipped. ``TRITON_INTERPRET=1 pytest tests/quantization/test_w4a16_gemm.py``
runs the ``interpret`` tests on CPU tensors through Triton's interpreter; the ``gpu`` test needs CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref  # noqa: E402
from tests.quantization.quant_utils import quantize_gptq  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")


def make_operands(m: int, k: int, n: int, group_size: int, desc_act: bool, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(k * 7 + n + group_size)
    w = torch.randn(n, k, generator=gen) * 0.1
    tensors, deq = quantize_gptq(w, group_size, desc_act, gen)  # deq: [n, k] float32
    x = torch.randn(m, k, generator=gen).to(dtype)
    ops = [tensors[name].to(device) for name in ("qweight", "qzeros", "scales", "g_idx")]
    return x.to(device), ops, deq.to(device)


def test_ref_matches_dequantized_weights():
    x, ops, deq = make_operands(5, 64, 48, 16, True, "cpu", torch.float32)
    expected = x @ deq.t()
    assert torch.allclose(w4a16_gemm_ref(x, *ops), expected, atol=1e-5, rtol=1e-5)


SHAPES = [(1, 64, 64, 32, False), (7, 96, 40, 32, True), (19, 128, 72, -1, True), (33, 64, 128, 16, True)]


@needs_interpreter
@pytest.mark.parametrize("m, k, n, group_size, desc_act", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_gemm_interpret(m, k, n, group_size, desc_act, dtype):
    x, ops, _ = make_operands(m, k, n, group_size, desc_act, "cpu", dtype)
    out = w4a16_gemm(x, *ops, block_m=16, block_n=32, block_k=32)
    ref = w4a16_gemm_ref(x, *ops)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="GPU run")
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_gemm_gpu(m, dtype):
    x, ops, _ = make_operands(m, 512, 384, 128, True, "cuda", dtype)
    out = w4a16_gemm(x, *ops)
    ref = w4a16_gemm_ref(x, *ops)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
