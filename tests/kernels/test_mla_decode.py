"""MLA decode (absorbed form over the paged latent cache): the PyTorch twin against the expanded per-head
attention it stands for (always, on CPU), the Triton kernel against the twin in Triton's CPU interpreter
(``TRITON_INTERPRET=1 pytest tests/kernels/test_mla_decode.py``; skipped otherwise) and on the GPU (``gpu``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedllm.attention.mla import write_latent_cache
from pagedllm.kernels.mla_decode import mla_decode_ref
from tests.utils import rel_l2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def make_batch(
    seq_lens: list[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict:
    """One query per request over a NaN-poisoned paged latent cache with scattered blocks; the block table's
    unused entries hold invalid ids."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(
        10**6, 10**7, (len(seq_lens), max(blocks_per_req, default=0) + 2), generator=g
    )
    block_table = block_table.to(torch.int32)
    width = kv_lora_rank + rope_dim
    kv_cache = torch.full((num_blocks, block_size, width), float("nan"))
    used = 0
    for r, (n_blocks, s) in enumerate(zip(blocks_per_req, seq_lens)):
        ids = perm[used : used + n_blocks]
        used += n_blocks
        block_table[r, :n_blocks] = ids.to(torch.int32)
        flat = kv_cache[ids].flatten(0, 1)  # [n_blocks * block_size, width]
        flat[:s] = torch.randn(s, width, generator=g)
        kv_cache[ids] = flat.view(n_blocks, block_size, width)
    # The queries are strided views, as when split out of wider projections.
    q_latent = torch.randn(len(seq_lens), num_heads, kv_lora_rank + 5, generator=g)[..., :kv_lora_rank]
    q_pe = torch.randn(len(seq_lens), num_heads, rope_dim + 3, generator=g)[..., :rope_dim]
    return dict(
        q_latent=q_latent.to(dtype).to(device),
        q_pe=q_pe.to(dtype).to(device),
        kv_cache=kv_cache.to(dtype).to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens, default=0),
    )



