"""Where does a decode step's time go? GPU graph replay alone vs the whole engine step, plus a CPU profile.

python benchmarks/profile_decode.py MODEL_DIR [--batch-size 1] [--load-format dummy]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=4096, enforce_eager=args.enforce_eager)
    runner = llm.llm_engine.engine_core.runner
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(args.batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / args.output_len * 1e3
    print(
        f"engine: {per_step:.3f} ms per step (batch {args.batch_size}) -> {args.batch_size * 1e3 / per_step:.0f} tok/s"
    )
    gr = runner.graph_runner
    if gr is not None:
        bs = gr.padded_size(args.batch_size)
        g = gr.graphs[bs]
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"graph replay alone: {start.elapsed_time(end) / 50:.3f} ms (padded batch {bs})")
        hidden = gr.outputs[bs][: args.batch_size]
        start.record()
        for _ in range(50):
            runner.model.compute_logits(hidden).argmax(-1)
        end.record()
        torch.cuda.synchronize()
        print(f"lm_head + argmax: {start.elapsed_time(end) / 50:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
