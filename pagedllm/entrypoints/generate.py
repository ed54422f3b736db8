"""`pagedllm generate PROMPT...`: complete prompts from the command line (the demo model by default)."""

from __future__ import annotations

import argparse
import time

from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args, resolve_model_arg


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=None)
    parser.add_argument("--sampling-seed", type=int, default=None)


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    kw = engine_kwargs_from_args(args)
    kw.pop("served_model_name", None)
    start = time.perf_counter()
    llm = LLM(resolve_model_arg(args), **kw)
    loaded = time.perf_counter() - start
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.sampling_seed,
    )
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_tokens = 0
    for out in outputs:
        for comp in out.outputs:
            n_tokens += len(comp.token_ids)
            print(f"{out.prompt}{comp.text}")
            print("-" * 60)
    print(
        f"[{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / max(elapsed, 1e-9):.1f} tok/s); model loaded in {loaded:.2f} s]"
    )
    return 0
