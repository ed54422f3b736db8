"""Triton paged attention (and the Triton backend) against the PyTorch reference in float64.

GPU tests are marked ``gpu``. With ``TRITON_INTERPRET=1`` (see test_triton_interpreter.py) the ``interpret``
tests run small shapes through Triton's CPU interpreter on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils import rel_l2

triton = pytest.importorskip("triton")

from pagedllm.attention.base import AttentionMetadata  # noqa: E402
from pagedllm.attention.torch_ref import TorchAttentionBackend, paged_attention_ref  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.paged_attention import num_kv_splits, paged_attention  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}



def make_batch(
    lens: list[tuple[int, int]],  # (query_len, seq_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    pad_tokens: int = 0,
) -> dict:
    """A random ragged batch whose context keys are already in a NaN-poisoned paged cache."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(lens)
    q_lens = [q for q, _ in lens]
    seq_lens = [s for _, s in lens]
    blocks_per_req = [triton.cdiv(s, block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 2
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(
        10**6, 10**7, (num_reqs, max_blocks), generator=g, dtype=torch.int32
    )  # poison
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    used = 0
    for r, (n_blocks, s) in enumerate(zip(blocks_per_req, seq_lens)):
        ids = perm[used : used + n_blocks]
        used += n_blocks
        block_table[r, :n_blocks] = ids.to(torch.int32)
        kv = torch.randn(2, n_blocks * block_size, num_kv_heads, head_dim, generator=g)[:, :s]
        flat = kv_cache[:, ids].flatten(1, 2)  # [2, n_blocks * block_size, num_kv_heads, head_dim]
        flat[:, :s] = kv.to(dtype)
        kv_cache[:, ids] = flat.view(2, n_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q_lens)
    # The query is a strided view into a wider buffer, as when split out of a fused qkv projection.
    qkv = torch.randn(num_tokens + pad_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
    query = qkv.to(dtype).to(device)[:, :num_heads]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        query=query,
        kv_cache=kv_cache.to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def poison_behind_window(b: dict, lens: list[tuple[int, int]], window: int) -> torch.Tensor:
    """Return a copy of ``b["kv_cache"]`` with NaN in every key/value of whole 64-key runs that lie behind the
    window of each request's first query (so behind every key tile of <= 64 keys the kernel may load): a kernel
    that reads a tile it should skip turns the output NaN."""
    block_size = b["kv_cache"].shape[2]
    cache = b["kv_cache"].clone()
    block_table = b["block_table"].cpu()
    for r, (q_len, seq_len) in enumerate(lens):
        cut = max(0, seq_len - q_len - window + 1) // 64 * 64  # positions [0, cut) are never visible
        for pos in range(cut):
            cache[:, int(block_table[r, pos // block_size]), pos % block_size] = float("nan")
    return cache


def with_gap(x: torch.Tensor, gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` copied into a buffer whose last dim is ``gap`` NaN lanes wider: (the view equal to ``x``, the buffer).
    A kernel that reads a lane past the head turns its output NaN; one that writes there leaves a number in the gap."""
    buf = torch.full((*x.shape[:-1], x.shape[-1] + gap), float("nan"), dtype=x.dtype, device=x.device)
    buf[..., : x.shape[-1]] = x
    return buf[..., : x.shape[-1]], buf


def make_sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Per-head sink logits from strongly negative (the sink hardly counts) to large (it takes most of the
    weight, even over 100+ keys): ``[num_heads]`` float32."""
    g = torch.Generator().manual_seed(100 + seed)
    sinks = 2.0 * torch.randn(num_heads, generator=g) + 1.0
    sinks[0] = 8.0
    sinks[-1] = -6.0
    return sinks


def check_attention(
    lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, num_splits=None, seed=0, pad_tokens=0,
    sliding_window=None, soft_cap=None, scale=None, sinks=None, head_gap=0,
) -> float:  # fmt: skip
    """Kernel vs the float64 reference. With a window, cache entries behind it are NaN for the kernel (the
    reference reads the clean cache): skipped tiles must really be skipped. ``sinks``: ``[num_heads]`` float32
    (the kernel reads them as given, in the query's dtype here; the reference in float64). ``head_gap``: the
    kernel's query, cache and output sit in buffers with that many NaN lanes after each head (see with_gap)."""
    b = make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed, pad_tokens)
    scale = scale or head_dim**-0.5
    cache = b["kv_cache"] if sliding_window is None else poison_behind_window(b, lens, sliding_window)
    out = torch.full_like(b["query"], float("nan"))
    query = b["query"]
    if head_gap:
        (query, _), (cache, _), (out, out_buf) = (with_gap(x, head_gap) for x in (query, cache, out))
    paged_attention(
        query,
        cache,
        b["block_table"],
        b["seq_lens"],
        b["query_start_loc"],
        scale,
        b["num_reqs"],
        b["max_query_len"],
        b["max_seq_len"],
        out=out,
        num_splits=num_splits,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.to(dtype).to(device),
    )
    cache64 = b["kv_cache"].double()
    ref = paged_attention_ref(
        b["query"].double(),
        cache64[0],
        cache64[1],
        b["block_table"],
        b["seq_lens"],
        b["query_start_loc"],
        scale,
        sliding_window,
        soft_cap,
        sinks=None if sinks is None else sinks.to(dtype).double().to(device),
    )
    n = b["num_tokens"]
    err = rel_l2(out[:n], ref[:n])
    assert err < TOL[dtype], f"rel L2 {err:.2e} >= {TOL[dtype]:.0e} for {lens}"
    if head_gap:
        assert out_buf[..., head_dim:].isnan().all(), "a store past the head"
    return err


# (query_len, seq_len) per request.
DECODE = [(1, 1), (1, 17), (1, 100), (1, 33), (1, 64)]
PREFILL = [(37, 37), (5, 5), (64, 64), (1, 1)]
CHUNKED = [(16, 80), (7, 7), (33, 129), (1, 200)]  # prefill chunks over cached context, mixed with a decode
MIXED = [(1, 50), (20, 20), (1, 3), (0, 9), (12, 45), (1, 129)]  # (0, 9): a request with no tokens this step


def check_padding_requests(device: str, num_splits: int | None) -> None:
    """Padding requests as a CUDA-graph batch has them: seq_len 0 gives a zero row, other rows unaffected."""
    lens = [(1, 40), (1, 1), (1, 600), (1, 1)]
    b = make_batch(lens, 8, 2, 32, 16, torch.bfloat16, device)
    cache64 = b["kv_cache"].double()
    ref = paged_attention_ref(
        b["query"].double(),
        cache64[0],
        cache64[1],
        b["block_table"],
        b["seq_lens"],
        b["query_start_loc"],
        0.2,
    )
    b["seq_lens"][1] = 0
    b["seq_lens"][3] = 0
    out = torch.full_like(b["query"], float("nan"))
    paged_attention(
        b["query"], b["kv_cache"], b["block_table"], b["seq_lens"], b["query_start_loc"], 0.2, 4, 1, 600,
        out=out, num_splits=num_splits,
    )  # fmt: skip
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    assert rel_l2(out[[0, 2]], ref[[0, 2]]) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------- GPU


# Each distinct (dtype, block size, group, head_dim, tile config, splits) is one Triton compile (~1-2 s), so
# the sweeps below vary one axis at a time around Llama-3-8B's shape (32/8 heads, head_dim 128, block 16).
ALL_LENS = pytest.mark.parametrize(
    "lens", [DECODE, PREFILL, CHUNKED, MIXED], ids=["decode", "prefill", "chunked", "mixed"]
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@ALL_LENS
def test_paged_attention_dtypes_gpu(dtype, lens):
    check_attention(lens, 32, 8, 128, 16, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [1, 2, 8, 32, 64, 128])
@ALL_LENS
def test_paged_attention_block_sizes_gpu(block_size, lens):
    check_attention(lens, 32, 8, 128, block_size, torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(8, 8), (28, 4), (16, 1), (64, 4)], ids=["mha", "g7", "mqa", "g16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@ALL_LENS
def test_paged_attention_gqa_gpu(heads, dtype, lens):
    check_attention(lens, heads[0], heads[1], 128, 16, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 256, 80, 96, 160, 192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_head_dims_gpu(head_dim, dtype):
    check_attention(MIXED, 16, 4, head_dim, 16, dtype, "cuda")
    check_attention(DECODE, 16, 4, head_dim, 16, dtype, "cuda", num_splits=4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [96, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@ALL_LENS
def test_paged_attention_padded_head_dim_gpu(head_dim, dtype, lens):
    """Phi-3's 96 (and 80): tiles padded to 128, lanes past the head masked, in buffers with NaN between heads."""
    check_attention(lens, 32, 32, head_dim, 16, dtype, "cuda", head_gap=32)
    check_attention(lens, 32, 8, head_dim, 16, dtype, "cuda", head_gap=16, sliding_window=64, soft_cap=30.0,
                    sinks=make_sinks(32))  # fmt: skip
    check_attention_fp8(lens, 32, 8, head_dim, 16, dtype, "cuda", 0.02, 3.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_paged_attention_padded_head_dim_split_k_gpu(num_splits):
    lens = [(1, 4096), (1, 1), (1, 3001), (1, 700), (1, 17)]
    check_attention(lens, 32, 32, 96, 16, torch.bfloat16, "cuda", num_splits, head_gap=32)
    check_attention([(40, 5000), (1, 900)], 32, 8, 96, 32, torch.bfloat16, "cuda", num_splits, head_gap=16,
                    sliding_window=700, soft_cap=50.0, sinks=make_sinks(32))  # fmt: skip
    check_attention_fp8(lens, 32, 8, 96, 16, torch.bfloat16, "cuda", 0.5, 2.0, num_splits)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_split_k_gpu(num_splits, dtype):
    lens = [(1, 4096), (1, 1), (1, 3001), (1, 700), (1, 17)]
    check_attention(lens, 32, 8, 128, 16, dtype, "cuda", num_splits=num_splits)
    check_attention([(1, 8191)], 32, 8, 128, 16, dtype, "cuda", num_splits=num_splits)
    # Split-K over a chunked prefill with a long cached prefix.
    check_attention([(40, 5000), (1, 900)], 32, 8, 128, 32, dtype, "cuda", num_splits=num_splits)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_random_gpu(seed):
    g = torch.Generator().manual_seed(seed)
    num_reqs = int(torch.randint(1, 40, (1,), generator=g))
    lens = []
    for _ in range(num_reqs):
        seq_len = int(torch.randint(1, 3000, (1,), generator=g))
        q_len = (
            1
            if torch.rand(1, generator=g) < 0.6
            else int(torch.randint(1, min(seq_len, 300) + 1, (1,), generator=g))
        )
        lens.append((q_len, seq_len))
    check_attention(lens, 32, 8, 128, [16, 32, 64][seed % 3], torch.bfloat16, "cuda", seed=seed, pad_tokens=5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window,soft_cap", [(64, None), (1000, None), (300, 50.0), (None, 30.0), (1, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@ALL_LENS
def test_paged_attention_window_soft_cap_gpu(window, soft_cap, dtype, lens):
    check_attention(lens, 32, 8, 128, 16, dtype, "cuda", sliding_window=window, soft_cap=soft_cap)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_paged_attention_window_split_k_gpu(num_splits):
    lens = [(1, 4096), (1, 1), (1, 3001), (1, 700), (1, 17)]
    check_attention(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", num_splits, sliding_window=1024)
    check_attention([(40, 5000), (1, 900)], 16, 8, 256, 32, torch.bfloat16, "cuda", num_splits,
                    sliding_window=700, soft_cap=50.0)  # fmt: skip


@pytest.mark.gpu
@needs_cuda
def test_paged_attention_window_long_prefill_gpu():
    check_attention([(2048, 6000), (700, 700)], 32, 8, 128, 16, torch.bfloat16, "cuda", sliding_window=512)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_requests_gpu(num_splits):
    check_padding_requests("cuda", num_splits)


@pytest.mark.gpu
@needs_cuda
def test_paged_attention_long_prefill_gpu():
    check_attention([(1024, 1024), (1024, 1024)], 32, 8, 128, 16, torch.bfloat16, "cuda")
    check_attention([(2048, 6000)], 32, 8, 128, 16, torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_paged_attention_large_cache_gpu():
    """A cache of more than 2**31 elements per half (8.6 GB): block and value offsets must be 64-bit."""
    block_size, num_kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 64
    try:
        kv_cache = torch.zeros(
            (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16, device="cuda"
        )
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    ids = torch.tensor([num_blocks - 1, 0, num_blocks - 7, num_blocks // 2, num_blocks - 2], device="cuda")
    kv_cache[:, ids] = torch.randn(2, 5, block_size, num_kv_heads, head_dim, device="cuda").to(torch.bfloat16)
    block_table = ids.to(torch.int32)[None, :]
    seq_lens = torch.tensor([70], dtype=torch.int32, device="cuda")
    for q_len in (1, 9):
        query = torch.randn(q_len, 32, head_dim, device="cuda").to(torch.bfloat16)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
        for splits in (1, 2):
            out = paged_attention(
                query, kv_cache, block_table, seq_lens, qsl, 0.1, 1, q_len, 70, num_splits=splits
            )
            ref = paged_attention_ref(
                query.double(), kv_cache[0, ids].double(), kv_cache[1, ids].double(),
                torch.arange(5, dtype=torch.int32, device="cuda")[None, :], seq_lens, qsl, 0.1,
            )  # fmt: skip
            assert rel_l2(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
def test_decode_cuda_graph_gpu():
    """Capture a pure-decode step once (split-K grid sized for max_seq_len 8192), then replay it with other
    lengths and queries: it must match the reference each time."""
    lens = [(1, 300), (1, 2000), (1, 5), (1, 1000)]
    b = make_batch(lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    query, kv_cache, block_table, seq_lens, qsl = (
        b[k] for k in ("query", "kv_cache", "block_table", "seq_lens", "query_start_loc")
    )
    out = torch.full_like(query, float("nan"))

    def step():
        paged_attention(query, kv_cache, block_table, seq_lens, qsl, 0.1, 4, 1, 8192, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    cache64 = kv_cache.double()
    for new_lens in ([250, 1999, 1, 17], [300, 2000, 5, 1000], [1, 1, 1, 1]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, device="cuda").to(query.dtype))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_ref(query.double(), cache64[0], cache64[1], block_table, seq_lens, qsl, 0.1)
        assert rel_l2(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_backend_matches_torch_gpu(dtype):
    check_backend(dtype, "cuda")
    check_backend(dtype, "cuda", sliding_window=12, logits_soft_cap=5.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, None), (300, 50.0), (1, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@ALL_LENS
def test_paged_attention_sinks_gpu(window, soft_cap, dtype, lens):
    check_attention(
        lens, 32, 8, 128, 16, dtype, "cuda", sliding_window=window, soft_cap=soft_cap, sinks=make_sinks(32)
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_paged_attention_sinks_split_k_gpu(num_splits):
    """Only split 0 starts from the sink: the merge must count it exactly once."""
    lens = [(1, 4096), (1, 1), (1, 3001), (1, 700), (1, 17)]
    check_attention(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", num_splits, sinks=make_sinks(32))
    check_attention([(40, 5000), (1, 900)], 64, 8, 64, 32, torch.bfloat16, "cuda", num_splits,
                    sliding_window=700, sinks=make_sinks(64, seed=1))  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_backend_sinks_matches_torch_gpu(dtype):
    check_backend(dtype, "cuda", sinks=make_sinks(8).cuda())
    check_backend(dtype, "cuda", sliding_window=12, sinks=make_sinks(8, seed=2).to(dtype).cuda())


# --------------------------------------------------------------------------------------- interpreter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@needs_interpreter
def test_paged_attention_interpret(dtype):
    check_attention(MIXED, 4, 2, 16, 16, dtype, "cpu")
    check_attention(CHUNKED, 8, 2, 32, 4, dtype, "cpu", pad_tokens=3)
    check_attention(DECODE, 4, 1, 16, 8, dtype, "cpu")


@needs_interpreter
@pytest.mark.parametrize("block_size", [1, 2, 32, 128])
def test_paged_attention_block_sizes_interpret(block_size):
    check_attention(CHUNKED, 6, 2, 16, block_size, torch.float32, "cpu")


@needs_interpreter
@pytest.mark.parametrize("heads", [(3, 1), (7, 7), (20, 1)])
def test_paged_attention_gqa_interpret(heads):
    check_attention(MIXED, heads[0], heads[1], 16, 16, torch.bfloat16, "cpu")


@needs_interpreter
@pytest.mark.parametrize("num_splits", [None, 2, 4, 16])
def test_paged_attention_split_k_interpret(num_splits):
    check_attention([(1, 600), (1, 1), (1, 75), (1, 1100)], 4, 2, 16, 16, torch.float32, "cpu", num_splits)
    check_attention([(9, 700), (1, 40), (3, 3)], 4, 2, 16, 16, torch.bfloat16, "cpu", num_splits)


def check_split_merge_repeats(device: str) -> None:
    """The last split of each q tile merges them all: repeated launches (decode and a chunk over a long prefix)
    give bit-identical outputs, and leave every ticket counter at 0 for the next launch."""
    from pagedllm.kernels import paged_attention as pa

    for lens in ([(1, 600), (1, 3), (1, 1100), (1, 0)], [(9, 700), (1, 40)]):
        b = make_batch(lens, 4, 2, 16, 16, torch.bfloat16, device, seed=3)
        outs = []
        for _ in range(3):
            out = torch.full_like(b["query"], float("nan"))
            paged_attention(
                b["query"], b["kv_cache"], b["block_table"], b["seq_lens"], b["query_start_loc"], 0.25,
                b["num_reqs"], b["max_query_len"], b["max_seq_len"], out=out, num_splits=8,
            )  # fmt: skip
            outs.append(out)
            assert int(pa._SPLIT_COUNTERS[out.device].abs().sum()) == 0
        assert not outs[0].isnan().any()
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.gpu  # (runs on CPU too, but CI has no Triton; the GPU suite runs it)
def test_split_counters_are_not_made_while_capturing(monkeypatch):
    """A counter buffer made inside a CUDA graph capture would stay unfilled until the first replay: refused."""
    from pagedllm.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_SPLIT_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
        pa.split_counters(torch.device("cuda", 0), 64)
    assert pa._SPLIT_COUNTERS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    got = pa.split_counters(torch.device("cpu"), 64)
    assert got.numel() >= 64 and not got.any() and pa.split_counters(torch.device("cpu"), 8) is got


@needs_interpreter
def test_split_merge_repeats_interpret():
    check_split_merge_repeats("cpu")


@pytest.mark.gpu
@needs_cuda
def test_split_merge_repeats_gpu():
    check_split_merge_repeats("cuda")


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_requests_interpret(num_splits):
    check_padding_requests("cpu", num_splits)


@needs_interpreter
def test_triton_backend_matches_torch_interpret():
    check_backend(torch.float32, "cpu")


# A mixed step that starts with decodes: they attend in a launch of their own (decode tiles), the rest (a decode
# among them) in a second one, with query offsets made relative to the first token after the leading decodes.
LEADING_DECODES = ((1, 40), (1, 9), (1, 70), (13, 30), (1, 5), (6, 6))


@needs_interpreter
def test_triton_backend_leading_decodes_interpret(monkeypatch):
    import pagedllm.attention.triton_backend as backend

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[6:9])  # num_reqs, max_query_len, max_seq_len
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(backend, "paged_attention", counting)
    check_backend(torch.float32, "cpu", LEADING_DECODES)
    assert calls == [(3, 1, 70), (3, 13, 30)]
    calls.clear()
    check_backend(torch.float32, "cpu", LEADING_DECODES, sliding_window=20, logits_soft_cap=2.0)
    assert len(calls) == 2


# Windows that start mid-tile, cover whole tiles, exceed the context, or hold only the query itself.
WINDOW_CASES = [(20, None), (7, None), (1, None), (500, None), (None, 2.0), (20, 2.0), (33, 0.5)]


@needs_interpreter
@pytest.mark.parametrize("window,soft_cap", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_window_soft_cap_interpret(window, soft_cap, dtype):
    # scale 0.5 on random unit q/k: scores of a few units, so a cap of 0.5..2 bends them
    kw = dict(sliding_window=window, soft_cap=soft_cap, scale=0.5)
    check_attention(MIXED, 4, 2, 16, 16, dtype, "cpu", **kw)
    check_attention(CHUNKED, 8, 2, 32, 4, dtype, "cpu", pad_tokens=3, **kw)
    check_attention(DECODE, 4, 1, 16, 8, dtype, "cpu", **kw)


@needs_interpreter
@pytest.mark.parametrize("block_size", [1, 2, 32])
def test_paged_attention_window_block_sizes_interpret(block_size):
    check_attention(CHUNKED, 6, 2, 16, block_size, torch.float32, "cpu", sliding_window=24, soft_cap=3.0)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [None, 2, 4, 16])
def test_paged_attention_window_split_k_interpret(num_splits):
    """Split-K divides only the tiles inside the window; with more splits than tiles, some splits are empty."""
    lens = [(1, 600), (1, 1), (1, 75), (1, 1100)]
    check_attention(lens, 4, 2, 16, 16, torch.float32, "cpu", num_splits, sliding_window=100)
    check_attention([(9, 700), (1, 40), (3, 3)], 4, 2, 16, 16, torch.bfloat16, "cpu", num_splits,
                    sliding_window=40, soft_cap=2.0, scale=0.5)  # fmt: skip


@needs_interpreter
def test_window_poisoning_is_meaningful_interpret():
    """Guards the NaN check in check_attention: the same poisoned cache without the window gives NaN."""
    lens = [(1, 300), (9, 200)]
    b = make_batch(lens, 4, 2, 16, 16, torch.float32, "cpu")
    cache = poison_behind_window(b, lens, 20)
    out = paged_attention(
        b["query"], cache, b["block_table"], b["seq_lens"], b["query_start_loc"], 0.25, 2, 9, 300
    )
    assert torch.isnan(out[: b["num_tokens"]]).all()


@needs_interpreter
def test_triton_backend_window_soft_cap_interpret():
    check_backend(torch.float32, "cpu", sliding_window=12, logits_soft_cap=5.0)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sinks_interpret(dtype):
    """Sinks through every path: whole prompts, prefill chunks over a cached prefix (mixed with a decode), pure
    decode, and a mixed batch with an empty request."""
    check_attention(PREFILL, 4, 2, 16, 16, dtype, "cpu", sinks=make_sinks(4))
    check_attention(CHUNKED, 8, 2, 32, 4, dtype, "cpu", pad_tokens=3, sinks=make_sinks(8, seed=1))
    check_attention(DECODE, 4, 1, 16, 8, dtype, "cpu", sinks=make_sinks(4, seed=2))
    check_attention(MIXED, 6, 2, 16, 16, dtype, "cpu", sinks=make_sinks(6, seed=3))


@needs_interpreter
@pytest.mark.parametrize("window,soft_cap", [(7, None), (None, 2.0), (20, 2.0)])
def test_paged_attention_sinks_window_soft_cap_interpret(window, soft_cap):
    """The sink is neither windowed nor capped: it counts for every row, whatever keys the row sees."""
    kw = dict(sliding_window=window, soft_cap=soft_cap, scale=0.5)
    check_attention(CHUNKED, 8, 2, 32, 4, torch.float32, "cpu", sinks=make_sinks(8, seed=4), **kw)
    check_attention(DECODE, 4, 2, 16, 8, torch.float32, "cpu", sinks=make_sinks(4, seed=5), **kw)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [2, 16])
def test_paged_attention_sinks_split_k_interpret(num_splits):
    """Split-K: only split 0 starts from the sink, so the merge counts it once (16 splits: some empty)."""
    lens = [(1, 600), (1, 1), (1, 75), (1, 1100)]
    check_attention(lens, 4, 2, 16, 16, torch.float32, "cpu", num_splits, sinks=make_sinks(4, seed=6))
    check_attention([(9, 700), (1, 40), (3, 3)], 4, 2, 16, 16, torch.bfloat16, "cpu", num_splits,
                    sliding_window=40, sinks=make_sinks(4, seed=7))  # fmt: skip


@needs_interpreter
def test_triton_backend_sinks_interpret():
    check_backend(torch.float32, "cpu", sinks=make_sinks(8))
    check_backend(torch.float32, "cpu", sliding_window=12, sinks=make_sinks(8, seed=2))


@needs_interpreter
@pytest.mark.parametrize("head_dim", [96, 80])
def test_paged_attention_padded_head_dim_interpret(head_dim):
    """A head_dim that is not a power of two (Phi-3's 96), padded to 128 in the kernel: prefill tiles (a mixed
    batch), pure decode, split-K decodes and a chunk with the merge, a window with soft-cap and sinks. The query,
    cache and output sit in buffers with NaN lanes after each head: no lane past the head is read or written."""
    check_attention(MIXED, 4, 2, head_dim, 16, torch.float32, "cpu", head_gap=16)
    check_attention(DECODE, 4, 1, head_dim, 8, torch.bfloat16, "cpu", head_gap=32)
    check_attention([(1, 600), (1, 1), (1, 75), (9, 700)], 4, 2, head_dim, 16, torch.float32, "cpu", 4, head_gap=16)
    check_attention(CHUNKED, 8, 2, head_dim, 4, torch.bfloat16, "cpu", pad_tokens=3, sliding_window=20,
                    soft_cap=2.0, scale=0.3, sinks=make_sinks(8), head_gap=16)  # fmt: skip


@needs_interpreter
def test_paged_attention_padded_head_dim_fp8_interpret():
    check_attention_fp8(MIXED, 4, 2, 96, 16, torch.bfloat16, "cpu", 0.3, 2.0)
    check_attention_fp8([(1, 600), (9, 700), (3, 3)], 4, 2, 96, 16, torch.float32, "cpu", 0.5, 2.0, 4, 40, 2.0)


@needs_interpreter
def test_triton_backend_padded_head_dim_interpret():
    """The backend step at head_dim 96: the cache write (padded too) and the two launches of a mixed step that
    starts with decodes."""
    check_backend(torch.float32, "cpu", head_dim=96)
    check_backend(torch.bfloat16, "cpu", LEADING_DECODES, head_dim=96, sliding_window=12, logits_soft_cap=5.0)


# ---------------------------------------------------------------------------------------------- CPU


def test_num_kv_splits_rule():
    assert num_kv_splits(1, 8, 4096, 132) == 16
    assert num_kv_splits(128, 8, 4096, 132) == 1  # grid already fills the GPU
    assert num_kv_splits(1, 8, 300, 132) == 1  # too short to split
    assert num_kv_splits(1, 1, 10**6, 132) == 32  # capped
    for reqs in (1, 3, 8, 32, 64):
        for seq in (1, 500, 513, 4096, 10**5):
            s = num_kv_splits(reqs, 8, seq, 132)
            assert s & (s - 1) == 0 and 1 <= s <= 32


def test_sinks_reference_matches_naive_softmax():
    """The reference's sinks against the formula written out: per row, softmax over [visible scores | sink],
    the sink's share dropped (float64; GQA, a window, prefill chunks over a prefix and decodes)."""
    lens = [(5, 21), (1, 9), (7, 7), (1, 30)]
    num_heads, num_kv_heads, head_dim, block_size, window, scale = 6, 2, 16, 4, 10, 0.4
    b = make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float64, "cpu", seed=5)
    sinks = make_sinks(num_heads).double()
    cache = b["kv_cache"]
    args = (b["query"], cache[0], cache[1], b["block_table"], b["seq_lens"], b["query_start_loc"])
    out = paged_attention_ref(*args, scale, window, sinks=sinks)
    group = num_heads // num_kv_heads
    row = 0
    for r, (q_len, seq_len) in enumerate(lens):
        blocks = b["block_table"][r, : triton.cdiv(seq_len, block_size)].long()
        k = b["kv_cache"][0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = b["kv_cache"][1, blocks].flatten(0, 1)[:seq_len]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = max(0, pos - window + 1)
            for h in range(num_heads):
                scores = k[lo : pos + 1, h // group] @ b["query"][row, h] * scale  # [visible]
                probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), dim=0)[:-1]
                torch.testing.assert_close(out[row, h], probs @ v[lo : pos + 1, h // group])
            row += 1
    plain = paged_attention_ref(*args, scale, window)
    assert (out - plain).abs().max() > 0.1  # the sinks matter in this batch


def check_backend(dtype, device, lens=((1, 40), (13, 30), (1, 9), (6, 6)), head_dim=32, **options):
    """The whole backend step (cache write, attention) against TorchAttentionBackend on one batch; ``options``
    (sliding_window, logits_soft_cap) go to both."""
    num_heads, num_kv_heads, block_size = 8, 2, 16
    b = make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=3, pad_tokens=2)
    num_tokens = b["num_tokens"]
    # Slots of this step's tokens: positions seq_len - q_len .. seq_len - 1 of each request.
    slots = []
    block_table = b["block_table"].cpu()
    for r, (q_len, seq_len) in enumerate(lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_table[r, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1, -1], dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(7)
    key = torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    value = torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    query = b["query"]
    metadata = AttentionMetadata(
        num_reqs=len(lens),
        num_tokens=num_tokens,
        max_query_len=b["max_query_len"],
        max_seq_len=b["max_seq_len"],
        query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"],
        block_table=b["block_table"],
        slot_mapping=slot_mapping,
        query_start_loc_cpu=b["query_start_loc"].cpu(),
        seq_lens_cpu=b["seq_lens"].cpu(),
    )
    cache_triton, cache_torch = b["kv_cache"].clone(), b["kv_cache"].clone()
    out = TritonAttentionBackend().forward(
        query, key, value, cache_triton, metadata, head_dim**-0.5, **options
    )
    ref = TorchAttentionBackend().forward(query, key, value, cache_torch, metadata, head_dim**-0.5, **options)
    assert torch.equal(cache_triton.isnan(), cache_torch.isnan())
    assert torch.equal(cache_triton.nan_to_num(), cache_torch.nan_to_num())
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()  # padding rows are zeroed, like the reference
    assert rel_l2(out, ref) < TOL[dtype] + (1e-2 if dtype == torch.bfloat16 else 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_backend_leading_decodes_gpu(dtype):
    check_backend(dtype, "cuda", LEADING_DECODES)
    check_backend(dtype, "cuda", LEADING_DECODES, sliding_window=20, logits_soft_cap=2.0)
    check_backend(dtype, "cuda", LEADING_DECODES, head_dim=96, sliding_window=20, sinks=make_sinks(8).cuda())


# ------------------------------------------------------------------------------------ FP8 KV cache
# The read path (fp8 loads, widening, scales folded into the score scale and the accumulator) runs right in the
# interpreter; the write path (fp32 -> e4m3 in reshape_and_cache) does not (Triton 3.9's interpreter converts
# fp32 to fp8 wrongly), so it is checked on the GPU only, against its twin, bit for bit.


def check_attention_fp8(
    lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, k_scale, v_scale, num_splits=None,
    sliding_window=None, soft_cap=None, seed=0,
) -> float:  # fmt: skip
    """Kernel over an FP8 cache (NaN-poisoned unused slots stay NaN in e4m3) vs the twin in float64, which reads
    ``fp8 * scale``. Keys/values are spread to about +-12 so a small k_scale clamps some of them."""
    from pagedllm.attention.torch_ref import quantize_kv_fp8

    b = make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed)
    c = b["kv_cache"] * 3
    cache = torch.stack([quantize_kv_fp8(c[0], k_scale), quantize_kv_fp8(c[1], v_scale)]).to(device)
    assert cache.dtype == torch.float8_e4m3fn
    query = b["query"].to(dtype).to(device)
    args = (b["block_table"].to(device), b["seq_lens"].to(device), b["query_start_loc"].to(device))
    out = torch.full_like(query, float("nan"))
    paged_attention(
        query, cache, *args, 0.25, b["num_reqs"], b["max_query_len"], b["max_seq_len"], out=out,
        num_splits=num_splits, sliding_window=sliding_window, logits_soft_cap=soft_cap, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    ref = paged_attention_ref(
        query.double(),
        cache[0],
        cache[1],
        *args,
        0.25,
        sliding_window,
        soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    n = b["num_tokens"]
    err = rel_l2(out[:n], ref[:n])
    assert err < TOL[dtype], f"rel L2 {err:.2e} >= {TOL[dtype]:.0e} for {lens}"
    return err


def check_backend_fp8(dtype, device, k_scale, v_scale, **options):
    """The Triton backend step on an FP8 cache (write + attention) vs TorchAttentionBackend: the caches equal
    byte for byte (same fp32 IEEE division, clamp and round-to-nearest-even), the outputs within TOL."""
    from pagedllm.attention.torch_ref import quantize_kv_fp8

    lens = [(1, 40), (13, 30), (1, 9), (6, 6)]
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    b = make_batch(
        lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed=3, pad_tokens=2
    )
    num_tokens = b["num_tokens"]
    slots = []
    for r, (q_len, seq_len) in enumerate(lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(b["block_table"][r, pos // block_size]) * block_size + pos % block_size)
    g = torch.Generator().manual_seed(7)
    key = (4 * torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g)).to(dtype).to(device)
    value = (4 * torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g)).to(dtype).to(device)
    cache = torch.stack(
        [quantize_kv_fp8(b["kv_cache"][0], k_scale), quantize_kv_fp8(b["kv_cache"][1], v_scale)]
    )
    metadata = AttentionMetadata(
        num_reqs=len(lens),
        num_tokens=num_tokens,
        max_query_len=b["max_query_len"],
        max_seq_len=b["max_seq_len"],
        query_start_loc=b["query_start_loc"].to(device),
        seq_lens=b["seq_lens"].to(device),
        block_table=b["block_table"].to(device),
        slot_mapping=torch.tensor(slots + [-1, -1], dtype=torch.int64, device=device),
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    query = b["query"].to(dtype).to(device)
    cache_triton, cache_torch = cache.to(device), cache.to(device)
    kw = dict(k_scale=k_scale, v_scale=v_scale, **options)
    out = TritonAttentionBackend().forward(query, key, value, cache_triton, metadata, head_dim**-0.5, **kw)
    ref = TorchAttentionBackend().forward(query, key, value, cache_torch, metadata, head_dim**-0.5, **kw)
    assert torch.equal(cache_triton.view(torch.uint8), cache_torch.view(torch.uint8))
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < TOL[dtype] + (1e-2 if dtype == torch.bfloat16 else 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@ALL_LENS
def test_paged_attention_fp8_cache_gpu(dtype, lens):
    check_attention_fp8(lens, 32, 8, 128, 16, dtype, "cuda", 1.0, 1.0)
    check_attention_fp8(lens, 32, 8, 128, 16, dtype, "cuda", 0.02, 3.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_paged_attention_fp8_split_k_window_gpu(num_splits):
    lens = [(1, 600), (1, 1), (1, 75), (1, 1100), (9, 700)]
    check_attention_fp8(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", 0.5, 2.0, num_splits)
    check_attention_fp8(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", 0.5, 2.0, num_splits, 100, 30.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.01, 4.0)])
@pytest.mark.parametrize("head_dim", [128, 96])
def test_reshape_and_cache_fp8_gpu(dtype, k_scale, v_scale, head_dim):
    """The FP8 cache write against its twin, byte for byte (values past 448 * scale clamp, padding skipped)."""
    from pagedllm.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    g = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, block_size, num_blocks = 300, 8, 16, 40
    key = (5 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)).to(dtype).cuda()
    value = (5 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)).to(dtype).cuda()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::7] = -1
    slot_mapping = slots.to(torch.int64).cuda()
    cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda"
    )
    cache_ref = cache.clone()
    reshape_and_cache(key, value, cache, slot_mapping, k_scale, v_scale)
    reshape_and_cache_ref(key, value, cache_ref, slot_mapping, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_backend_fp8_matches_torch_gpu(dtype):
    check_backend_fp8(dtype, "cuda", 1.0, 1.0)
    check_backend_fp8(dtype, "cuda", 0.05, 2.5, sliding_window=12, logits_soft_cap=5.0)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paged_attention_fp8_cache_interpret(dtype):
    check_attention_fp8(MIXED, 4, 2, 16, 16, dtype, "cpu", 0.3, 2.0)
    check_attention_fp8(CHUNKED, 8, 2, 32, 4, dtype, "cpu", 1.0, 1.0)
    check_attention_fp8(DECODE, 4, 1, 16, 8, dtype, "cpu", 0.02, 0.5)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_attention_fp8_split_k_window_interpret(num_splits):
    lens = [(1, 600), (1, 1), (9, 700), (3, 3)]
    check_attention_fp8(lens, 4, 2, 16, 16, torch.float32, "cpu", 0.5, 2.0, num_splits)
    check_attention_fp8(lens, 4, 2, 16, 16, torch.bfloat16, "cpu", 0.5, 2.0, num_splits, 40, 2.0)
