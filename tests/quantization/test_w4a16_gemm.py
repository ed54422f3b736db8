"""Triton W4A16 GEMM (GPTQ layout) vs its PyTorch twin, the twin vs the GPTQ layer's dequantization, and the GPTQ
and AWQ layers' kernel path (act-order rows sorted at load, AWQ repacked) vs their PyTorch path.

Without Triton (CI) the module is skipped. ``TRITON_INTERPRET=1 pytest tests/quantization/test_w4a16_gemm.py``
runs the ``interpret`` tests on CPU tensors through Triton's interpreter; the ``gpu`` tests need CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.utils import rel_l2

pytest.importorskip("triton")

from pagedllm.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref  # noqa: E402
from pagedllm.layers.linear import Linear, MergedLinear  # noqa: E402
from pagedllm.quantization.awq import AWQConfig  # noqa: E402
from pagedllm.quantization.gptq import GPTQConfig  # noqa: E402
from tests.quantization.quant_utils import quantize_awq, quantize_gptq  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")



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
    x, ops, deq = make_operands(5, 64, 48, 16, False, "cpu", torch.float32)
    grouped = w4a16_gemm_ref(x, *ops[:3], None, group_size=16)
    assert torch.allclose(grouped, x @ deq.t(), atol=1e-5, rtol=1e-5)


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


# (m, k, n, group_size, block_k, split_k): grouped mode (no g_idx), split-K partials summed by the launcher
GROUPED = [
    (1, 128, 64, 32, 32, 1),
    (3, 256, 96, 64, 32, 3),  # 3 splits of 96 channels (a multiple of BLOCK_K), groups of 64
    (5, 256, 40, -1, 64, 2),  # one group
    (17, 128, 64, 128, 64, 4),  # group == K
    (2, 192, 32, 64, 64, 2),  # 192 = 3 BLOCK_K steps split 2 + 1
    (4, 128, 48, 8, 16, 1),  # groups narrower than any dot step: the launcher gathers instead
]


@needs_interpreter
@pytest.mark.parametrize("m, k, n, group_size, block_k, split_k", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_grouped_split_k_interpret(m, k, n, group_size, block_k, split_k, dtype):
    x, ops, deq = make_operands(m, k, n, group_size, False, "cpu", dtype)
    gs = k if group_size == -1 else group_size
    out = w4a16_gemm(
        x, *ops[:3], None, 1, group_size=gs, block_m=16, block_n=32, block_k=block_k, split_k=split_k
    )
    ref = w4a16_gemm_ref(x, *ops[:3], None, 1, group_size=gs)
    assert torch.equal(ref, w4a16_gemm_ref(x, *ops))  # the grouped map is the checkpoint's g_idx
    assert rel_l2(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


# ------------------------------------------------------------------------------------------------ layer paths
def _load(layer: Linear, method, tensors_per_shard: list[dict[str, torch.Tensor]], device: str) -> Linear:
    with torch.device(device):
        layer.set_linear_method(method)
    for shard_id, tensors in enumerate(tensors_per_shard):
        for suffix, tensor in tensors.items():
            param = getattr(layer, suffix)
            param.weight_loader(param, tensor.to(device), shard_id if layer.fused else None)
    method.process_weights_after_loading(layer)
    return layer


def gptq_layer(kind: str, device: str = "cpu", v2: bool = False) -> tuple[Linear, torch.Tensor]:
    """A fused [64, 32, 32] x 128 GPTQ layer; ``kind``: ``shared`` (act-order, one permutation for all shards, as
    published checkpoints), ``per-shard`` (a permutation each), ``plain`` (no act-order), ``all`` (one group)."""
    sizes, k = [64, 32, 32], 128
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, k, generator=gen) * 0.1 for n in sizes]
    group_size = {"all": -1, "plain": 32}.get(kind, 32)
    parts = []
    for w in weights:
        g = torch.Generator().manual_seed(7) if kind == "shared" else gen
        parts.append(quantize_gptq(w, group_size, kind in ("shared", "per-shard"), g, v2=v2))
    config = GPTQConfig.from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": kind != "plain"}
        | ({"checkpoint_format": "gptq_v2"} if v2 else {})
    )
    with torch.device(device):
        layer = MergedLinear(k, sizes, bias=True)
    layer.bias.data.copy_(torch.randn(sum(sizes), generator=gen).to(device))
    _load(layer, config.get_linear_method(layer, "x", ["x"]), [p for p, _ in parts], device)
    return layer, torch.cat([deq for _, deq in parts]).to(device)


def awq_layer(device: str = "cpu") -> tuple[Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 128, generator=gen)
    tensors, deq = quantize_awq(w, 32)
    with torch.device(device):
        layer = Linear(128, 48)
    config = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    _load(layer, config.get_linear_method(layer, "x", ["x"]), [tensors], device)
    return layer, deq.to(device)


GPTQ_KINDS = [("shared", False, "grouped", True), ("per-shard", False, "gather", False)]
# act-order with one group is no permutation at all
GPTQ_KINDS += [
    ("plain", False, "grouped", False),
    ("all", True, "grouped", False),
    ("shared", True, "grouped", True),
]


@needs_interpreter
@pytest.mark.parametrize("kind, v2, mode, permuted", GPTQ_KINDS)
def test_gptq_layer_kernel_path_interpret(kind, v2, mode, permuted):
    layer, deq = gptq_layer(kind, v2=v2)
    assert getattr(layer, "w4a16_mode", None) is None  # CPU tensors: the PyTorch path
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0))
    expected = F.linear(x, deq, layer.bias)
    assert torch.equal(layer(x), expected)
    layer.quant_method.prepare_kernel(layer)
    assert layer.w4a16_mode == mode and (layer.w4a16_perm is not None) == permuted
    assert torch.equal(layer.quant_method.dequantize(layer), deq)  # the reordering is undone
    out = layer(x)  # the kernel, in the interpreter
    assert out.shape == expected.shape
    assert rel_l2(out, expected) < 1e-5
    for dtype in (torch.bfloat16, torch.float16):
        assert rel_l2(layer(x.to(dtype)), expected) < 1e-2


@needs_interpreter
def test_awq_layer_repacked_for_the_kernel_interpret():
    layer, deq = awq_layer()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    expected = F.linear(x, deq)
    assert torch.equal(layer(x), expected)
    layer.quant_method.prepare_kernel(layer)
    assert layer.qweight.shape == (16, 48)  # GPTQ's layout: packed along the input dim
    assert torch.equal(layer.quant_method.dequantize(layer), deq)
    assert rel_l2(layer(x), expected) < 1e-5
    assert rel_l2(layer(x.to(torch.bfloat16)), expected) < 1e-2


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_gemm_gpu(m, dtype):
    x, ops, _ = make_operands(m, 512, 384, 128, True, "cuda", dtype)
    out = w4a16_gemm(x, *ops)
    ref = w4a16_gemm_ref(x, *ops)
    assert rel_l2(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("split_k", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_grouped_gpu(m, split_k, dtype):
    """Llama-8B-like K with a narrow N (so the default picks split-K for decode-sized M)."""
    x, ops, _ = make_operands(m, 4096, 512, 128, False, "cuda", dtype)
    out = w4a16_gemm(x, *ops[:3], None, 1, group_size=128, split_k=split_k)
    ref = w4a16_gemm_ref(x, *ops[:3], None, 1, group_size=128)
    assert rel_l2(out, ref) < 1e-2
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind, v2, mode, permuted", GPTQ_KINDS)
@pytest.mark.parametrize("m", [1, 40])
def test_gptq_layer_cuda_vs_cpu_twin(kind, v2, mode, permuted, m):
    cpu, deq = gptq_layer(kind, v2=v2)
    gpu, _ = gptq_layer(kind, "cuda", v2=v2)
    assert gpu.w4a16_mode == mode and (gpu.w4a16_perm is not None) == permuted
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(0))
    expected = cpu(x)  # float32 PyTorch twin
    assert torch.equal(gpu.quant_method.dequantize(gpu).cpu(), deq)
    assert rel_l2(gpu(x.cuda()).cpu(), expected) < 1e-5  # float32 input: IEEE fp32 products
    assert rel_l2(gpu(x.cuda().bfloat16()).cpu(), expected) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 40])
def test_awq_layer_cuda_vs_cpu_twin(m):
    cpu, deq = awq_layer()
    gpu, _ = awq_layer("cuda")
    assert gpu.w4a16_mode == "grouped" and gpu.qweight.shape == (16, 48)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(0))
    expected = cpu(x)
    assert torch.equal(gpu.quant_method.dequantize(gpu).cpu(), deq)
    assert rel_l2(gpu(x.cuda()).cpu(), expected) < 1e-5
    assert rel_l2(gpu(x.cuda().bfloat16()).cpu(), expected) < 1e-2
