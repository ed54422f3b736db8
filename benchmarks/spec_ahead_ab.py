"""Async speculation on the bundled demo target, one engine alternating its two loops (GPU only): verification
launched ahead of the host against every launch waiting for the step in flight (``EngineCore.spec_ahead``), so
that both are timed on the same machine, warm, in turn.

python benchmarks/spec_ahead_ab.py {eagle,medusa} BATCH [--rounds 3] [--profile DIR]

Prompts: 128-token windows of the stdlib's zipapp.py, 128 greedy tokens each. Prints out tok/s per round and mode.
``--profile DIR``: one more run of each mode under torch.profiler, its op table (by self CPU time) written to DIR
and its first lines printed: where the host's time goes, and how much of the wall time the GPU computes.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.demo import DEMO_MODEL_DIR
from pagedllm.tokenizer import get_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=["eagle", "medusa"])
    ap.add_argument("batch", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    bs = args.batch
    spec = {"method": args.method, "model": str(DEMO_MODEL_DIR / args.method), "num_speculative_tokens": 3}
    llm = LLM(
        str(DEMO_MODEL_DIR), speculative_config=spec, async_scheduling=True, max_model_len=1024, max_num_seqs=bs
    )
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], "zipapp.py")).read()
    ids = get_tokenizer(str(DEMO_MODEL_DIR)).encode(text, add_special_tokens=False)
    prompts = [{"prompt_token_ids": ids[i * 50 : i * 50 + 128]} for i in range(bs)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    core = llm.llm_engine.engine_core

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return bs * 128 / (time.perf_counter() - start)

    for _ in range(2):
        run()  # warm-up
    for r in range(args.rounds):
        for ahead in (True, False):
            core.spec_ahead = ahead
            print(f"{args.method} batch {bs} round {r}: {'ahead' if ahead else 'wait'} {run():.1f} out tok/s")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(args.profile, exist_ok=True)
        for ahead in (True, False):
            core.spec_ahead = ahead
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            name = f"{args.method}_b{bs}_{'ahead' if ahead else 'wait'}.txt"
            with open(os.path.join(args.profile, name), "w") as f:
                f.write(table)
            print(f"--- {'ahead' if ahead else 'wait'}: top self-CPU ops")
            print("\n".join(line[:160] for line in table.splitlines()[:20]))
            print("\n".join(table.splitlines()[-2:]))


if __name__ == "__main__":
    main()
