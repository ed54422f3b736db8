"""`pagedllm bench throughput`: offline throughput with vLLM's definitions.

All prompts are handed to the engine at once (random token ids, ``ignore_eos``), and the timer runs around
``generate`` only. requests/s = N / elapsed; total tokens/s = (prompt + output tokens) / elapsed;
output tokens/s = output tokens / elapsed. ``--backend hf`` runs the same prompts through transformers'
``generate`` in static batches of ``--hf-max-batch-size`` (left-padded), on the same device and dtype.

``--json-schema`` constrains every request to a JSON schema (structured outputs): the cost of constraining is
the difference to the same command without it. ``default`` is a list of at least 100,000 records, which no
benchmark output length completes, so every request still produces its full output length (a grammar that has
terminated no longer masks its row, which with ``ignore_eos`` would let the rest of the output run free). The
grammar compiles during the warm-up, outside the timer (one schema for all requests: compiled once, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest, random_token_prompts
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args, resolve_model_arg

# `--json-schema default`: records with a bounded integer, a string and an array of enum strings (per-token
# grammar work of a realistic schema), and so many of them that no output length completes the value. No
# maxLength: xgrammar 0.2.8 fills masks inside a length-limited string 25-170x slower on a 152k vocabulary
# (measured; docs/benchmarks.md), a cost of that keyword, not of constraining.
DEFAULT_JSON_SCHEMA: dict = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999999},
            "name": {"type": "string"},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "maxItems": 3,
            },
        },
        "required": ["id", "name", "tags"],
    },
    "minItems": 100000,
}


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
    structured_outputs: str | None = None  # "json schema NAME" when every request was constrained, else None
    spec_decode: str | None = None  # the speculative-decoding summary (mean acceptance length, ...), if any
    lora: str | None = None  # "N adapters over the requests" when --lora-path was given


def load_json_schema(value: str) -> tuple[str, dict]:
    """``--json-schema``'s value -> (name, schema): ``default`` (``DEFAULT_JSON_SCHEMA``), a path to a JSON file
    (named by its path) or the schema's JSON text ("custom"). ``ValueError`` naming the flag if it is none of
    these, or a schema xgrammar cannot compile."""
    if value == "default":
        name, schema = "default", DEFAULT_JSON_SCHEMA
    else:
        if value.lstrip().startswith("{"):
            name, text, what = "custom", value, "the value"
        elif os.path.isfile(value):
            try:
                with open(value) as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"--json-schema: cannot read {value}: {e.strerror or e}") from None
            name, what = value, f"the file {value}"
        else:
            raise ValueError(
                f"--json-schema: {value!r} is not 'default', an existing .json file or a JSON schema ({{...}})"
            )
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: {what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: a JSON schema is an object, got {type(schema).__name__}")
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(StructuredOutputsParams(json=schema))
    except ValueError as e:
        raise ValueError(f"--json-schema: {e}") from None
    return name, schema


def _json_schema_arg(value: str) -> str:
    """argparse type of ``--json-schema``: checks the value now (a clear usage error before the model loads)."""
    try:
        load_json_schema(value)
    except ValueError as e:
        # argparse puts "argument --json-schema:" in front itself.
        raise argparse.ArgumentTypeError(str(e).removeprefix("--json-schema: ")) from None
    return value


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
        "--json-schema",
        default=None,
        type=_json_schema_arg,
        metavar="SCHEMA",
        help="constrain every request to a JSON schema (structured outputs): 'default' (a list of records no "
        "output length completes), a path to a .json file, or the schema's JSON text",
    )
    parser.add_argument(
        "--lora-path",
        default=None,
        help="a LoRA adapter directory (needs --enable-lora); as in vLLM's benchmark, each request gets one of "
        "--num-loras adapter ids at random (seeded), all loaded from this path",
    )
    parser.add_argument(
        "--num-loras",
        type=int,
        default=None,
        help="distinct adapter ids spread over the requests with --lora-path (default: --max-loras)",
    )
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
    return run_pagedllm_outputs(args, temperature)[0]


def run_pagedllm_outputs(args: argparse.Namespace, temperature: float) -> tuple[ThroughputResult, list]:
    """The timed run, and its ``RequestOutput``s (token ids only: the benchmark does not detokenize)."""
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(resolve_model_arg(args), **engine_kwargs_from_args_for_llm(args))
    vocab = llm.llm_engine.engine_core.vocab_size
    reqs = make_requests(args, vocab)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    schema_name, structured = None, None
    if getattr(args, "json_schema", None) is not None:
        schema_name, schema = load_json_schema(args.json_schema)
        structured = StructuredOutputsParams(json=schema)
    loras = lora_requests(args, len(reqs))
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=r.expected_output_len,
            ignore_eos=True,
            detokenize=False,
            structured_outputs=structured,
        )
        for r in reqs
    ]
    # Warm-up (kernel compilation, allocator, the grammar's compilation) outside the timer.
    llm.generate(prompts[:2], params[:2], lora_request=None if loras is None else loras[:2], use_tqdm=False)
    stats_before = llm.llm_engine.get_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=True)
    elapsed = time.perf_counter() - start
    from pagedllm.metrics import spec_decode_summary

    stats_after = llm.llm_engine.get_stats()
    spec = spec_decode_summary(stats_after, stats_before)
    if spec is not None:
        print(spec)
    preempted = stats_after.num_preemptions - stats_before.num_preemptions
    config = getattr(llm.llm_engine.engine_core, "config", None)  # None under data parallelism
    if config is not None:
        sched = config.scheduler_config
        print(
            f"Batch limits: max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens "
            f"{sched.max_num_batched_tokens}; {preempted} preemptions in the timed run"
        )
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    _warn_short_outputs(reqs, outs)
    if getattr(args, "profile_steps", False):
        from pagedllm.benchmarks.step_profile import StepProfiler, format_report

        # A second, untimed pass over the same requests; without the first pass's prompts in the prefix cache,
        # so that it computes what the timed pass computed.
        llm.llm_engine.engine_core.reset_prefix_cache()
        profiler = StepProfiler(llm.llm_engine)
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        print(format_report(profiler.stop()))
    result = _result("pagedllm", len(reqs), elapsed, n_in, n_out)
    if schema_name is not None:
        result.structured_outputs = f"json schema {schema_name}"
    result.spec_decode = spec
    if loras is not None:
        result.lora = f"{len({r.lora_int_id for r in loras})} LoRA adapters over the requests"
    return result, outs


def lora_requests(args: argparse.Namespace, n: int) -> list | None:
    """One ``LoRARequest`` per request (ids 1..num_loras at random, seeded) with ``--lora-path``, else None."""
    path = getattr(args, "lora_path", None)
    if path is None:
        return None
    if not getattr(args, "enable_lora", False):
        raise ValueError("--lora-path needs --enable-lora")
    num = args.num_loras if args.num_loras is not None else args.max_loras
    if num < 1:
        raise ValueError(f"--num-loras must be >= 1, got {num}")
    from pagedllm.lora.request import LoRARequest

    rng = random.Random(args.seed)
    ids = [rng.randint(1, num) for _ in range(n)]
    return [LoRARequest(f"lora{i}", i, path) for i in ids]


def _warn_short_outputs(reqs: list[SampleRequest], outs: list) -> None:
    """Say so when requests produced fewer tokens than asked (``ignore_eos`` should prevent it; a grammar that
    rejected a token aborts its request)."""
    short: dict[str, int] = {}
    for r, o in zip(reqs, outs):
        for c in o.outputs:
            if len(c.token_ids) < r.expected_output_len:
                short[str(c.finish_reason)] = short.get(str(c.finish_reason), 0) + 1
    if short:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(short.items()))
        print(
            f"WARNING: {sum(short.values())} outputs are shorter than asked (finish reasons: {reasons})",
            file=sys.stderr,
        )


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
    if args.backend == "hf" and getattr(args, "json_schema", None) is not None:
        print("error: --json-schema needs --backend pagedllm", file=sys.stderr)
        return 2
    if getattr(args, "lora_path", None) is not None and (args.backend == "hf" or not args.enable_lora):
        print("error: --lora-path needs --backend pagedllm and --enable-lora", file=sys.stderr)
        return 2
    if getattr(args, "num_loras", None) is not None and args.num_loras < 1:
        print(f"error: --num-loras must be >= 1, got {args.num_loras}", file=sys.stderr)
        return 2
    result = run_hf(args, temperature) if args.backend == "hf" else run_pagedllm(args, temperature)
    what = result.backend + "".join(f", {x}" for x in (result.structured_outputs, result.lora) if x)
    print(
        f"Throughput ({what}): {result.requests_per_s:.2f} requests/s, "
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
