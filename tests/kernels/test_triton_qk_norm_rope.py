"""The fused per-head q/k RMSNorm + rotary kernel against its ``qk_norm_rope_ref`` twin, and the twin against
the unfused sequence it replaces (per-head ``rms_norm_ref`` then ``rotary_embedding_ref``, and the model's own
RMSNorm + RotaryEmbedding layers).

q and k are strided views split from one qkv tensor, as the attention layer makes them, and cos/sin are column
views of one ``[max_pos, rotary_dim]`` table, as RotaryEmbedding passes them. ``gpu`` tests run the real shapes;
``*_interpret`` tests run small shapes through Triton's CPU interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedllm.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402
from pagedllm.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from pagedllm.kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
MAX_POS = 4096


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v as the attention layer makes them: strided views of the fused projection's output."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def cos_sin_table(rotary_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Column views ``[MAX_POS, rotary_dim // 2]`` of one fp32 ``[cos | sin]`` table, as RotaryEmbedding has it."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)  # [MAX_POS, rotary_dim]
    half = rotary_dim // 2
    return table[:, :half], table[:, half:]


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, seed=0, pos_dtype=None):
    g = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # Per-(token, head) scales over two decades, so every head has its own rms.
    scale = torch.exp(torch.randn(num_tokens, num_heads + 2 * num_kv_heads, 1, generator=g) * 1.5)
    qkv = (torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g) * scale).reshape(
        num_tokens, width
    )
    q_weight = 1.0 + 0.5 * torch.randn(head_dim, generator=g)
    k_weight = 1.0 + 0.5 * torch.randn(head_dim, generator=g)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g)
    if pos_dtype is None:
        pos_dtype = torch.int32 if seed % 2 else torch.int64
    cos, sin = cos_sin_table(rotary_dim, device)
    return (
        positions.to(pos_dtype).to(device),
        qkv.to(dtype).to(device),
        q_weight.to(dtype).to(device),
        k_weight.to(dtype).to(device),
        cos,
        sin,
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    if INTERPRET and dtype == torch.bfloat16:
        # The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even), at each of the three
        # roundings, so only closeness holds there.
        torch.testing.assert_close(out, ref, rtol=4e-2, atol=4e-2, msg=lambda m: f"{what}: {m}")
        return
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    # Same rounding sequence: only rare one-ulp ties (summation order, rsqrt, FMA) may differ.
    same = (out == ref).float().mean().item()
    assert same >= 0.99, f"{what}: only {same:.4f} of elements bitwise equal"


def check_qk_norm_rope(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, seed=0):
    positions, qkv, q_weight, k_weight, cos, sin = make_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, seed
    )
    qkv_ref, qkv_unfused = qkv.clone(), qkv.clone()
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q_ref, k_ref, _ = split_qkv(qkv_ref, num_heads, num_kv_heads, head_dim)
    assert num_tokens < 2 or not (q.is_contiguous() or k.is_contiguous())  # strided rows, as in the model
    v_before = v.clone()
    assert qk_norm_rope(positions, q, k, q_weight, k_weight, EPS, cos, sin) is None
    qk_norm_rope_ref(positions, q_ref, k_ref, q_weight, k_weight, EPS, cos, sin)
    assert torch.equal(v, v_before), "v was written"
    assert_matches(q, q_ref, dtype, "q")
    assert_matches(k, k_ref, dtype, "k")
    if device == "cuda":  # also against the three unfused Triton launches it replaces
        q_u, k_u, _ = split_qkv(qkv_unfused, num_heads, num_kv_heads, head_dim)
        q_u.copy_(rms_norm(q_u.reshape(-1, head_dim), q_weight, EPS).view_as(q_u))
        k_u.copy_(rms_norm(k_u.reshape(-1, head_dim), k_weight, EPS).view_as(k_u))
        rotary_embedding(positions, q_u, k_u, cos, sin)
        assert_matches(q, q_u, dtype, "q vs unfused")
        assert_matches(k, k_u, dtype, "k vs unfused")


# Shapes: (num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim).
INTERPRET_SHAPES = [
    (1, 16, 8, 128, 128),
    (5, 16, 8, 64, 64),
    (8, 16, 8, 128, 64),  # partial rotary
    (3, 6, 3, 64, 64),  # heads not powers of two
    (4, 6, 3, 128, 64),  # both
    (2, 5, 1, 64, 16),  # tail 48: padded to 64 and masked
    (2, 3, 1, 80, 80),  # half 40, head_dim 80: padded rotary halves
]
GPU_SHAPES = [
    (1, 16, 8, 128, 128),
    (1000, 16, 8, 128, 128),  # Qwen3-0.6B/1.7B
    (257, 32, 8, 128, 128),  # Qwen3-8B
    (64, 64, 8, 128, 128),  # Qwen3-32B
    (300, 6, 3, 128, 128),
    (77, 16, 8, 128, 64),
    (33, 14, 2, 64, 32),
    (19, 8, 4, 256, 256),
    (5, 8, 4, 256, 64),
    (9, 5, 1, 96, 64),
]


# ------------------------------------------------------------------------------------- everywhere (CPU)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 6, 3, 64, 64), (4, 16, 8, 128, 64)])
def test_qk_norm_rope_ref_is_unfused_sequence(dtype, shape):
    """The twin is per-head rms_norm_ref (rows of [T * heads, head_dim]) then rotary_embedding_ref, bit for bit,
    and that is what the attention layer computes today with its RMSNorm and RotaryEmbedding modules."""
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = shape
    positions, qkv, q_weight, k_weight, cos, sin = make_inputs(*shape, dtype, "cpu", seed=3)
    q, k, _ = split_qkv(qkv.clone(), num_heads, num_kv_heads, head_dim)
    qk_norm_rope_ref(positions, q, k, q_weight, k_weight, EPS, cos, sin)

    q2, k2, _ = split_qkv(qkv.clone(), num_heads, num_kv_heads, head_dim)
    for x, w in ((q2, q_weight), (k2, k_weight)):
        x.copy_(rms_norm_ref(x.reshape(-1, head_dim), w, EPS).view_as(x))
    rotary_embedding_ref(positions, q2, k2, cos, sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)

    q3, k3, _ = split_qkv(qkv.clone(), num_heads, num_kv_heads, head_dim)
    q_norm, k_norm = RMSNorm(head_dim, EPS).to(dtype), RMSNorm(head_dim, EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(q_weight)
        k_norm.weight.copy_(k_weight)
        rope = RotaryEmbedding(head_dim, MAX_POS, rotary_dim=rotary_dim)
        q3, k3 = rope(positions, q_norm(q3), k_norm(k3))
    torch.testing.assert_close(q, q3, rtol=0, atol=0)
    torch.testing.assert_close(k, k3, rtol=0, atol=0)


def test_qk_norm_rope_empty_launches_nothing():
    """T == 0 returns before launching (a launch on CPU tensors outside the interpreter would raise)."""
    positions, qkv, q_weight, k_weight, cos, sin = make_inputs(0, 6, 3, 64, 64, torch.bfloat16, "cpu")
    q, k, v = split_qkv(qkv, 6, 3, 64)
    assert qk_norm_rope(positions, q, k, q_weight, k_weight, EPS, cos, sin) is None
    assert q.shape == (0, 6, 64) and k.shape == (0, 3, 64)


def test_qk_norm_rope_rejects_bad_arguments():
    positions, qkv, q_weight, k_weight, cos, sin = make_inputs(2, 4, 2, 64, 64, torch.float32, "cpu")
    q, k, _ = split_qkv(qkv, 4, 2, 64)
    with pytest.raises(AssertionError, match="q_weight"):
        qk_norm_rope(positions, q, k, q_weight[:32], k_weight, EPS, cos, sin)
    with pytest.raises(AssertionError, match="positions"):
        qk_norm_rope(positions[:1], q, k, q_weight, k_weight, EPS, cos, sin)
    with pytest.raises(AssertionError, match="k "):
        qk_norm_rope(positions, q, k[..., :32], q_weight, k_weight, EPS, cos, sin)
    with pytest.raises(AssertionError, match="rotary_dim"):
        wide = torch.zeros(MAX_POS, 64)
        qk_norm_rope(positions, q, k, q_weight, k_weight, EPS, wide, wide)
    with pytest.raises(AssertionError, match="contiguous"):
        qk_norm_rope(positions, q.transpose(1, 2).contiguous().transpose(1, 2), k, q_weight, k_weight, EPS, cos, sin)


# --------------------------------------------------------------------------------------- interpreter


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", INTERPRET_SHAPES)
def test_qk_norm_rope_interpret(dtype, shape):
    check_qk_norm_rope(*shape, dtype, "cpu", seed=sum(shape))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_qk_norm_rope_gpu(dtype, shape):
    check_qk_norm_rope(*shape, dtype, "cuda", seed=sum(shape))


@pytest.mark.gpu
@needs_cuda
def test_qk_norm_rope_empty_gpu():
    """Zero tokens: returns without launching a zero-size grid (which CUDA refuses), and the step goes on."""
    positions, qkv, q_weight, k_weight, cos, sin = make_inputs(0, 16, 8, 128, 128, torch.bfloat16, "cuda")
    q, k, _ = split_qkv(qkv, 16, 8, 128)
    assert qk_norm_rope(positions, q, k, q_weight, k_weight, EPS, cos, sin) is None
    torch.cuda.synchronize()  # an asynchronous launch error would surface here
    assert q.shape == (0, 16, 128) and k.shape == (0, 8, 128)
    check_qk_norm_rope(3, 16, 8, 128, 128, torch.bfloat16, "cuda", seed=1)  # a step after it still computes
