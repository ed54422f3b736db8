"""`pagedllm bench throughput`: offline throughput with vLLM's definitions.

All prompts are handed to the engine at once (random token ids, ``ignore_eos``), and the timer runs around
``generate`` only. requests/s = N / elapsed; total tokens/s = (prompt + output tokens) / elapsed;
output tokens/s = output tokens / elapsed. ``--backend hf`` runs the same prompts through transformers'
``generate`` in static batches of ``--hf-max-batch-size`` (left-padded), on the same device and dtype.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest, random_token_prompts
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args, resolve_model_arg


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    requests_per_s: float
    total_tokens_per_s: float
    output_tokens_per_s: float
    num_prompt_tokens: int
    num_output_tokens: int


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--backend", default="pagedllm", choices=["pagedllm", "hf"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--workload",
        default="random",
        choices=["random", "nanovllm"],
        help="nanovllm: nano-vllm's bench.py (lengths uniform in 100..1024, ids < 10000, temperature 0.6)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hf-max-batch-size", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="after the timed run, a profiled pass: host ms per phase, GPU busy",
    )


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[SampleRequest]:
    if args.workload == "nanovllm":
        rng = np.random.default_rng(args.seed)
        reqs = []
        for _ in range(args.num_prompts):
            n_in = int(rng.integers(100, 1025))
            n_out = int(rng.integers(100, 1025))
            ids = rng.integers(0, min(10000, vocab_size), size=n_in).tolist()
            reqs.append(SampleRequest(prompt_token_ids=ids, prompt_len=n_in, expected_output_len=n_out))
        return reqs
    return random_token_prompts(
        vocab_size, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.seed
    )


def run_pagedllm(args: argparse.Namespace, temperature: float) -> ThroughputResult:
    from pagedllm import LLM, SamplingParams

    llm = LLM(resolve_model_arg(args), **engine_kwargs_from_args_for_llm(args))
    vocab = llm.llm_engine.engine_core.vocab_size
    reqs = make_requests(args, vocab)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=r.expected_output_len, ignore_eos=True, detokenize=False
        )
        for r in reqs
    ]
    # Warm-up (kernel compilation, allocator) outside the timer.
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    if getattr(args, "profile_steps", False):
        from pagedllm.benchmarks.step_profile import StepProfiler, format_report

        profiler = StepProfiler(llm.llm_engine)  # a second, untimed pass over the same requests
        llm.generate(prompts, params, use_tqdm=False)
        print(format_report(profiler.stop()))
    return _result("pagedllm", len(reqs), elapsed, n_in, n_out)


def engine_kwargs_from_args_for_llm(args: argparse.Namespace) -> dict:
    kw = engine_kwargs_from_args(args)
    kw.pop("served_model_name", None)
    return kw


def run_hf(args: argparse.Namespace, temperature: float) -> ThroughputResult:
    import torch

    from pagedllm.benchmarks.hf_backend import load_hf_model

    model, device = load_hf_model(args)
    reqs = make_requests(args, model.config.vocab_size)
    pad_id = 0
    n_in = sum(r.prompt_len for r in reqs)
    n_out = 0
    batches = [reqs[i : i + args.hf_max_batch_size] for i in range(0, len(reqs), args.hf_max_batch_size)]

    def run_batch(batch: list[SampleRequest]) -> int:
        max_len = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding
            ids[i, max_len - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[i, max_len - r.prompt_len :] = 1
        max_new = max(r.expected_output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=None,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        # A static batch runs to its longest request; count the tokens each request asked for (vLLM's rule).
        return sum(r.expected_output_len for r in batch) if out.shape[1] - max_len == max_new else 0

    run_batch(batches[0][:2])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        n_out += run_batch(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return _result("hf", len(reqs), elapsed, n_in, n_out)


def _result(backend: str, n: int, elapsed: float, n_in: int, n_out: int) -> ThroughputResult:
    return ThroughputResult(
        backend=backend,
        num_requests=n,
        elapsed_s=elapsed,
        requests_per_s=n / elapsed,
        total_tokens_per_s=(n_in + n_out) / elapsed,
        output_tokens_per_s=n_out / elapsed,
        num_prompt_tokens=n_in,
        num_output_tokens=n_out,
    )


def main(args: argparse.Namespace) -> int:
    temperature = 0.6 if args.workload == "nanovllm" else args.temperature
    result = run_hf(args, temperature) if args.backend == "hf" else run_pagedllm(args, temperature)
    print(
        f"Throughput ({result.backend}): {result.requests_per_s:.2f} requests/s, "
        f"{result.total_tokens_per_s:.2f} total tokens/s, {result.output_tokens_per_s:.2f} output tokens/s "
        f"({result.num_requests} requests, {result.num_prompt_tokens} prompt + {result.num_output_tokens} "
        f"output tokens in {result.elapsed_s:.2f} s)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result) | {"args": vars(args)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_cli_args(p)
    raise SystemExit(main(p.parse_args()))
