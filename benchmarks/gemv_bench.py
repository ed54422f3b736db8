"""Batch-1 GEMV on the GPU: cuBLAS (F.linear) against the Triton gemv (pagedllm/kernels/gemv.py) over a
sweep of tile configs, for the Llama-3.1-8B and Qwen3-0.6B decode shapes.

    python benchmarks/gemv_bench.py              # ~3-4 minutes on an H100
    python benchmarks/gemv_bench.py --quick      # a smaller sweep
    python benchmarks/gemv_bench.py --shapes 4096x4096,1024x3072

Timing: each measurement captures one CUDA graph of many back-to-back calls (as the engine's decode runs)
and times replays with CUDA events; µs is per call (inter-kernel gaps included). Every call reads a
different copy of the weight, cycling over at least MIN_ROTATION_BYTES of copies, so that L2 (50 MB)
does not serve weights. GB/s counts the bytes each call must move once (weight + x + out) over the median
time; the percentage relates it to a measured read-only stream (a 1 GiB sum). The down shapes' input comes from
silu_and_mul, so they time "F.linear after the separate silu_and_mul kernel" against the fused gemv
(act="silu_and_mul"), and also both without the activation.

Sweep (pruned): phase 1 tries BLOCK_N x BLOCK_K x num_warps (x SPLIT_K when N alone gives few programs) at
num_stages=3, keeping tiles of 4-32 KB per iteration and 8-128 fp32 accumulators per thread; phase 2 tries
num_stages 1..6 on the best few, and neighbours of the best. The last lines print a dict literal of the best
config per shape, to paste into gemv.py's ``_TUNED``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.kernels.activation import silu_and_mul  # noqa: E402
from pagedllm.kernels.gemv import GemvConfig, gemv, gemv_ref, pick_config  # noqa: E402

DTYPE = torch.bfloat16
SHAPES = [  # (N, K, name)
    (6144, 4096, "llama8b qkv"),
    (4096, 4096, "llama8b o_proj"),
    (28672, 4096, "llama8b gate_up"),
    (4096, 14336, "llama8b down"),
    (128256, 4096, "llama8b lm_head"),
    (4096, 1024, "qwen3-0.6b qkv"),
    (1024, 2048, "qwen3-0.6b o_proj"),
    (6144, 1024, "qwen3-0.6b gate_up"),
    (1024, 3072, "qwen3-0.6b down"),
    (151936, 1024, "qwen3-0.6b lm_head"),
]
DOWN_SHAPES = {(4096, 14336), (1024, 3072)}
MIN_ROTATION_BYTES = 256 << 20  # >> L2 (50 MB on H100)
MIN_CALLS = 20  # calls per captured graph
MAX_CALLS = 128
REPS = 10  # timed graph replays per measurement (median)


def copy_bandwidth() -> float:
    """Bytes read + written per second (GB/s) by a 1 GiB device-to-device copy, timed in a graph."""
    src = torch.empty(1 << 29, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    us = time_graph(lambda i: dst.copy_(src), 5)
    return 2 * src.numel() * src.element_size() / us / 1e3


def read_bandwidth() -> float:
    """Bytes read per second (GB/s) by a sum over 1 GiB, timed in a graph: the ceiling a GEMV can reach."""
    src = torch.empty(1 << 29, device="cuda", dtype=DTYPE).fill_(1.0)
    us = time_graph(lambda i: src.sum(dtype=torch.float32), 5)
    return src.numel() * src.element_size() / us / 1e3


def time_graph(call, num_calls: int) -> float:
    """Median µs per call of ``call(i)`` for i in 0..num_calls-1, captured in one CUDA graph."""
    call(0)  # compile / lazy init outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            call(i)
    graph.replay()  # warm-up
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    del graph
    return statistics.median(times)


class Problem:
    """Weight copies for one shape (enough to defeat L2) and its x."""

    def __init__(self, N: int, K: int, act: str | None):
        self.N, self.K, self.act = N, K, act
        w_bytes = N * K * 2
        self.num_copies = max(2, triton.cdiv(MIN_ROTATION_BYTES, w_bytes))
        self.num_calls = min(max(MIN_CALLS, self.num_copies), MAX_CALLS)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [
            (torch.randn(N, K, device="cuda", dtype=DTYPE, generator=g) * K**-0.5)
            for _ in range(self.num_copies)
        ]
        self.x = torch.randn(1, 2 * K if act else K, device="cuda", dtype=DTYPE, generator=g)
        self.bytes = w_bytes + self.x.numel() * 2 + N * 2

    def w(self, i: int) -> torch.Tensor:
        return self.weights[i % self.num_copies]

    def time_cublas(self) -> float:
        if self.act:
            return time_graph(lambda i: F.linear(silu_and_mul(self.x), self.w(i)), self.num_calls)
        return time_graph(lambda i: F.linear(self.x, self.w(i)), self.num_calls)

    def time_gemv(self, cfg: GemvConfig, pdl: bool = False) -> float:
        return time_graph(
            lambda i: gemv(self.x, self.w(i), config=cfg, act=self.act, pdl=pdl), self.num_calls
        )

    def gbps(self, us: float) -> float:
        return self.bytes / us / 1e3

    def check(self, cfg: GemvConfig) -> float:
        out = gemv(self.x, self.weights[0], config=cfg, act=self.act)
        ref = gemv_ref(self.x, self.weights[0], act=self.act)
        return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

    def free(self) -> None:
        self.weights.clear()
        torch.cuda.empty_cache()


def phase1_configs(N: int, K: int, num_sms: int, quick: bool) -> list[GemvConfig]:
    block_ns = (1, 2, 4, 8, 16, 32) if quick else (1, 2, 4, 8, 16, 32, 64)
    block_ks = (256, 512, 1024, 2048) if quick else (128, 256, 512, 1024, 2048)
    warps = (4, 8) if quick else (2, 4, 8)
    configs = []
    for bn, bk, w in itertools.product(block_ns, block_ks, warps):
        tile = bn * bk
        per_thread = tile // (32 * w)
        if not (2048 <= tile <= 16384 and 8 <= per_thread <= 128) or bk > max(triton.next_power_of_2(K), 128):
            continue
        n_blocks = triton.cdiv(N, bn)
        splits = [1]
        if n_blocks < 4 * num_sms:  # few programs from N alone: try splitting K
            splits += [s for s in (2, 4, 8) if s * bk <= K]
        for s in splits:
            if n_blocks * s < num_sms // 2:  # most SMs idle
                continue
            configs.append(GemvConfig(bn, bk, s, w, 3))
    return configs


def sweep(p: Problem, num_sms: int, quick: bool) -> list[tuple[float, GemvConfig]]:
    results: dict[GemvConfig, float] = {}

    def run(cfg: GemvConfig) -> None:
        if cfg in results:
            return
        tile_bytes = cfg.BLOCK_N * cfg.BLOCK_K * 2
        if cfg.num_stages * tile_bytes > 200 << 10:  # shared memory of the pipeline
            return
        try:
            results[cfg] = p.time_gemv(cfg)
        except Exception as exc:  # out of resources etc.: skip the config
            print(f"    skip {cfg}: {type(exc).__name__}: {str(exc)[:100]}")

    for cfg in phase1_configs(p.N, p.K, num_sms, quick):
        run(cfg)
    top = sorted(results, key=results.get)[: 2 if quick else 4]
    for cfg in top:
        for stages in (1, 2, 4, 6) if quick else (1, 2, 4, 5, 6):
            run(GemvConfig(cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, stages))
    best = min(results, key=results.get)
    for bn in (best.BLOCK_N // 2, best.BLOCK_N * 2):  # neighbours of the best
        for w in (best.num_warps // 2, best.num_warps, best.num_warps * 2):
            if bn >= 1 and w >= 1 and bn <= 64:
                run(GemvConfig(bn, best.BLOCK_K, best.SPLIT_K, w, best.num_stages))
    return sorted(((us, cfg) for cfg, us in results.items()), key=lambda r: r[0])


def fmt(cfg: GemvConfig) -> str:
    return f"BN={cfg.BLOCK_N} BK={cfg.BLOCK_K} SK={cfg.SPLIT_K} w={cfg.num_warps} s={cfg.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--shapes", default="", help="comma-separated NxK (default: all)")
    parser.add_argument("--top", type=int, default=3, help="runner-up configs to print per shape")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        names = {(n, k): name for n, k, name in SHAPES}
        wanted = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        shapes = [(n, k, names.get((n, k), f"{n}x{k}")) for n, k in wanted]
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps, read_gbps = copy_bandwidth(), read_bandwidth()
    use_pdl = torch.cuda.get_device_capability()[0] >= 9
    tiny = Problem(64, 256, None)  # ~32 KB: launch + latency, no bandwidth
    floor_us = tiny.time_gemv(GemvConfig(1, 256, 1, 2, 1))
    floor_pdl_us = tiny.time_gemv(GemvConfig(1, 256, 1, 2, 1), pdl=True) if use_pdl else float("nan")
    tiny.free()
    print(
        f"{torch.cuda.get_device_name()}  SMs={num_sms}  triton {triton.__version__}  torch {torch.__version__}"
    )
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write); read-only sum: {read_gbps:.0f} GB/s")
    print(
        f"floor: a 64x256 gemv in a graph takes {floor_us:.2f} µs per call ({floor_pdl_us:.2f} µs with pdl)\n"
    )
    t_start = time.perf_counter()
    best_per_shape: dict[tuple[int, int], GemvConfig] = {}
    summary = []
    for N, K, name in shapes:
        t0 = time.perf_counter()
        act = "silu_and_mul" if (N, K) in DOWN_SHAPES else None
        p = Problem(N, K, act)
        cublas_us = p.time_cublas()
        results = sweep(p, num_sms, args.quick)
        best_us, best = results[0]
        picked = pick_config(N, K)
        picked_us = p.time_gemv(picked)
        pdl_us = [(p.time_gemv(cfg, pdl=True), cfg) for _, cfg in results[:3]] if use_pdl else [(0.0, best)]
        pdl_best_us, pdl_best = min(pdl_us, key=lambda r: r[0])
        err = p.check(best)
        label = "F.linear + silu_and_mul" if act else "F.linear (cuBLAS)"
        print(f"== {name} [N={N}, K={K}] {p.bytes / 1e6:.1f} MB/call, {p.num_copies} weight copies, "
              f"{p.num_calls} calls/graph, act={act}")  # fmt: skip
        print(
            f"   {label:28s} {cublas_us:8.2f} µs {p.gbps(cublas_us):6.0f} GB/s {p.gbps(cublas_us) / read_gbps:5.1%}"
        )
        print(f"   triton best {fmt(best):33s} {best_us:8.2f} µs {p.gbps(best_us):6.0f} GB/s "
              f"{p.gbps(best_us) / read_gbps:5.1%}  rel_l2 {err:.1e}")  # fmt: skip
        for us, cfg in results[1 : 1 + args.top]:
            print(f"        next {fmt(cfg):33s} {us:8.2f} µs {p.gbps(us):6.0f} GB/s")
        print(f"   pick_config {fmt(picked):33s} {picked_us:8.2f} µs {p.gbps(picked_us):6.0f} GB/s")
        if use_pdl:
            print(
                f"   pdl=True    {fmt(pdl_best):33s} {pdl_best_us:8.2f} µs {p.gbps(pdl_best_us):6.0f} GB/s "
                "(back-to-back PDL gemv calls overlap; best of the top 3)"
            )
        if act:  # the same weight stream without the fused activation
            plain = Problem.__new__(Problem)
            plain.__dict__.update(p.__dict__, act=None, x=p.x[:, :K].contiguous())
            plain.bytes = p.bytes - K * 2
            cb, tb = plain.time_cublas(), plain.time_gemv(best)
            print(f"   (no act) F.linear {cb:8.2f} µs {plain.gbps(cb):6.0f} GB/s | triton best {tb:8.2f} µs "
                  f"{plain.gbps(tb):6.0f} GB/s")  # fmt: skip
        print(f"   ({len(results)} configs, {time.perf_counter() - t0:.1f} s)\n")
        assert err < 1e-2, f"best config {best} is wrong for {N}x{K}: rel_l2 {err}"
        best_per_shape[(N, K)] = best
        summary.append((name, cublas_us, best_us, picked_us, pdl_best_us, p.gbps(cublas_us), p.gbps(best_us)))
        p.free()

    print(f"{'shape':22s} {'cuBLAS µs':>10s} {'triton µs':>10s} {'pick µs':>9s} {'pdl µs':>9s} {'cuBLAS GB/s':>12s} "
          f"{'triton GB/s':>12s} {'speedup':>8s}")  # fmt: skip
    for name, cu, tr, pk, pd, cg, tg in summary:
        print(f"{name:22s} {cu:10.2f} {tr:10.2f} {pk:9.2f} {pd:9.2f} {cg:12.0f} {tg:12.0f} {cu / tr:7.2f}x")
    print(
        f"\ntotal {time.perf_counter() - t_start:.0f} s\n\n# best config per shape (paste into gemv.py's _TUNED)"
    )
    print("{")
    for (N, K), c in best_per_shape.items():
        print(f"    ({N}, {K}): GemvConfig(BLOCK_N={c.BLOCK_N}, BLOCK_K={c.BLOCK_K}, SPLIT_K={c.SPLIT_K}, "
              f"num_warps={c.num_warps}, num_stages={c.num_stages}),")  # fmt: skip
    print("}")


if __name__ == "__main__":
    main()
