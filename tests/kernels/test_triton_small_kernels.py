"""Triton RMSNorm (plain and fused with the residual add), SiLU-and-mul, rotary and the KV-cache write,
each against its ``*_ref`` twin.

GPU tests are marked ``gpu``; with ``TRITON_INTERPRET=1`` (see test_triton_interpreter.py) the
``interpret`` tests run small shapes through Triton's CPU interpreter on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils import rel_l2

pytest.importorskip("triton")

from pagedllm.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from pagedllm.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from pagedllm.kernels.reshape_and_cache import KVCacheWrite, reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from pagedllm.kernels.rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from pagedllm.kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Both sides round to the output dtype from the same fp32 math, so they differ by rare one-ulp ties on the GPU;
# the interpreter truncates fp32 -> bf16 instead of rounding, about half an ulp everywhere.
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2 if INTERPRET else 4e-3}



def randn(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# ------------------------------------------------------------------------------------------- checks


def check_rms_norm(num_tokens, hidden, dtype, device, seed=0):
    x = randn(num_tokens, hidden + 8, dtype=dtype, device=device, seed=seed, scale=3.0)[
        :, :hidden
    ]  # strided rows
    residual = randn(num_tokens, hidden, dtype=dtype, device=device, seed=seed + 1)
    weight = randn(hidden, dtype=dtype, device=device, seed=seed + 2)
    eps = 1e-6
    assert rel_l2(rms_norm(x, weight, eps), rms_norm_ref(x, weight, eps)) < TOL[dtype]
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    normed_ref, new_residual_ref = fused_add_rms_norm_ref(x, residual, weight, eps)
    if INTERPRET:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even
        assert rel_l2(new_residual, new_residual_ref) < TOL[dtype]
    else:
        assert torch.equal(new_residual, new_residual_ref)
    assert rel_l2(normed, normed_ref) < TOL[dtype]


def check_silu_and_mul(num_tokens, inter, dtype, device, seed=0):
    x = randn(num_tokens, 2 * inter, dtype=dtype, device=device, seed=seed, scale=3.0)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    assert rel_l2(out, silu_and_mul_ref(x)) < TOL[dtype]


def check_rotary(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, seed=0):
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    freqs = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim // 2]
    cos_cache, sin_cache = freqs.cos().float().to(device), freqs.sin().float().to(device)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    # q and k are views into one fused qkv buffer, as the model produces them.
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=seed)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    qkv_ref = qkv.clone()
    q_ref = qkv_ref[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_ref = qkv_ref[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    rotary_embedding(positions, q, k, cos_cache, sin_cache)
    rotary_embedding_ref(positions, q_ref, k_ref, cos_cache, sin_cache)
    assert rel_l2(q, q_ref) < TOL[dtype] and rel_l2(k, k_ref) < TOL[dtype]
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], qkv_ref[:, v_start:])  # v untouched


def check_reshape_and_cache(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, seed=0, cache_gap=0):
    """Against the twin on a NaN-poisoned cache. ``cache_gap``: the cache is a view of a buffer with that many NaN
    lanes after each head, which must stay NaN (a head that is not a power of two is padded in the kernel)."""
    num_blocks = triton_cdiv(num_tokens, block_size) + 4
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens
    slot_mapping = slots.to(torch.int64).to(device)
    kv = randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed)
    key, value = kv[:, :num_kv_heads], kv[:, 2 * num_kv_heads :]  # strided views
    buf = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim + cache_gap), float("nan"), dtype=dtype, device=device
    )
    cache = buf[..., :head_dim]
    cache_ref = cache.clone()
    reshape_and_cache(key, value, cache, slot_mapping)
    reshape_and_cache_ref(key, value, cache_ref, slot_mapping)
    assert torch.equal(cache.isnan(), cache_ref.isnan())  # the same slots written, the rest untouched
    assert torch.equal(cache.nan_to_num(), cache_ref.nan_to_num())
    assert buf[..., head_dim:].isnan().all()  # nothing written past a head


def check_rope_writes_cache(
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size, dtype, device, norm=False,
    cache_dtype=None, seed=0,
):  # fmt: skip
    """RoPE (or q/k norm + RoPE) with a KVCacheWrite equals the same kernel without it followed by
    reshape_and_cache, bit for bit: q, k, v and every cache slot (written or not, NaN-poisoned)."""
    g = torch.Generator().manual_seed(seed)
    half = rotary_dim // 2
    cos_sin = torch.rand(4096, 2, half, generator=g).to(dtype).to(device)
    cos, sin = cos_sin[:, 0], cos_sin[:, 1]
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed)
    weights = (torch.rand(2, head_dim, generator=g) + 0.5).to(dtype).to(device)
    num_blocks = triton_cdiv(num_tokens, block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens
    slot_mapping = slots.to(torch.int64).to(device)
    cache0 = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device
    ).to(cache_dtype or dtype)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype is not None else (1.0, 1.0)
    results = []
    for fused in (False, True):
        x, cache = qkv.clone(), cache0.clone()
        q, k, v = x.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        write = KVCacheWrite(v, cache, slot_mapping, k_scale, v_scale) if fused else None
        if norm:
            qk_norm_rope(positions, q, k, weights[0], weights[1], 1e-6, cos, sin, cache=write)
        else:
            rotary_embedding(positions, q, k, cos, sin, cache=write)
        if not fused:
            reshape_and_cache(k, v, cache, slot_mapping, k_scale, v_scale)
        results.append((x, cache.float()))
    (x_a, cache_a), (x_b, cache_b) = results
    assert torch.equal(x_a, x_b)
    assert torch.equal(cache_a.isnan(), cache_b.isnan())
    assert torch.equal(cache_a.nan_to_num(), cache_b.nan_to_num())
    assert not cache_b.isnan().all()  # something was written


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (7, 896), (300, 4096), (33, 8192), (5, 5120), (2, 100)])
def test_rms_norm_gpu(dtype, shape):
    check_rms_norm(*shape, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 14336), (9, 4864), (257, 1000), (64, 11008)])
def test_silu_and_mul_gpu(dtype, shape):
    check_silu_and_mul(*shape, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(1, 32, 8, 128, 128), (77, 28, 4, 128, 128), (300, 16, 16, 64, 64), (5, 8, 2, 128, 64), (9, 24, 8, 128, 96)],
)
def test_rotary_gpu(dtype, shape):
    check_rotary(*shape, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
@pytest.mark.parametrize("heads_dim", [(8, 128), (2, 64), (5, 128), (32, 96), (8, 80), (4, 192)])
def test_reshape_and_cache_gpu(dtype, block_size, heads_dim):
    gap = 0 if heads_dim[1] & (heads_dim[1] - 1) == 0 else 16  # padded heads: in a buffer with NaN between heads
    check_reshape_and_cache(1000, *heads_dim, block_size, dtype, "cuda", cache_gap=gap)


# (tokens, heads, kv heads, head_dim, rotary_dim, block_size)
ROPE_CACHE_SHAPES = [
    (300, 32, 8, 128, 128, 16),
    (17, 16, 8, 128, 64, 1),
    (64, 14, 2, 64, 32, 8),
    (33, 24, 8, 128, 96, 16),  # Phi-4-mini: rotary_dim 96 of 128, half 48 padded to 64
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("shape", ROPE_CACHE_SHAPES)
def test_rope_writes_cache_gpu(dtype, norm, shape):
    check_rope_writes_cache(*shape, dtype, "cuda", norm=norm)
    check_rope_writes_cache(*shape, dtype, "cuda", norm=norm, cache_dtype=torch.float8_e4m3fn, seed=1)


@pytest.mark.gpu
@needs_cuda
def test_reshape_and_cache_large_cache_gpu():
    """Offsets past 2**31 elements: the slot arithmetic must be 64-bit."""
    num_blocks, block_size, heads, dim = (
        4200,
        16,
        8,
        128,
    )  # 2 * 4200 * 16 * 8 * 128 > 2**31... per half ~ 6.9e7
    num_blocks = 2**31 // (block_size * heads * dim) + 64
    try:
        cache = torch.zeros((2, num_blocks, block_size, heads, dim), dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    key = randn(2, heads, dim, dtype=torch.bfloat16, device="cuda")
    value = randn(2, heads, dim, dtype=torch.bfloat16, device="cuda", seed=1)
    slot_mapping = torch.tensor([(num_blocks - 1) * block_size + 3, 5], dtype=torch.int64, device="cuda")
    reshape_and_cache(key, value, cache, slot_mapping)
    assert torch.equal(cache[0, num_blocks - 1, 3], key[0]) and torch.equal(
        cache[1, num_blocks - 1, 3], value[0]
    )
    assert torch.equal(cache[0, 0, 5], key[1]) and torch.equal(cache[1, 0, 5], value[1])


# --------------------------------------------------------------------------------------- interpreter


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_kernels_interpret(dtype):
    check_rms_norm(5, 96, dtype, "cpu")
    check_silu_and_mul(3, 1500, dtype, "cpu")
    check_rotary(6, 4, 2, 32, 32, dtype, "cpu")
    check_rotary(3, 5, 1, 64, 32, dtype, "cpu")  # partial rotary, non power-of-two head count
    check_rotary(4, 3, 1, 32, 24, dtype, "cpu")  # rotary half 12: padded to 16 (3/4 of a head, as Phi-4-mini)
    check_reshape_and_cache(20, 3, 16, 4, dtype, "cpu")
    check_reshape_and_cache(9, 2, 32, 1, dtype, "cpu")
    check_reshape_and_cache(11, 3, 96, 4, dtype, "cpu", cache_gap=16)  # Phi-3's head: padded to 128, masked
    check_reshape_and_cache(7, 2, 48, 2, dtype, "cpu", cache_gap=8)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_writes_cache_interpret(dtype):
    check_rope_writes_cache(7, 4, 2, 32, 32, 4, dtype, "cpu")
    check_rope_writes_cache(5, 5, 1, 64, 32, 16, dtype, "cpu")  # partial rotary
    check_rope_writes_cache(4, 3, 1, 32, 24, 4, dtype, "cpu")  # rotary half 12: padded to 16
    check_rope_writes_cache(6, 4, 2, 32, 32, 4, dtype, "cpu", norm=True)
    check_rope_writes_cache(3, 6, 3, 64, 32, 1, dtype, "cpu", norm=True)


def test_rope_cache_write_refuses_padded_heads():
    """The RoPE kernels' cache write covers power-of-two heads only (they pass no HEAD_PAD to cache_token): a
    KVCacheWrite for a 96-wide head is refused before any launch (reshape_and_cache takes it)."""
    kv = torch.zeros(3, 2, 96)
    write = KVCacheWrite(kv, torch.zeros(2, 4, 4, 2, 96), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(AssertionError, match="power-of-two heads"):
        write.check(kv)
    KVCacheWrite(kv[..., :64], torch.zeros(2, 4, 4, 2, 64), torch.zeros(3, dtype=torch.int64)).check(kv[..., :64])
