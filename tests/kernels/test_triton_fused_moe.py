"""The MoE grouped GEMM (pagedllm.kernels.fused_moe) against its PyTorch twin and a dense oracle.

``moe_align`` and the twin run everywhere (no Triton needed). The Triton kernel runs in ``gpu`` tests, and in
``interpret`` tests through Triton's CPU interpreter: ``TRITON_INTERPRET=1 pytest tests/kernels/test_fused_moe.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.fused_moe import fused_experts_ref, moe_align

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")


def make_inputs(tokens, num_experts, top_k, hidden, inter, dtype, device, seed=0, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert nobody picks: no block for it
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(w13), cast(w2), weights.to(device), ids.to(device)


def dense_oracle(x, w13, w2, weights, ids):  # float64, every expert on every token
    x, w13, w2 = x.double(), w13.double(), w2.double()
    mix = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64, device=x.device)
    mix.scatter_(1, ids, weights.double())
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        out += mix[:, e : e + 1] * ((F.silu(gate) * up) @ w2[e].T)
    return out


def test_moe_align_groups_and_pads_by_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])  # assignments a = token * 2 + k
    sorted_ids, block_expert = moe_align(ids, num_experts=5, block_m=4)
    pad = ids.numel()
    assert block_expert.tolist() == [0, 2, 3]  # experts 1 and 4 get no block
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, 7, 3, 6, pad, pad]
    sorted_ids, block_expert = moe_align(ids, num_experts=5, block_m=2)
    assert block_expert.tolist() == [0, 2, 2, 3]
    assert sorted_ids.tolist() == [1, 4, 0, 2, 5, 7, 3, 6]


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_ref_matches_dense_oracle(tokens: int) -> None:
    x, w13, w2, weights, ids = make_inputs(
        tokens, 6, 2, 32, 24, torch.float32, "cpu", seed=tokens, skip_expert=1
    )
    out = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), dense_oracle(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def check_kernel(tokens, num_experts, top_k, hidden, inter, dtype, device, block_m=16, seed=0):
    from pagedllm.kernels.fused_moe import fused_experts

    x, w13, w2, weights, ids = make_inputs(
        tokens, num_experts, top_k, hidden, inter, dtype, device, seed=seed, skip_expert=num_experts - 1
    )
    out = fused_experts(x, w13, w2, weights, ids, block_m=block_m)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 5, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), dense_oracle(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize(
    "tokens,num_experts,top_k,hidden,inter,block_m",
    [(1, 4, 2, 32, 16, 16), (9, 8, 2, 64, 48, 16), (21, 4, 1, 40, 24, 16), (13, 6, 3, 32, 80, 32)],
)
def test_fused_experts_interpret(tokens, num_experts, top_k, hidden, inter, block_m) -> None:
    pytest.importorskip("triton")
    check_kernel(
        tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu", block_m=block_m, seed=tokens
    )


@needs_interpreter
def test_fused_experts_bf16_interpret() -> None:
    pytest.importorskip("triton")
    from pagedllm.kernels._interpret import patch_interpreter

    patch_interpreter()
    check_kernel(10, 4, 2, 32, 32, torch.bfloat16, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 64, 1000])
def test_fused_experts_gpu(dtype, tokens) -> None:
    pytest.importorskip("triton")
    check_kernel(tokens, 8, 2, 256, 352, dtype, "cuda", seed=tokens)


@pytest.mark.gpu
@needs_cuda
def test_fused_moe_layer_takes_the_kernel_on_gpu() -> None:
    pytest.importorskip("triton")
    from pagedllm.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(8, 2, 128, 96, renormalize=True).to(torch.bfloat16)
        with torch.no_grad():
            layer.gate.weight.normal_(0, 0.1)
            layer.w13.normal_(0, 0.1)
            layer.w2.normal_(0, 0.1)
        x = torch.randn(37, 128, dtype=torch.bfloat16)
    weights, ids = layer.route(x)
    ref = fused_experts_ref(x, layer.w13, layer.w2, weights, ids)
    torch.testing.assert_close(layer(x).float(), ref.float(), atol=5e-2, rtol=2e-2)


# ------------------------------------------------------- expert biases and GPT-OSS's clamped SwiGLU ("swigluoai")


def make_oai_inputs(tokens, num_experts, top_k, hidden, inter, dtype, device, seed=0):
    """``make_inputs`` plus expert biases; w13 scaled so that gate/up often pass the clamp limit (7)."""
    skip = num_experts - 1
    x, w13, w2, weights, ids = make_inputs(
        tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu", seed=seed, skip_expert=skip
    )
    g = torch.Generator().manual_seed(seed + 1)
    b13 = torch.randn(num_experts, 2 * inter, generator=g)
    b2 = torch.randn(num_experts, hidden, generator=g)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(5 * w13), cast(w2), cast(b13), cast(b2), weights.to(device), ids.to(device)


def dense_oracle_oai(x, w13, w2, b13, b2, weights, ids, alpha=1.702, limit=7.0):
    """float64, every expert on every token: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``,
    with both biases (the gate/up split is the stacked ``[gate rows | up rows]`` order)."""
    x, w13, w2, b13, b2 = (t.double() for t in (x, w13, w2, b13, b2))
    mix = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64, device=x.device)
    mix.scatter_(1, ids, weights.double())
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T + b13[e]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        out += mix[:, e : e + 1] * (((up + 1) * gate * torch.sigmoid(alpha * gate)) @ w2[e].T + b2[e])
    return out


def test_ref_bias_swigluoai_matches_dense_oracle() -> None:
    x, w13, w2, b13, b2, weights, ids = make_oai_inputs(9, 5, 2, 32, 24, torch.float32, "cpu", seed=3)
    h = x @ w13.transpose(1, 2)[0] + b13[0]
    assert (h > 7).any() and (h < -7).any(), "the inputs should reach the clamp on both sides"
    for alpha, limit in ((1.702, 7.0), (0.5, 1.5)):
        out = fused_experts_ref(x, w13, w2, weights, ids, b13, b2, "swigluoai", alpha, limit)
        want = dense_oracle_oai(x, w13, w2, b13, b2, weights, ids, alpha, limit)
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-5)
    silu = fused_experts_ref(x, w13, w2, weights, ids, b13, b2)  # biases with the default SiLU-GLU
    assert (silu - out).abs().max() > 0.1


def check_kernel_oai(tokens, num_experts, top_k, hidden, inter, dtype, device, block_m=16, seed=0):
    from pagedllm.kernels.fused_moe import fused_experts

    x, w13, w2, b13, b2, weights, ids = make_oai_inputs(
        tokens, num_experts, top_k, hidden, inter, dtype, device, seed=seed
    )
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)
    out = fused_experts(x, w13, w2, weights, ids, block_m=block_m, **kw)
    ref = fused_experts_ref(x, w13, w2, weights, ids, **kw)
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    scale = ref.float().abs().max().item()  # outputs of tens: compare relative to their size
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 5 * scale, rtol=tol)
    # the biases alone, with SiLU-GLU
    out = fused_experts(x, w13, w2, weights, ids, block_m=block_m, w13_bias=b13, w2_bias=b2)
    ref = fused_experts_ref(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 5 * scale, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter", [(1, 4, 2, 32, 16), (13, 6, 3, 32, 40)])
def test_fused_experts_bias_swigluoai_interpret(tokens, num_experts, top_k, hidden, inter) -> None:
    pytest.importorskip("triton")
    check_kernel_oai(tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu", seed=tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_fused_experts_bias_swigluoai_gpu(dtype, tokens) -> None:
    pytest.importorskip("triton")
    check_kernel_oai(tokens, 8, 4, 256, 352, dtype, "cuda", seed=tokens)


@pytest.mark.gpu
@needs_cuda
def test_gpt_oss_moe_layer_takes_the_kernel_on_gpu() -> None:
    """The stacked-layout layer with biases and swigluoai on the Triton path vs its twin."""
    pytest.importorskip("triton")
    from pagedllm.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(
            8, 2, 128, 96, renormalize=True, hidden_act="swigluoai", expert_bias=True,
            checkpoint_layout="stacked_interleaved",
        ).to(torch.bfloat16)  # fmt: skip
        with torch.no_grad():
            for t in (layer.gate.weight, layer.w13, layer.w2, layer.w13_bias, layer.w2_bias):
                t.normal_(0, 0.3)
        x = torch.randn(37, 128, dtype=torch.bfloat16)
    weights, ids = layer.route(x)
    ref = fused_experts_ref(
        x, layer.w13, layer.w2, weights, ids, layer.w13_bias, layer.w2_bias, "swigluoai", 1.702, 7.0
    )
    torch.testing.assert_close(layer(x).float(), ref.float(), atol=5e-2, rtol=2e-2)
