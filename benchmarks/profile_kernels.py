"""GPU kernel profile of an offline run: which kernels (and which host-side ops) take the time.

python benchmarks/profile_kernels.py MODEL_DIR [--num-prompts N] [--input-len I] [--output-len O] [--top K]
                                     [--workload nanovllm] [--kw key=value ...]   (LLM keyword arguments, e.g. --kw max_model_len=4096)

Builds ``LLM(MODEL_DIR, load_format="dummy")``, runs the workload once untimed (Triton JIT, CUDA graphs), then
again under ``torch.profiler`` and prints the ops with the most CUDA time, and the wall time of the profiled pass.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks import throughput


def _value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--workload",
        choices=["random", "nanovllm"],
        default="random",
        help="nanovllm: bench throughput's nano-vllm requests (lengths U[100,1024], temperature 0.6)",
    )
    parser.add_argument("--kw", action="append", default=[], help="an LLM keyword argument, key=value")
    args = parser.parse_args()
    kwargs = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.kw)}
    llm = LLM(args.model, load_format="dummy", **kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    if args.workload == "nanovllm":
        args.seed, args.num_loras = 0, None
        reqs = throughput.make_requests(args, vocab)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [
            SamplingParams(temperature=0.6, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs
        ]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [
            {"prompt_token_ids": torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm: JIT, graphs, allocator
    torch.cuda.synchronize()
    llm.llm_engine.engine_core.reset_prefix_cache()  # the profiled pass computes every prompt again
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"profiled pass: {args.num_prompts} x ({args.input_len}, {args.output_len}) in {wall:.2f} s")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
