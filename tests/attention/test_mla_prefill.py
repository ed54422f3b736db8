"""MLA prefill chunks computed together (``plan_mla_step`` + ``mla_prefill``, pagedllm/attention/mla.py) against the
request-by-request oracle ``mla_prefill_ref``, on CPU in float32; the Triton kernel
(pagedllm/kernels/mla_prefill.py) against its PyTorch twin in Triton's CPU interpreter (``TRITON_INTERPRET=1
pytest tests/attention/test_mla_prefill.py``; skipped otherwise) and on the GPU (``gpu``).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pagedllm.attention.mla as mla
from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.mla import MLAAttention, mla_prefill, mla_prefill_ref, plan_mla_step
from pagedllm.kernels.mla_prefill import mla_prefill_attention_ref, plan_padded_groups
from tests.utils import rel_l2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}

# (query_len, seq_len) per request: fresh prompts (query_len == seq_len), chunks over cached context, decodes
# (query_len 1) between them, a long context over many blocks, lengths spread enough to split the padded groups.
MIXED = [(5, 5), (1, 20), (7, 30), (3, 3), (1, 9), (16, 70), (2, 2), (6, 6), (2, 41)]
CASES = {
    "mixed": MIXED,
    "fresh-equal": [(8, 8)] * 3,
    "one-fresh": [(13, 13)],
    "one-chunk": [(6, 50)],
    "spread": [(2, 120), (30, 30), (4, 4), (1, 3)],
    "decode-first": [(1, 5), (1, 12), (9, 9), (4, 17)],
    "chunk-then-fresh": [(2, 90), (8, 8), (1, 4), (8, 8), (8, 8)],  # two groups, neither padded
    # first query 2 keys before a key-tile edge (16 and 64 keys a tile): the tile it ends must stay masked
    "tile-edges": [(3, 33), (2, 64), (5, 21), (17, 47)],
}


def make_step(
    lens: list[tuple[int, int]],
    num_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    dims: tuple[int, int, int, int] = (32, 8, 16, 24),  # (L, R, P, V): V != P, widths not powers of two
    seed: int = 0,
) -> SimpleNamespace:
    """One step over a NaN-poisoned latent cache whose blocks are shuffled; the block table's unused entries hold
    invalid ids. Queries are strided views (split out of a wider projection), as in the model."""
    kv_lora_rank, rope, nope, v_dim = dims
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for _, s in lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(10**6, 10**7, (len(lens), max(blocks_per_req) + 2), generator=g).to(torch.int32)
    kv_cache = torch.full((num_blocks, block_size, kv_lora_rank + rope), float("nan"))
    used = 0
    for r, (n_blocks, (_, s)) in enumerate(zip(blocks_per_req, lens)):
        ids = perm[used : used + n_blocks]
        used += n_blocks
        block_table[r, :n_blocks] = ids.to(torch.int32)
        flat = kv_cache[ids].flatten(0, 1)  # [n_blocks * block_size, L + R]
        flat[:s] = torch.randn(s, kv_lora_rank + rope, generator=g)
        kv_cache[ids] = flat.view(n_blocks, block_size, -1)
    num_tokens = sum(n for n, _ in lens)
    q = torch.randn(num_tokens, num_heads, nope + rope, generator=g)
    kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope + v_dim), bias=False)
    with torch.no_grad():
        kv_b_proj.weight.copy_(torch.randn(kv_b_proj.weight.shape, generator=g) / math.sqrt(kv_lora_rank))
    q = q.to(dtype).to(device)
    qsl = torch.tensor([0] + [sum(n for n, _ in lens[: r + 1]) for r in range(len(lens))], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    return SimpleNamespace(
        q_nope=q[..., :nope],
        q_pe=q[..., nope:],
        kv_cache=kv_cache.to(dtype).to(device),
        kv_b_proj=kv_b_proj.to(dtype).to(device),
        block_table=block_table.to(device),
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.to(device),
        block_size=block_size,
        prefills=[r for r, (n, _) in enumerate(lens) if n > 1],
        scale=1.0 / math.sqrt(nope + rope),
        shape=(num_tokens, num_heads, v_dim),
    )


def oracle(b: SimpleNamespace) -> torch.Tensor:  # [T, H, V]; rows of decodes zero
    out = torch.zeros(b.shape, dtype=b.q_nope.dtype, device=b.q_nope.device)
    mla_prefill_ref(
        b.q_nope, b.q_pe, b.kv_cache, b.kv_b_proj, b.block_table, b.seq_lens_cpu.tolist(),
        b.query_start_loc_cpu.tolist(), b.prefills, b.scale, out,
    )  # fmt: skip
    return out


def batched(b: SimpleNamespace, use_triton: bool, max_context_rows: int = 10**9) -> torch.Tensor:
    """``plan_mla_step`` + ``mla_prefill`` (per batch of chunks): ``[T, H, V]``, rows of decodes zero."""
    plan = plan_mla_step(
        b.block_table, b.seq_lens, b.seq_lens_cpu, b.query_start_loc_cpu, b.block_size, max_context_rows
    )
    out = torch.zeros(b.shape, dtype=b.q_nope.dtype, device=b.q_nope.device)
    with torch.no_grad():
        for prefills in plan.prefills:
            mla_prefill(b.q_nope, b.q_pe, b.kv_cache, b.kv_b_proj, prefills, b.scale, out, use_triton)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads", [1, 4])
def test_batched_equals_request_by_request(case: str, block_size: int, num_heads: int) -> None:
    b = make_step(CASES[case], num_heads, block_size)
    with torch.no_grad():
        want = oracle(b)
    got = batched(b, use_triton=False)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_context_row_cap_splits_batches() -> None:
    """Chunks whose contexts add up past ``max_context_rows`` go in several batches (a longer single context alone);
    the rows come out the same."""
    b = make_step(MIXED, 4, 4)
    plan = plan_mla_step(b.block_table, b.seq_lens, b.seq_lens_cpu, b.query_start_loc_cpu, 4, max_context_rows=60)
    # prefill contexts 5, 30, 3, 70, 2, 6, 41 -> [5, 30, 3], [70], [2, 6, 41]
    assert [p.seq_lens.tolist() for p in plan.prefills] == [[5, 30, 3], [70], [2, 6, 41]]
    assert [isinstance(p.rows, slice) for p in plan.prefills] == [False, True, True]
    with torch.no_grad():
        want = oracle(b)
    torch.testing.assert_close(batched(b, False, max_context_rows=60), want, atol=2e-6, rtol=2e-6)


def test_padded_groups_bound_padding() -> None:
    """Similar lengths share a group (one SDPA call); a long chunk does not pad short prompts to its context."""
    import numpy as np

    assert len(plan_padded_groups(np.array([8, 8, 8]), np.array([8, 8, 8]), "cpu")) == 1
    assert len(plan_padded_groups(np.array([7, 5, 6]), np.array([8, 5, 6]), "cpu")) == 1
    groups = plan_padded_groups(np.array([2, 30, 4]), np.array([120, 30, 4]), "cpu")
    # the 120-key chunk alone; the two prompts padded to 2 * 30 * 30 <= 2 * (30 * 30 + 4 * 4)
    assert [(g.num_reqs, g.n_max, g.s_max) for g in groups] == [(1, 2, 120), (2, 30, 30)]


def test_twin_builds_its_own_groups() -> None:
    """``mla_prefill_attention_ref`` without a plan (reads the lengths on the host) gives the same rows."""
    b = make_step(CASES["spread"], 4, 4)
    (plan,) = plan_mla_step(b.block_table, b.seq_lens, b.seq_lens_cpu, b.query_start_loc_cpu, 4).prefills
    rows = b.kv_cache.view(-1, b.kv_cache.shape[-1]).index_select(0, plan.ctx_slots)  # [N, L + R]
    with torch.no_grad():
        kv = b.kv_b_proj(rows[:, :32]).view(rows.shape[0], 4, -1)  # [N, H, P + V]
    q_n, q_p = b.q_nope[plan.rows], b.q_pe[plan.rows]
    args = (q_n, q_p, kv[..., :16], rows[:, 32:], kv[..., 16:], plan.cu_seqlens_q, plan.cu_seqlens_k, b.scale)
    torch.testing.assert_close(
        mla_prefill_attention_ref(*args),
        mla_prefill_attention_ref(*args, groups=plan_padded_groups(plan.query_lens, plan.seq_lens, "cpu")),
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(mla_prefill_attention_ref(*args), oracle(b)[plan.rows], atol=2e-6, rtol=2e-6)


def test_layer_plans_once_per_step(monkeypatch) -> None:
    """``MLAAttention.forward`` on a mixed step: decode rows as the absorbed twin gives them, prefill rows as the
    oracle; the step's plan is built at the first layer and reused by the next (one per metadata object)."""
    from pagedllm.kernels.mla_decode import mla_decode_ref

    b = make_step(MIXED, 4, 4)
    calls = []
    monkeypatch.setattr(mla, "plan_mla_step", lambda *a: calls.append(1) or plan_mla_step(*a))
    meta = AttentionMetadata(
        num_reqs=len(MIXED),
        num_tokens=b.shape[0],
        max_query_len=max(n for n, _ in MIXED),
        max_seq_len=max(s for _, s in MIXED),
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        slot_mapping=torch.full((b.shape[0],), -1, dtype=torch.int64),  # the cache is already written
        query_start_loc_cpu=b.query_start_loc_cpu,
        seq_lens_cpu=b.seq_lens_cpu,
    )
    layer = MLAAttention(4, 16, 8, 24, 32, b.scale, SimpleNamespace(name="torch"), layer_idx=0)
    num_tokens = b.shape[0]
    latent, k_pe = torch.zeros(num_tokens, 32), torch.zeros(num_tokens, 8)
    with torch.no_grad():
        outs = [layer(b.q_nope, b.q_pe, latent, k_pe, b.kv_cache, meta, b.kv_b_proj) for _ in range(2)]
    assert len(calls) == 1
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    want = oracle(b)
    decodes = [r for r, (n, _) in enumerate(MIXED) if n == 1]
    rows = b.query_start_loc_cpu[decodes].long()
    with torch.no_grad():
        w_uk, w_uv = layer._absorbed_weights(b.kv_b_proj)
        q_latent = torch.einsum("bhp,hpl->bhl", b.q_nope[rows], w_uk)
        o = mla_decode_ref(q_latent, b.q_pe[rows], b.kv_cache, b.block_table[decodes], b.seq_lens[decodes], b.scale, 20)
        want[rows] = torch.einsum("bhl,hvl->bhv", o, w_uv)
    torch.testing.assert_close(outs[0], want, atol=2e-6, rtol=2e-6)


