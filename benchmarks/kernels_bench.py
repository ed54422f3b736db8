"""Time the Triton kernels on a GPU against PyTorch baselines; prints compact tables.

    python benchmarks/kernels_bench.py            # ~1 minute on an H100
    python benchmarks/kernels_bench.py --sweep    # also try other tile configs and split counts
    python benchmarks/kernels_bench.py --no-flex  # skip flex attention (its compile takes ~20 s)

Decode: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16), each
request's blocks scattered at random over a cache much larger than L2, a fresh block table on each call
(rotated) so that repeated calls do not read from L2. "GB/s" counts the K/V bytes each call must read
once (plus q and out) over the median time; "%copy" relates it to a measured device-to-device copy.
Triton is timed inside a CUDA graph (as the engine's decode runs) and eagerly (``do_bench``, launch cost
included); baselines: ``torch_ref`` (the CPU-path reference, a Python loop) and dense SDPA on contiguous
K/V of the same lengths (no paging; flash backend, see dense_sdpa_fn).
Prefill: causal prompts of 1024 tokens, and a 512-token chunk over a 3584-token cached prefix; TFLOP/s
counts the causal half only, against a measured bf16 matmul.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedllm.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from pagedllm.kernels.paged_attention import _num_sms, num_kv_splits, paged_attention, tile_config  # noqa: E402
from pagedllm.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from pagedllm.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref  # noqa: E402
from pagedllm.kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
MIN_CACHE_BYTES = 1 << 30  # >> L2 (50 MB on H100)
NUM_ROTATIONS = 16


def median_ms(fn, graph: bool = False) -> float:
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


class PagedBatch:
    """A ragged batch over a large random-block cache, with NUM_ROTATIONS block tables to cycle through."""

    def __init__(self, lens: list[tuple[int, int]], rotations: int = NUM_ROTATIONS):
        self.lens = lens
        self.num_reqs = len(lens)
        q_lens = [q for q, _ in lens]
        seq_lens = [s for _, s in lens]
        self.num_tokens = sum(q_lens)
        self.max_query_len, self.max_seq_len = max(q_lens), max(seq_lens)
        blocks_per_req = [triton.cdiv(s, BLOCK_SIZE) for s in seq_lens]
        block_bytes = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
        num_blocks = max(sum(blocks_per_req), MIN_CACHE_BYTES // block_bytes)
        self.kv_cache = torch.randn(
            2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE
        )
        max_blocks = max(blocks_per_req)
        self.block_tables = []
        for _ in range(rotations):
            perm = torch.randperm(num_blocks, device="cuda")[: sum(blocks_per_req)].to(torch.int32)
            table = torch.zeros(self.num_reqs, max_blocks, dtype=torch.int32, device="cuda")
            used = 0
            for r, n in enumerate(blocks_per_req):
                table[r, :n] = perm[used : used + n]
                used += n
            self.block_tables.append(table)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.query_start_loc = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
        self.query = torch.randn(self.num_tokens, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.scale = HEAD_DIM**-0.5
        self._i = 0

    def kv_bytes(self) -> int:
        """Bytes one call must move: each context key and value read once, q read, out written."""
        kv = sum(s for _, s in self.lens) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
        return kv + 2 * self.query.numel() * 2

    def causal_flops(self) -> int:
        """QK^T and PV over the visible (causal) keys only."""
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in self.lens)
        return 4 * pairs * NUM_HEADS * HEAD_DIM

    def triton_fn(self, num_splits=None, config=None):
        def run():
            self._i = (self._i + 1) % len(self.block_tables)
            paged_attention(
                self.query, self.kv_cache, self.block_tables[self._i], self.seq_lens, self.query_start_loc,
                self.scale, self.num_reqs, self.max_query_len, self.max_seq_len, out=self.out,
                num_splits=num_splits, config=config,
            )  # fmt: skip

        return run

    def ref_fn(self):
        return lambda: paged_attention_ref(
            self.query, self.kv_cache[0], self.kv_cache[1], self.block_tables[0], self.seq_lens,
            self.query_start_loc, self.scale,
        )  # fmt: skip

    def check(self) -> float:
        """Relative L2 error of the Triton output against torch_ref (same inputs)."""
        self._i = -1
        self.triton_fn()()
        ref = self.ref_fn()().float()
        return ((self.out.float() - ref).norm() / ref.norm()).item()


def dense_sdpa_fn(lens: list[tuple[int, int]]):
    """Dense SDPA over contiguous K/V of the same lengths (equal lengths per batch only).

    Causal cases run on the flash backend, with GQA native where it is supported, otherwise with K/V expanded
    to all query heads beforehand. A chunk over a cached prefix needs an explicit (bottom-right) mask, so
    SDPA picks its backend.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q_len, seq_len = lens[0]
    assert all(x == lens[0] for x in lens)
    b = len(lens)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(b, NUM_HEADS, q_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(b, NUM_KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    if q_len != seq_len:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device="cuda").tril(seq_len - q_len)
        k, v = (x.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1) for x in (k, v))
        return lambda: sdpa(q, k, v, attn_mask=mask)

    def flash_gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=q_len > 1, enable_gqa=True)

    try:
        flash_gqa()
        return flash_gqa
    except RuntimeError:
        k, v = (x.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1) for x in (k, v))

        def flash_expanded():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, is_causal=q_len > 1)

        return flash_expanded


