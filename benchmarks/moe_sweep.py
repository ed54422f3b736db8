"""Tile sweep of the MoE grouped GEMM (pagedllm/kernels/fused_moe.py) on the GPU: for each model shape and token
count, the time of each GEMM (w13: gate|up, w2: down) under each tile configuration, and the best one.

python benchmarks/moe_sweep.py [--tokens 1,8,64,256,1024,4096,8192]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from pagedllm.kernels.fused_moe import _moe_gemm, moe_align

SHAPES = {  # name -> (experts, top_k, hidden, expert intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
BLOCK_MS = (16, 32, 64, 128)
TILES = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (n, k, w, s)
    for n, k, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))
    if not (n == 32 and w == 8)
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096,8192")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for name, (num_experts, top_k, hidden, inter) in SHAPES.items():
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
            g = torch.randn(t * top_k, inter, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(num_experts, device=dev)[:top_k] for _ in range(t)])
            scale = torch.rand(t * top_k, device=dev)
            results = {"w13": [], "w2": []}
            for block_m in BLOCK_MS if t * top_k >= 16 else (16,):
                layout = (*moe_align(ids, num_experts, block_m), t * top_k)
                for cfg in TILES:
                    for gemm, run in (
                        (
                            "w13",
                            functools.partial(_moe_gemm, x, w13, *layout, top_k, None, block_m, None, cfg),
                        ),
                        ("w2", functools.partial(_moe_gemm, g, w2, *layout, 1, scale, block_m, None, cfg)),
                    ):
                        try:
                            ms = triton.testing.do_bench(run, warmup=5, rep=20)
                        except Exception as e:  # noqa: BLE001 - a config the compiler rejects (shared memory)
                            print(f"  {name} T={t} {gemm} bm={block_m} {cfg}: {type(e).__name__}")
                            continue
                        results[gemm].append((ms, block_m, cfg))
            default = {}
            for gemm in ("w13", "w2"):
                default[gemm] = next(
                    ms for ms, bm, cfg in results[gemm] if bm == 16 and cfg == (64, 64, 4, 3)
                )
            for gemm in ("w13", "w2"):
                ranked = sorted(results[gemm])
                best = ", ".join(f"{ms * 1e3:.1f} us bm={bm} {cfg}" for ms, bm, cfg in ranked[:3])
                print(f"{name} T={t} {gemm}: default {default[gemm] * 1e3:.1f} us | best {best}")
            # the best single block_m for both GEMMs (they share the layout)
            per_bm = {}
            for bm in {bm for _, bm, _ in results["w13"]}:
                per_bm[bm] = sum(min(ms for ms, b, _ in results[gm] if b == bm) for gm in ("w13", "w2"))
            bm = min(per_bm, key=per_bm.get)
            print(
                f"{name} T={t} both: default {(default['w13'] + default['w2']) * 1e3:.1f} us, best bm={bm} "
                f"{per_bm[bm] * 1e3:.1f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
