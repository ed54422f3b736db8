"""GPU time of the RoPE kernels writing the KV cache themselves (``cache=KVCacheWrite(...)``) against the same
kernel followed by ``reshape_and_cache``, at one eager step's size (16,384 tokens, Qwen3-0.6B's heads: 16 query /
8 KV, head_dim 128, blocks of 16, bf16).

    python3 benchmarks/rope_cache_bench.py

Prints, per variant, the GPU time per call (CUDA events around 50 launches) and the host loop's time per call.
"""

from __future__ import annotations

import time

import torch

from pagedllm.kernels.qk_norm_rope import qk_norm_rope
from pagedllm.kernels.reshape_and_cache import KVCacheWrite, reshape_and_cache
from pagedllm.kernels.rotary import rotary_embedding


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 16384, 16, 8, 128, 16, 40000
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=dev, dtype=dt)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    cos = torch.rand(4096, head_dim // 2, device=dev)
    sin = torch.rand_like(cos)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=dev, dtype=dt)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens]
    w = torch.ones(head_dim, device=dev, dtype=dt)

    def gpu_us(f, n: int = 50) -> float:
        f()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            f()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n * 1e3

    def host_us(f, n: int = 50) -> float:
        f()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    variants = {
        "q/k norm + RoPE, writing the cache": lambda: qk_norm_rope(
            positions, q, k, w, w, 1e-6, cos, sin, cache=KVCacheWrite(v, cache, slots)
        ),
        "q/k norm + RoPE, then reshape_and_cache": lambda: (
            qk_norm_rope(positions, q, k, w, w, 1e-6, cos, sin),
            reshape_and_cache(k, v, cache, slots),
        ),
        "RoPE, writing the cache": lambda: rotary_embedding(
            positions, q, k, cos, sin, cache=KVCacheWrite(v, cache, slots)
        ),
        "RoPE, then reshape_and_cache": lambda: (
            rotary_embedding(positions, q, k, cos, sin),
            reshape_and_cache(k, v, cache, slots),
        ),
    }
    for name, f in variants.items():
        print(f"{name}: GPU {gpu_us(f):.1f} us, host loop {host_us(f):.1f} us")


if __name__ == "__main__":
    main()
