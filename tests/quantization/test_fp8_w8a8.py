"""FP8 W8A8 (``torch._scaled_mm`` with per-token activation scales) vs its twin given the same quantized
activations, the Triton activation quantizer vs its PyTorch twin, and the fallbacks (block-wise weights, GPUs
without FP8).

The layer tests run on CPU too where this torch's ``_scaled_mm`` has a CPU kernel (recent versions); the ``gpu``
tests need CUDA (the W8A8 ones a GPU of compute capability >= 8.9).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.quantization import fp8 as fp8_module
from pagedllm.quantization.fp8 import (
    Fp8LinearMethod,
    fp8_linear,
    fp8_linear_ref,
    quantize_fp8_per_token,
)
from tests.quantization.quant_utils import quantize_fp8
from tests.utils import rel_l2


def _cpu_scaled_mm() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm")


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_capable(), reason="needs a GPU of compute capability >= 8.9")

KINDS = ["tensor", "channel", "static", "online"]


def fp8_layer(
    kind: str, device: str = "cpu", sizes=(64, 32, 32), k: int = 128
) -> tuple[Linear, torch.Tensor]:
    """A fused ``sizes`` x ``k`` FP8 layer with a bias, loaded shard by shard as the checkpoint would be; also
    returns the dequantized float32 weight."""
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, k, generator=gen) * (0.05 * (i + 1)) for i, n in enumerate(sizes)]
    strategy = {"static": "tensor"}.get(kind, kind)
    method = Fp8LinearMethod(strategy, static_input_scale=kind == "static")
    with torch.device(device):
        layer = MergedLinear(k, list(sizes), bias=True)
        layer.set_linear_method(method)
    layer.bias.data.copy_(torch.randn(sum(sizes), generator=gen).to(device))
    deqs = []
    for shard, w in enumerate(weights):
        if kind == "online":
            layer.weight.weight_loader(layer.weight, w.to(device), shard)
            continue
        q, scale, deq = quantize_fp8(w, strategy)  # shards get different per-tensor scales
        deqs.append(deq)
        layer.weight.weight_loader(layer.weight, q.to(device), shard)
        layer.weight_scale.weight_loader(layer.weight_scale, scale.to(device), shard)
        if kind == "static":
            layer.input_scale.weight_loader(
                layer.input_scale, torch.tensor(0.02 + 0.01 * shard).to(device), shard
            )
    method.process_weights_after_loading(layer)
    deq = method.dequantize(layer) if kind == "online" else torch.cat(deqs).to(device)
    return layer, deq


def check_w8a8(layer: Linear, deq: torch.Tensor, x: torch.Tensor, static: bool) -> None:
    """``layer(x)`` on the W8A8 path vs (1) its twin given the same quantized activations (bf16 output rounding)
    and (2) the weight-only PyTorch path (activation quantization error only)."""
    assert layer.fp8_w8a8
    out = layer(x)
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], layer.output_size)
    x2 = x.reshape(-1, layer.input_size)
    input_scale = layer.input_scale.max().reshape(1) if static else None
    q, scale = quantize_fp8_per_token(x2, input_scale)
    ref = fp8_linear_ref(q, scale, layer.weight, layer.fp8_weight_scale, layer.bias).reshape(out.shape)
    assert rel_l2(out, ref) < 1e-2
    weight_only = F.linear(x.float(), deq, layer.bias.float())
    assert rel_l2(out, weight_only) < 0.08


def test_per_token_quantization_twin():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 4
    x[3] = 0  # an all-zero row keeps a tiny positive scale
    q, scale = quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and bool((scale > 0).all())
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5]], torch.full((5,), 448.0))
    assert rel_l2(q.float() * scale, x.float()) < 0.05
    q, scale = quantize_fp8_per_token(x, torch.tensor([0.001]))
    assert torch.equal(scale, torch.full((6, 1), 0.001)) and q.float().abs().max() == 448.0  # clamped


@needs_cpu_scaled_mm
@pytest.mark.parametrize("kind", KINDS)
def test_w8a8_layer_cpu(kind):
    """The layer logic (scales per shard, static input scale, bias after) through CPU ``_scaled_mm``."""
    layer, deq = fp8_layer(kind)
    assert not getattr(layer, "fp8_w8a8", False)  # CPU: the weight-only PyTorch path by default
    layer.quant_method.enable_w8a8(layer)
    assert layer.fp8_weight_scale.shape == (1, 128)
    if kind in ("tensor", "static"):  # shards keep their own per-tensor scales
        assert len(set(layer.fp8_weight_scale[0].tolist())) == 3
    if kind == "static":
        assert layer.fp8_input_scale.item() == pytest.approx(0.04)  # the largest shard's
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float32):
        check_w8a8(layer, deq, x.to(dtype), kind == "static")


@needs_cpu_scaled_mm
def test_fp8_linear_cpu_matches_twin():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    q, scale, _ = quantize_fp8(w, "channel")
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    w_scale = scale.reshape(1, 48).float()
    out = fp8_linear(x, q, w_scale)
    xq, xs = quantize_fp8_per_token(x)
    assert rel_l2(out, fp8_linear_ref(xq, xs, q, w_scale)) < 1e-2


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m, k", [(1, 4096), (7, 128), (300, 14336), (33, 1000)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quant_kernel_matches_twin_gpu(m, k, static, dtype):
    pytest.importorskip("triton")
    from pagedllm.kernels.fp8_quant import quant_fp8_per_token

    x = (torch.randn(m, k + 8, generator=torch.Generator().manual_seed(m)) * 3).to(dtype).cuda()[:, :k]
    if m > 2:
        x[1] = 0
    static_scale = torch.tensor([0.02], device="cuda") if static else None
    q, scale = quant_fp8_per_token(x, static_scale)
    q_ref, scale_ref = quantize_fp8_per_token(x, static_scale)
    assert torch.equal(scale, scale_ref)
    differ = q.float() != q_ref.float()
    # IEEE division and round-to-nearest on both sides: equal, but allow a rare one-step tie difference
    assert differ.float().mean().item() <= 1e-3
    assert ((q.float() - q_ref.float()).abs()[differ] <= q_ref.float().abs()[differ] / 8 + 2**-9).all()


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 16, 17, 300])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (48, 64)])
def test_fp8_linear_gpu(m, n, k):
    pytest.importorskip("triton")
    from pagedllm.kernels.fp8_quant import quant_fp8_per_token

    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen) * 0.02
    q, scale, _ = quantize_fp8(w, "channel")
    w_scale = scale.reshape(1, n).float().cuda()
    q = q.cuda()
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    out = fp8_linear(x, q, w_scale, None, bias, quant_fp8_per_token)
    xq, xs = quant_fp8_per_token(x)
    assert rel_l2(out, fp8_linear_ref(xq, xs, q, w_scale, bias)) < 1e-2


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 40])
def test_w8a8_layer_gpu(kind, m):
    layer, deq = fp8_layer(kind, "cuda")
    assert layer.fp8_w8a8  # process_weights_after_loading chose W8A8 on this GPU
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(1)).cuda()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_w8a8(layer, deq, x.to(dtype), kind == "static")


@pytest.mark.gpu
def test_fallbacks_gpu(monkeypatch, caplog):
    """Block-wise weights and GPUs without FP8 matmuls keep the weight-only path (with a one-time warning)."""
    monkeypatch.setattr(fp8_module, "_WARNED", set())
    monkeypatch.setattr(fp8_module, "fp8_matmul_supported", lambda device: False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).cuda()
    with caplog.at_level(logging.WARNING, logger="pagedllm.quantization.fp8"):
        layer, deq = fp8_layer("tensor", "cuda")
        fp8_layer("channel", "cuda")
    assert not getattr(layer, "fp8_w8a8", False)
    assert sum("has no FP8 matmul" in r.message for r in caplog.records) == 1
    assert torch.allclose(layer(x), F.linear(x, deq, layer.bias), atol=1e-5, rtol=1e-5)

    method = Fp8LinearMethod("block", (32, 64))
    with torch.device("cuda"):
        block = Linear(128, 64)
        block.set_linear_method(method)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    q, scale, deq = quantize_fp8(w, "block", (32, 64))
    block.weight.weight_loader(block.weight, q.cuda())
    block.weight_scale.weight_loader(block.weight_scale, scale.cuda())
    method.process_weights_after_loading(block)
    assert not getattr(block, "fp8_w8a8", False)
    assert torch.allclose(block(x), F.linear(x, deq.cuda()), atol=1e-5, rtol=1e-5)