def flex_fn(lens: list[tuple[int, int]]):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_len, seq_len = lens[0]
    b = len(lens)
    q = torch.randn(b, NUM_HEADS, q_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(b, NUM_KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    offset = seq_len - q_len

    def causal(b_, h_, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    block_mask = create_block_mask(causal, None, None, q_len, seq_len, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def bench_decode(copy_gbs: float, sweep: bool) -> None:
    print("\n## decode (32/8 heads, D 128, bf16, block 16); times in us; GB/s of the graphed Triton kernel")
    print(
        f"{'batch':>5} {'ctx':>5} {'splits':>6} {'triton':>8} {'eager':>8} {'GB/s':>7} {'%copy':>6} "
        f"{'sdpa':>8} {'ref':>9} {'err':>8}"
    )
    for batch in (1, 32, 128):
        for ctx in (128, 512, 1024, 2048, 4096):
            pb = PagedBatch([(1, ctx)] * batch)
            err = pb.check()
            t_graph = median_ms(pb.triton_fn(), graph=True) * 1e3
            t_eager = median_ms(pb.triton_fn()) * 1e3
            gbs = pb.kv_bytes() / t_graph / 1e3
            t_sdpa = median_ms(dense_sdpa_fn(pb.lens)) * 1e3
            t_ref = median_ms(pb.ref_fn()) * 1e3 if ctx in (512, 4096) else None
            splits = num_kv_splits(batch, NUM_KV_HEADS, ctx, _num_sms(torch.device("cuda")))
            print(
                f"{batch:>5} {ctx:>5} {splits:>6} {t_graph:>8.1f} {t_eager:>8.1f} {gbs:>7.0f} "
                f"{100 * gbs / copy_gbs:>5.0f}% {t_sdpa:>8.1f} {fmt(t_ref, '9.0f'):>9} {err:>8.1e}"
            )
            if sweep and ctx in (1024, 4096):
                sweep_decode(pb, copy_gbs)
            del pb


def sweep_decode(pb: PagedBatch, copy_gbs: float) -> None:
    rule = num_kv_splits(pb.num_reqs, NUM_KV_HEADS, pb.max_seq_len, _num_sms(torch.device("cuda")))
    base = tile_config(1, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, DTYPE)
    for splits in sorted({1, max(1, rule // 2), rule, min(32, rule * 2), min(32, rule * 4)}):
        for config in (base, (16, 1, 32, 4, 2), (16, 1, 64, 4, 3), (16, 1, 128, 4, 2), (16, 1, 64, 8, 2)):
            try:
                ms = median_ms(pb.triton_fn(splits, config), graph=True)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                print(f"      sweep splits={splits} cfg={config}: {type(e).__name__}")
                continue
            gbs = pb.kv_bytes() / ms / 1e6
            mark = " <- default" if splits == rule and config == base else ""
            print(f"      sweep splits={splits:>2} cfg={config}: {ms * 1e3:7.1f} us {gbs:6.0f} GB/s{mark}")


def bench_prefill(mm_tflops: float, use_flex: bool, sweep: bool) -> None:
    print(
        f"\n## prefill (causal, 32/8 heads, D 128, bf16); times in us; TFLOP/s (bf16 matmul: {mm_tflops:.0f})"
    )
    print(f"{'case':>22} {'triton':>9} {'TFLOP/s':>8} {'sdpa':>9} {'flex':>9} {'ref':>9} {'err':>8}")
    cases = {
        "1 x 1024": [(1024, 1024)],
        "8 x 1024": [(1024, 1024)] * 8,
        "chunk 512 over 3584": [(512, 4096)],
    }
    for name, lens in cases.items():
        pb = PagedBatch(lens, rotations=2)
        err = pb.check()
        t = median_ms(pb.triton_fn()) * 1e3
        tflops = pb.causal_flops() / t / 1e6
        t_sdpa = median_ms(dense_sdpa_fn(lens)) * 1e3
        t_flex = None
        if use_flex:
            try:
                t_flex = median_ms(flex_fn(lens)) * 1e3
            except Exception as e:  # noqa: BLE001 - flex attention is optional
                print(f"  flex attention unavailable: {type(e).__name__}: {e}"[:200])
                use_flex = False
        t_ref = median_ms(pb.ref_fn()) * 1e3
        print(
            f"{name:>22} {t:>9.1f} {tflops:>8.0f} {t_sdpa:>9.1f} {fmt(t_flex, '9.1f'):>9} {t_ref:>9.0f} {err:>8.1e}"
        )
        if sweep:
            group = NUM_HEADS // NUM_KV_HEADS
            for config in (
                (64, 16, 64, 4, 2),
                (64, 16, 64, 4, 3),
                (128, 32, 64, 8, 2),
                (128, 32, 32, 8, 3),
                (64, 16, 32, 4, 3),
                (128, 32, 64, 8, 3),
                (128, 32, 128, 8, 2),
                (64, 16, 128, 4, 2),
                (128, 32, 64, 4, 2),
            ):
                try:
                    ms = median_ms(pb.triton_fn(config=config))
                except Exception as e:  # noqa: BLE001
                    print(f"      sweep cfg={config}: {type(e).__name__}")
                    continue
                mark = " <- default" if config == tile_config(lens[0][0], group, HEAD_DIM, DTYPE) else ""
                print(
                    f"      sweep cfg={config}: {ms * 1e3:9.1f} us {pb.causal_flops() / ms / 1e9:5.0f} TFLOP/s{mark}"
                )
        del pb


def bench_small(copy_gbs: float) -> None:
    print("\n## fused small kernels, 8192 tokens, bf16; times in us; GB/s = bytes read + written once")
    print(f"{'op':>26} {'triton':>8} {'GB/s':>7} {'%copy':>6} {'torch':>8}")
    t = 8192
    hidden, inter = 4096, 14336
    x = torch.randn(t, hidden, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    gu = torch.randn(t, 2 * inter, device="cuda", dtype=DTYPE)
    qkv = torch.randn(t, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(t, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(t, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(t, NUM_KV_HEADS, HEAD_DIM)
    cos = torch.randn(8192, HEAD_DIM // 2, device="cuda")
    sin = torch.randn_like(cos)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    num_blocks = t // BLOCK_SIZE * 4
    cache = torch.empty(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:t]
    qk_bytes = 2 * (q.numel() + k.numel()) * 2
    ops = {
        "fused_add_rms_norm 4096": (
            lambda: fused_add_rms_norm(x, res, w, 1e-6), lambda: fused_add_rms_norm_ref(x, res, w, 1e-6), 4 * x.numel() * 2
        ),
        "silu_and_mul 14336": (lambda: silu_and_mul(gu), lambda: silu_and_mul_ref(gu), gu.numel() * 3),
        "rotary 32/8 x 128": (
            lambda: rotary_embedding(pos, q, k, cos, sin), lambda: rotary_embedding_ref(pos, q, k, cos, sin), qk_bytes
        ),
        "reshape_and_cache 8 x 128": (
            lambda: reshape_and_cache(k, v, cache, slots), lambda: reshape_and_cache_ref(k, v, cache, slots), 4 * k.numel() * 2
        ),
    }  # fmt: skip
    for name, (fn, ref, nbytes) in ops.items():
        ms = median_ms(fn)
        gbs = nbytes / ms / 1e6
        print(
            f"{name:>26} {ms * 1e3:>8.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>5.0f}% {median_ms(ref) * 1e3:>8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs and split counts")
    parser.add_argument("--no-flex", action="store_true", help="skip flex attention")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    mm_tflops = matmul_tflops()
    print(
        f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}; "
        f"copy {copy_gbs:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s"
    )
    bench_decode(copy_gbs, args.sweep)
    bench_prefill(mm_tflops, not args.no_flex, args.sweep)
    bench_small(copy_gbs)
    print(f"\n# done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