def test_query_longer_than_context_is_refused() -> None:
    b = make_step([(3, 3)], 1, 4)
    with pytest.raises(ValueError, match="query_len 3 > seq_len 2"):
        plan_mla_step(b.block_table, b.seq_lens, torch.tensor([2], dtype=torch.int32), b.query_start_loc_cpu, 4)


# ------------------------------------------------------------------------------------------------ Triton



def widened(b: SimpleNamespace) -> SimpleNamespace:
    """The same step (the same rounded values) in float64."""
    wide = SimpleNamespace(**vars(b))
    wide.q_nope, wide.q_pe, wide.kv_cache = b.q_nope.double(), b.q_pe.double(), b.kv_cache.double()
    weight = b.kv_b_proj.weight
    wide.kv_b_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.device, torch.float64)
    with torch.no_grad():
        wide.kv_b_proj.weight.copy_(weight.double())
    return wide


def check_kernel(
    case: list[tuple[int, int]],
    num_heads: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    dims: tuple[int, int, int, int] = (32, 8, 16, 24),
) -> None:
    """The Triton path against the PyTorch one on the same inputs in float64; decode rows stay unwritten."""
    b = make_step(case, num_heads, block_size, dtype, device, dims)
    got = batched(b, use_triton=True)
    want = batched(widened(b), use_triton=False)
    decodes = [int(b.query_start_loc_cpu[r]) for r, (n, _) in enumerate(case) if n == 1]
    assert torch.equal(got[decodes], torch.zeros_like(got[decodes])), "a decode row was written"
    err = rel_l2(got, want)
    assert err < TOL[dtype], f"rel L2 {err:.2e} >= {TOL[dtype]:.0e} for {case}"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "spread", "one-fresh", "tile-edges"])
