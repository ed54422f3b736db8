"""`pagedllm bench latency`: end-to-end latency of one batch, vLLM's definition.

One batch of ``--batch-size`` random-token prompts of ``--input-len`` tokens, each generating exactly
``--output-len`` tokens (ignore_eos); ``--num-iters-warmup`` untimed runs, then ``--num-iters`` timed runs of the
whole ``generate`` call. Reports the mean and percentiles of the latency and output tokens/s
(batch_size * output_len / mean latency). ``--backend hf`` times transformers' ``generate`` on the same batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.engine.arg_utils import add_engine_args, resolve_model_arg


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--backend", default="pagedllm", choices=["pagedllm", "hf"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--prompts-from",
        nargs="+",
        default=None,
        metavar="PATH",
        help="prompts from real text instead of random token ids: windows of --input-len tokens of these "
        "files joined (a directory: its *.py files, sorted), spread evenly over the text, so speculative "
        "decoding has something to predict",
    )
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="after the timed iterations, one profiled iteration: host ms per engine phase, GPU busy",
    )


def _prompts(batch_size: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 10000), size=(batch_size, input_len)).tolist()


def text_prompts(paths: list[str], tokenizer: Any, batch_size: int, input_len: int) -> list[list[int]]:
    """``batch_size`` windows of ``input_len`` tokens, evenly spaced over the files' joined tokens."""
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"--prompts-from: no such file or directory: {path}")
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    stream: list[int] = []
    for path in files:
        stream.extend(
            tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        )
    if len(stream) < input_len:
        raise ValueError(f"--prompts-from: {len(stream)} tokens of text, fewer than --input-len {input_len}")
    step = (len(stream) - input_len) // max(1, batch_size - 1) if batch_size > 1 else 0
    return [stream[i * step : i * step + input_len] for i in range(batch_size)]


def _pagedllm_runner(args: argparse.Namespace):
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.throughput import engine_kwargs_from_args_for_llm

    llm = LLM(resolve_model_arg(args), **engine_kwargs_from_args_for_llm(args))
    if args.prompts_from:
        token_ids = text_prompts(args.prompts_from, llm.get_tokenizer(), args.batch_size, args.input_len)
    else:
        token_ids = _prompts(
            args.batch_size, args.input_len, llm.llm_engine.engine_core.vocab_size, args.seed
        )
    prompts = [{"prompt_token_ids": p} for p in token_ids]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)

    def run() -> None:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)

    run.llm = llm  # the speculative-decoding summary reads its stats
    return run


def _hf_runner(args: argparse.Namespace):
    import torch

    from pagedllm.benchmarks.hf_backend import load_hf_model

    model, device = load_hf_model(args)
    if args.prompts_from:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_arg(args))
        token_ids = text_prompts(args.prompts_from, tokenizer, args.batch_size, args.input_len)
    else:
        token_ids = _prompts(args.batch_size, args.input_len, model.config.vocab_size, args.seed)
    ids = torch.tensor(token_ids, device=device)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == args.input_len + args.output_len

    return run


def main(args: argparse.Namespace) -> int:
    run = _hf_runner(args) if args.backend == "hf" else _pagedllm_runner(args)
    for _ in range(args.num_iters_warmup):
        run()
    llm = getattr(run, "llm", None)
    stats_before = llm.llm_engine.get_stats() if llm is not None else None
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - start)
    profile = None
    if args.profile_steps and llm is not None:
        from pagedllm.benchmarks.step_profile import StepProfiler, format_report

        profiler = StepProfiler(llm.llm_engine)
        run()
        profile = profiler.stop()
    lat = np.array(latencies)
    out_tok_s = args.batch_size * args.output_len / lat.mean()
    print(
        f"Latency ({args.backend}): avg {lat.mean():.4f} s, p50 {np.percentile(lat, 50):.4f} s, "
        f"p90 {np.percentile(lat, 90):.4f} s, p99 {np.percentile(lat, 99):.4f} s; "
        f"{out_tok_s:.1f} output tokens/s (batch {args.batch_size}, {args.input_len} in / {args.output_len} out)"
    )
    spec = None
    async_scheduling = None if llm is None else llm.llm_engine.engine_core.config.scheduler_config.async_scheduling
    if llm is not None:
        core = llm.llm_engine.engine_core
        ahead = ""
        if async_scheduling and getattr(core, "num_spec_launches", 0):
            ahead = f"; {core.num_spec_launches_ahead} of {core.num_spec_launches} verification launches ahead of the host"
        print(f"Scheduling: {'async' if async_scheduling else 'synchronous'}{ahead}")  # what the engine ran (A/B runs)
        from pagedllm.metrics import spec_decode_summary

        spec = spec_decode_summary(llm.llm_engine.get_stats(), stats_before)
        if spec is not None:
            print(spec)
        # Which CUDA graphs the target and the draft head replay (an EAGLE / MTP / Medusa proposer in this process)
        graphs = getattr(
            getattr(getattr(llm.llm_engine, "engine_core", None), "proposer", None), "graphs_summary", None
        )
        if graphs is not None:
            print(graphs)
        if profile is not None:
            print(format_report(profile))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "backend": args.backend,
                    "spec_decode": spec,
                    "async_scheduling": async_scheduling,
                    "avg_latency_s": float(lat.mean()),
                    "latencies_s": latencies,
                    "percentiles_s": {str(p): float(np.percentile(lat, p)) for p in (10, 25, 50, 75, 90, 99)},
                    "output_tokens_per_s": out_tok_s,
                    "step_profile": profile,
                    "args": vars(args),
                },
                f,
                indent=2,
                default=str,
            )
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_cli_args(p)
    raise SystemExit(main(p.parse_args()))