def test_absorbed_twin_equals_expanded_attention() -> None:
    """The twin's latent-space attention, mapped through W_UV, equals per-head attention over keys
    ``[W_UK c | k_pe]`` and values ``W_UV c`` (what transformers computes), in float64."""
    heads, nope, v_dim, rank, rope = 3, 8, 6, 16, 4
    b = make_batch([5, 1, 13], heads, rank, rope, 4, torch.float64, "cpu")
    g = torch.Generator().manual_seed(1)
    w_uk = torch.randn(heads, nope, rank, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=g, dtype=torch.float64)
    q_nope = torch.randn(3, heads, nope, generator=g, dtype=torch.float64)
    q_latent = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)
    scale = 0.3
    out = mla_decode_ref(q_latent, b["q_pe"], b["kv_cache"], b["block_table"], b["seq_lens"], scale, 13)
    out = torch.einsum("bhl,hvl->bhv", out, w_uv)  # [B, H, V]
    for r, s in enumerate([5, 1, 13]):
        rows = b["kv_cache"][b["block_table"][r, : -(-s // 4)].long()].flatten(0, 1)[:s]  # [s, L + R]
        c, k_pe = rows[:, :rank], rows[:, rank:]
        for h in range(heads):
            k = torch.cat([c @ w_uk[h].T, k_pe], dim=-1)  # [s, P + R]
            q = torch.cat([q_nope[r, h], b["q_pe"][r, h]])  # [P + R]
            p = torch.softmax(k @ q * scale, dim=0)
            torch.testing.assert_close(out[r, h], p @ (c @ w_uv[h].T))


def test_twin_reads_only_its_context_and_zeroes_empty_rows() -> None:
    """NaN past a request's length and invalid block ids past its blocks are never read; seq_len 0 gives 0."""
    b = make_batch([7, 0, 3], 4, 16, 8, 4, torch.float32, "cpu")
    out = mla_decode_ref(b["q_latent"], b["q_pe"], b["kv_cache"], b["block_table"], b["seq_lens"], 0.25, 7)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_write_latent_cache_skips_padding_without_host_sync() -> None:
    """Slots of -1 leave the cache as it was, whichever tokens carry them (none, some, all)."""
    cache = torch.randn(4, 2, 6)
    latent, k_pe = torch.randn(4, 4), torch.randn(4, 2)
    for slots in ([3, -1, 6, -1], [-1, 1, -1, 0], [-1, -1, -1, -1], [7, 2, 5, 4]):
        before = cache.clone()
        write_latent_cache(latent, k_pe, cache, torch.tensor(slots))
        want = before.view(8, 6).clone()
        for t, s in enumerate(slots):
            if s >= 0:
                want[s] = torch.cat([latent[t], k_pe[t]])
        assert torch.equal(cache.view(8, 6), want), slots


# ------------------------------------------------------------------------------------------------ Triton


def check_kernel(
    seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device, num_splits=None
) -> float:
    from pagedllm.kernels.mla_decode import mla_decode

    b = make_batch(seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device)
    scale = 1.0 / math.sqrt(kv_lora_rank // 4 + rope_dim)
    args = (b["q_latent"], b["q_pe"], b["kv_cache"], b["block_table"], b["seq_lens"], scale, b["max_seq_len"])
    out = torch.full(b["q_latent"].shape, float("nan"), dtype=dtype, device=device)
    mla_decode(*args, out=out, num_splits=num_splits)
    ref = mla_decode_ref(
        b["q_latent"].double(), b["q_pe"].double(), b["kv_cache"].double(), *args[3:]
    )  # float64 oracle
    err = rel_l2(out, ref)
    assert err < TOL[dtype], f"rel L2 {err:.2e} >= {TOL[dtype]:.0e} for {seq_lens}"
    empty = [r for r, s in enumerate(seq_lens) if s == 0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    return err


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_interpret(dtype) -> None:
    check_kernel([1, 17, 40, 0, 33], 4, 32, 16, 4, dtype, "cpu")  # fewer heads than a head block
    check_kernel([9, 64, 3], 20, 48, 8, 8, dtype, "cpu")  # two head blocks; latent and rope widths padded


@needs_interpreter
@pytest.mark.parametrize("num_splits", [2, 4])
def test_mla_decode_split_k_interpret(num_splits) -> None:
    check_kernel([70, 1, 0, 130], 4, 32, 16, 16, torch.float32, "cpu", num_splits=num_splits)


@needs_interpreter
def test_model_decodes_through_kernel_interpret(tmp_path, monkeypatch) -> None:
    """The model's decode steps through the Triton kernel (as on CUDA with the Triton backend), here in the
    interpreter: transformers' logits at every position."""
    from types import SimpleNamespace

    import pagedllm.attention.mla as mla
    import pagedllm.kernels.mla_decode as mla_decode
    from tests.models.test_deepseek import VARIANTS, make_tiny_deepseek, paged_logits
    from tests.models.test_models import hf_logits, load_ours

    cls_name, overrides = VARIANTS["v3"]
    path = make_tiny_deepseek(cls_name, tmp_path / "v3", seed=5, **overrides)
    model, _ = load_ours(path)
    monkeypatch.setattr(mla, "use_fused_kernels", lambda x: True)
    for module in model.modules():
        if isinstance(module, mla.MLAAttention):
            module.attn_backend = SimpleNamespace(name="triton")
    calls = []
    kernel = mla_decode.mla_decode
    monkeypatch.setattr(mla_decode, "mla_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    prompt = list(range(10, 40))
    got = paged_logits(model, prompt, [20, 4] + [1] * 6)
    torch.testing.assert_close(got, hf_logits(path, prompt), atol=1e-4, rtol=0)
    assert len(calls) == 6 * 3  # six decode steps, three layers


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_decode_gpu(dtype, num_heads) -> None:
    """DeepSeek's widths (latent 512, rope 64): short and long contexts, split-K by the rule and forced off."""
    lens = [1, 17, 300, 0, 4096, 33]
    check_kernel(lens, num_heads, 512, 64, 16, dtype, "cuda")
    check_kernel(lens, num_heads, 512, 64, 64, dtype, "cuda", num_splits=1)
