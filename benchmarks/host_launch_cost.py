"""Host cost of one eager mixed step's forward, op by op (GPU only): where the launch time of a step goes.

python benchmarks/host_launch_cost.py MODEL_DIR [--decodes 500] [--chunks 15] [--chunk-len 1024] [--context 1100]

The GPU is first given a long sleep kernel, so every launch below is queued behind it and the host times are the
launch path's own (no back-pressure, no waiting). Reports: the whole forward's host time; then per function (the
Triton launchers of pagedllm.kernels, the linear layers' GEMMs) calls and µs per call; then one Triton kernel's
launch through ``JITFunction.run`` against torch's cheapest op, for scale.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import defaultdict

import torch

from pagedllm import LLM

_WRAP = [
    ("pagedllm.kernels.paged_attention", "paged_attention"),
    ("pagedllm.attention.triton_backend", "paged_attention"),
    ("pagedllm.attention.triton_backend", "reshape_and_cache"),
    ("pagedllm.attention.triton_backend", "split_leading_decodes"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decodes", type=int, default=500)
    ap.add_argument("--chunks", type=int, default=15)
    ap.add_argument("--chunk-len", type=int, default=1024)
    ap.add_argument("--context", type=int, default=1100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.9)
    runner = llm.llm_engine.engine_core.runner
    dev = runner.device
    q_lens = [1] * args.decodes + [args.chunk_len] * args.chunks
    seq_lens = [args.context] * args.decodes + [args.chunk_len] * args.chunks
    width = runner._table_width(max(seq_lens))
    table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=dev)
    num_tokens = sum(q_lens)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    positions = torch.arange(num_tokens, device=dev) % args.chunk_len

    def metadata():  # built outside the timed region: its host-to-device copies wait for the stream
        return runner._unwritten_metadata(q_lens, seq_lens, table, runner.kv_layout.num_groups)

    def forward(meta) -> None:
        runner._forward(ids, positions, runner.kv_caches, meta, communicate=False)

    forward(metadata())
    torch.cuda.synchronize()
    # Per-function host time: wrap the kernel launchers where the model and the backend call them.
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def wrap(mod, name: str, label: str) -> None:
        fn = getattr(mod, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            times[label] += time.perf_counter() - t0
            calls[label] += 1
            return out

        setattr(mod, name, timed)

    seen = set()
    for modname in list(importlib.sys.modules):
        if not modname.startswith("pagedllm.") or modname.startswith("pagedllm.benchmarks"):
            continue
        mod = importlib.sys.modules[modname]
        for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "qk_norm_rope", "rotary_embedding",
                     "reshape_and_cache", "paged_attention", "split_leading_decodes", "linear", "gumbel_sample"):
            if hasattr(mod, name) and callable(getattr(mod, name)) and (modname, name) not in seen:
                seen.add((modname, name))
                wrap(mod, name, name)
    totals = []
    for _ in range(args.repeats):
        meta = metadata()
        torch.cuda.synchronize()
        torch.cuda._sleep(3_000_000_000)  # ~1.5 s of GPU time: every launch below queues behind it
        t0 = time.perf_counter()
        forward(meta)
        totals.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    n = args.repeats
    print(f"forward of {args.decodes} decodes + {args.chunks} x {args.chunk_len}: host "
          f"{1e3 * min(totals):.2f} ms (min of {n}; all: {', '.join(f'{1e3 * t:.2f}' for t in totals)})")
    for label in sorted(times, key=times.get, reverse=True):
        print(f"  {label:24s} {calls[label] // n:4d} calls  {1e6 * times[label] / calls[label]:7.1f} µs/call  "
              f"{1e3 * times[label] / n:6.2f} ms/forward")
    # One Triton launch, for scale.
    from pagedllm.kernels.activation import silu_and_mul

    x = torch.zeros(4, 64, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(4, 64, device=dev, dtype=torch.bfloat16)
    for fn, label in ((lambda: silu_and_mul(x), "silu_and_mul (Triton)"), (lambda: y.add_(1), "tensor.add_ (torch)"),
                      (lambda: torch.mm(x, y.T), "torch.mm 4x64x4")):
        fn()
        torch.cuda._sleep(1_000_000_000)
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        print(f"  {label}: {2e3 * (time.perf_counter() - t0):.1f} µs per call (500 calls)")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