def test_kernel_interpret(dtype, case: str, monkeypatch) -> None:
    import pagedllm.kernels.mla_prefill as kernels

    check_kernel(CASES[case], 2, 4, dtype, "cpu")  # widths padded to powers of two (R 8, V 24)
    # 16-row query and key tiles: mask-free key tiles, several query tiles per request, all widths exact
    monkeypatch.setattr(kernels, "tile_config", lambda *args: (16, 16, 4, 1))
    check_kernel(CASES[case], 3, 16, dtype, "cpu", dims=(32, 16, 32, 16))


@needs_interpreter
def test_model_prefills_through_kernel_interpret(tmp_path, monkeypatch) -> None:
    """The model's prefill chunks through the Triton kernel (as on CUDA with the Triton backend), here in the
    interpreter: transformers' logits at every position."""
    import pagedllm.kernels.mla_prefill as kernels
    from tests.models.test_deepseek import VARIANTS, make_tiny_deepseek, paged_logits
    from tests.models.test_models import hf_logits, load_ours

    cls_name, overrides = VARIANTS["v2-lite"]
    path = make_tiny_deepseek(cls_name, tmp_path / "v2-lite", seed=5, **overrides)
    model, _ = load_ours(path)
    monkeypatch.setattr(mla, "use_fused_kernels", lambda x: True)
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.attn_backend = SimpleNamespace(name="triton")
    calls = []
    kernel = kernels.mla_prefill_attention
    monkeypatch.setattr(kernels, "mla_prefill_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    prompt = list(range(10, 40))
    got = paged_logits(model, prompt, [13, 8, 1, 7, 1])
    torch.testing.assert_close(got, hf_logits(path, prompt), atol=1e-4, rtol=0)
    assert len(calls) == 3 * 3  # three prefill chunks, three layers


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads", [16, 1])
def test_kernel_gpu(dtype, num_heads: int) -> None:
    """DeepSeek's widths (latent 512, rope 64, nope 128, v 128): fresh prompts, chunks over long contexts and
    decodes in one step, against the PyTorch path in float64."""
    dims = (512, 64, 128, 128)
    case = [(300, 300), (1, 800), (64, 2000), (2, 1500), (513, 513), (1, 7), (128, 640), (17, 17)]
    check_kernel(case, num_heads, 16, dtype, "cuda", dims=dims)
    check_kernel(CASES["mixed"], num_heads, 4, dtype, "cuda", dims=dims)
