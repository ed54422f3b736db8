"""The cost side of EAGLE speculative decoding: one plain decode step, one verification step and one proposal,
measured on a target with random (dummy) weights, and the speedup those costs imply at given mean acceptance
lengths.

python benchmarks/spec_cost.py --model /tmp/models/llama-3.1-8b --load-format dummy [--batch-sizes 1 8]
    [--num-speculative-tokens 3] [--mal 3.0 3.6] [--eagle-dir DIR] [--work-dir DIR] [--enforce-eager]

(``python -m pagedllm.benchmarks.shapes /tmp/models`` writes the Llama-3.1-8B shape directory.)

Two engines run one after the other in this process, each as ``pagedllm.LLM`` builds it by default (CUDA graphs
on; asynchronous scheduling where the engine picks it): a plain one, then one with ``speculative_config={"method":
"eagle", "model": HEAD_DIR, "num_speculative_tokens": k}``. For each batch size B each engine generates B random
prompts of ``--input-len`` tokens, ``--output-len`` tokens each (greedy, ignore_eos). With random weights the
drafts are (nearly) never accepted, so every decode step of the speculative engine is one verification of k + 1
tokens a request plus one proposal. Only *full* steps count: B requests, each scheduled 1 token (plain) or k + 1
tokens (k drafts: verification); the prefill and the last steps, where drafts are cut short, do not. The first
``--warmup-steps`` full steps of each run are dropped; the numbers are medians over the rest.

- ``t_plain_ms``: one plain decode step at batch B, from ``ModelRunner.launch`` to the end of ``ModelRunner.sample``
  (input preparation, the forward, the logits, sampling).
- ``t_verify_ms``: the same interval of a verification step of the speculative engine (the forward over k + 1
  tokens a request, the logits of each, rejection sampling), up to the proposal queued behind it.
- ``t_propose_ms``: one EAGLE proposal after a verification step: the head's catch-up pass (draft 1), then drafts
  2..k, copied to the host. After a step through the target's multi-token graph the proposal is queued on the
  device right after the sampling (``EagleProposer.draft_on_device``): the interval runs from there to the end of
  the drafts' copy. Otherwise it is one call of the proposer's ``propose`` (on the host; it ends in a device sync).
- ``verify_over_plain`` = t_verify / t_plain, ``propose_over_plain`` = t_propose / t_plain.
- ``implied_speedup`` at mean acceptance length MAL (tokens a verification step emits):
  ``MAL * t_plain / (t_verify + t_propose)``: plain decoding emits one token per t_plain; speculation emits MAL
  tokens per verification and proposal.

On CUDA the intervals are GPU time, from CUDA events recorded on the engine's stream at the start of the interval
and at its end: the start event completes when the device reaches it (after the previous step's work, with
asynchronous scheduling), so an interval is the device's time for that work plus any wait, inside it, for the host
to launch more (with synchronous scheduling, as speculative decoding runs by default, the host's input preparation
of a verification step is such a wait; the proposal ends in a sync, so its interval is its wall time). The events
are read after each run (one ``torch.cuda.synchronize``). On the CPU the intervals are ``time.perf_counter`` times
(the work runs in the calls).

Also reported, as a cross-check of what the engine does between these intervals (scheduling, bookkeeping, output
processing): ``t_plain_step_wall_ms`` and ``t_spec_step_wall_ms``, the host wall time of one ``LLMEngine.step``
that launched a full step, and ``implied_speedup_wall`` = ``MAL * t_plain_step_wall / t_spec_step_wall``;
``measured_mal``, the mean acceptance length of the speculative run (about 1 with random weights); the steps
counted; each engine's scheduling mode; and which CUDA graphs ran (``graphs``: the plain engine's decode graphs at
batch B; the speculative engine's verification graphs and the head's catch-up and draft-step graphs at batch B,
from their captured sizes; ``speculation_graphs``: the proposer's start-up summary,
``pagedllm/spec_decode/head_graphs.py``).

``--max-num-seqs`` (default: the engine's) bounds the batch sizes whose CUDA graphs the engines capture (the
captured sizes are 1, 2, 4, 8, then multiples of 16 up to it): a smaller one shortens start-up and leaves the
steps of a batch size it still holds as they are.

``--enforce-eager`` runs both engines without CUDA graphs (the target's steps and the head's).

The head: ``--eagle-dir``, or one this script writes under ``--work-dir`` (a temporary directory by default): the
target's config.json with one layer (an EAGLE-1 head of the target's shape: fc 2H -> H and one decoder layer; the
embedding and LM head are the target's, ``pagedllm/spec_decode/eagle.py``). Under ``--load-format dummy`` the head
is dummy-initialized like the target and needs no weights file; otherwise the script also writes random weights in
the EAGLE-1 checkpoint layout (about 0.9 GB in bfloat16 for the 8B shape).

Output: per batch size, one JSON line (``{"spec_cost": ...}``) and one ``Spec cost`` line for people. The step
timing wraps the engine's methods as ``pagedllm/benchmarks/step_profile.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


class FullStepTimer:
    """Times the full steps of one run of ``llm_engine``: those scheduling ``batch_size`` requests ``query_len``
    tokens each. Wraps (instance attributes over the methods, removed by ``stop``) ``runner.launch`` and
    ``runner.sample`` (one interval per step), the proposer's ``propose`` after such a step, and
    ``LLMEngine.step`` (the host wall time of a call that launched one)."""

    def __init__(self, llm_engine: Any, batch_size: int, query_len: int) -> None:
        core = llm_engine.engine_core
        self.batch_size = batch_size
        self.query_len = query_len
        self.cuda = core.runner.device.type == "cuda"
        self.marks: dict[str, list[tuple[Any, Any]]] = {"step": [], "propose": []}  # (start, end) per call
        self.wall: list[float] = []  # host seconds per LLMEngine.step that launched a full step
        self._open: Any = None  # the start mark of a full step launched and not yet sampled
        self._launched_full = False
        self._originals: list[tuple[Any, str]] = []
        self._wrap(core.runner, "launch", self._on_launch)
        self._wrap(core.runner, "sample", self._on_sample)
        if core.proposer is not None:
            self._wrap(core.proposer, "propose", self._on_propose)
        # An EAGLE proposal queued on the device right after a verification's sampling (the runner's hook): its
        # interval runs from the end of the sampling to the end of the drafts' copy to the host.
        self._hook = getattr(core.runner, "after_spec_sample", None)
        self._runner = core.runner
        if self._hook is not None:
            core.runner.after_spec_sample = self._on_device_proposal
        self._wrap(llm_engine, "step", self._on_engine_step)

    def is_full(self, sched: Any) -> bool:
        counts = sched.num_scheduled_tokens
        return len(counts) == self.batch_size and all(n == self.query_len for n in counts.values())

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wrap(self, obj: Any, name: str, around: Any) -> None:
        fn = getattr(obj, name)
        setattr(obj, name, lambda *args, **kwargs: around(fn, *args, **kwargs))
        self._originals.append((obj, name))

    def _on_launch(self, fn: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
        full = self.is_full(sched)
        self._launched_full |= full
        if full:
            self._open = self._mark()
        return fn(sched, *args, **kwargs)

    def _on_sample(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if self._open is not None:
            self.marks["step"].append((self._open, self._mark()))
            self._open = None
        return out

    def _on_device_proposal(self, step: Any, *args: Any) -> None:
        if self._open is None:  # not a full step
            return self._hook(step, *args)
        start = self._mark()
        self.marks["step"].append((self._open, start))
        self._open = None
        self._hook(step, *args)
        if step.device_drafts is not None:
            self.marks["propose"].append((start, self._mark()))

    def _on_propose(self, fn: Any, requests: Any, sched: Any = None, *args: Any, **kwargs: Any) -> Any:
        step = args[0] if args else kwargs.get("step")
        if sched is None or not self.is_full(sched) or getattr(step, "device_drafts", None) is not None:
            return fn(requests, sched, *args, **kwargs)  # (a device proposal was timed at its launch)
        start = self._mark()
        out = fn(requests, sched, *args, **kwargs)
        self.marks["propose"].append((start, self._mark()))
        return out

    def _on_engine_step(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._launched_full = False
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self._launched_full:
            self.wall.append(time.perf_counter() - t0)
        return out

    def stop(self, warmup_steps: int) -> dict[str, list[float]]:
        """Restore the wrapped methods; milliseconds per full step (``step``, ``propose``, ``wall``), the first
        ``warmup_steps`` of each dropped."""
        for obj, name in self._originals:
            delattr(obj, name)  # the instance attribute shadowed the class's method
        if self._hook is not None:
            self._runner.after_spec_sample = self._hook
        if self.cuda:
            torch.cuda.synchronize()
        times = {
            key: [s.elapsed_time(e) if self.cuda else 1e3 * (e - s) for s, e in marks]
            for key, marks in self.marks.items()
        }
        times["wall"] = [1e3 * t for t in self.wall]
        return {key: values[warmup_steps:] for key, values in times.items()}


def write_eagle_head(target_dir: str, head_dir: Path, with_weights: bool) -> str:
    """An EAGLE-1 head directory of the target's shape (the layout ``pagedllm/models/eagle.py`` loads): the
    target's config.json with one layer; with ``with_weights``, random weights in bfloat16 (``fc.weight``
    ``[H, 2H]``, ``layers.0.*`` without an input norm; no embedding copy: the target's is used)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)  # the target's per-layer list; a one-layer head has its own
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")  # as published EAGLE-1 heads
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(config, indent=2))
    if with_weights:
        from safetensors.torch import save_file

        h, nh, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        hd, inter = config.get("head_dim") or h // nh, config["intermediate_size"]
        gen = torch.Generator().manual_seed(0)
        shapes = {
            "fc.weight": (h, 2 * h),
            "layers.0.self_attn.q_proj.weight": (nh * hd, h),
            "layers.0.self_attn.k_proj.weight": (nkv * hd, h),
            "layers.0.self_attn.v_proj.weight": (nkv * hd, h),
            "layers.0.self_attn.o_proj.weight": (h, nh * hd),
            "layers.0.mlp.gate_proj.weight": (inter, h),
            "layers.0.mlp.up_proj.weight": (inter, h),
            "layers.0.mlp.down_proj.weight": (h, inter),
        }
        tensors = {
            name: (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
            for name, shape in shapes.items()
        }
        tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        save_file(tensors, str(head_dir / "model.safetensors"))
    return str(head_dir)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(args: argparse.Namespace, speculative_config: dict | None) -> dict[int, dict[str, Any]]:
    """One engine (plain, or speculative with ``speculative_config``): per batch size, the median milliseconds of
    its full steps (``step``, ``propose``, ``wall``), their counts, and what the engine ran."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        speculative_config=speculative_config,
        enforce_eager=args.enforce_eager,
    )
    try:
        engine = llm.llm_engine
        core = engine.engine_core
        runner = core.runner
        k = args.num_speculative_tokens
        query_len = 1 if speculative_config is None else k + 1
        params = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
        )
        results = {}
        for bs in args.batch_sizes:
            rng = np.random.default_rng(args.seed + bs)
            prompts = [
                {"prompt_token_ids": ids}
                for ids in rng.integers(0, min(core.vocab_size, 10000), size=(bs, args.input_len)).tolist()
            ]
            stats_before = engine.get_stats()
            timer = FullStepTimer(engine, bs, query_len)
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                times = timer.stop(args.warmup_steps)
            stats = engine.get_stats()
            graphs = getattr(runner, "graph_runner", None)
            result = {
                **{key: _median(values) for key, values in times.items()},
                "num_steps": {key: len(values) for key, values in times.items()},
                "async_scheduling": bool(core.config.scheduler_config.async_scheduling),
                "timer": "cuda_events" if timer.cuda else "perf_counter",
            }
            if speculative_config is None:
                result["graphs"] = {"plain_decode": graphs is not None and bs <= graphs.max_bs}
            else:
                proposer = core.proposer
                drafts = stats.spec_num_drafts - stats_before.spec_num_drafts
                accepted = stats.spec_num_accepted_tokens - stats_before.spec_num_accepted_tokens
                result["measured_mal"] = 1 + accepted / drafts if drafts else None
                catch_up, draft_steps = proposer.catch_up_graphs, proposer.step_graphs
                result["graphs"] = {
                    "verify": graphs is not None and bool(graphs.spec_sizes) and bs <= graphs.spec_sizes[-1],
                    "head_catch_up": catch_up is not None and bs <= catch_up.max_bs,
                    "head_draft_steps": draft_steps is not None and bs <= draft_steps.max_bs,
                }
                result["speculation_graphs"] = getattr(proposer, "graphs_summary", None)
            results[bs] = result
        return results
    finally:
        llm.shutdown()


def report(args: argparse.Namespace, bs: int, plain: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of batch size ``bs`` from the two engines' measurements."""
    t_plain, t_verify, t_propose = plain["step"], spec["step"], spec["propose"]
    measured = None not in (t_plain, t_verify, t_propose)
    wall = None not in (plain["wall"], spec["wall"])
    return {
        "batch_size": bs,
        "num_speculative_tokens": args.num_speculative_tokens,
        "t_plain_ms": t_plain,
        "t_verify_ms": t_verify,
        "t_propose_ms": t_propose,
        "verify_over_plain": t_verify / t_plain if measured else None,
        "propose_over_plain": t_propose / t_plain if measured else None,
        "implied_speedup": {
            str(mal): mal * t_plain / (t_verify + t_propose) if measured else None for mal in args.mal
        },
        "t_plain_step_wall_ms": plain["wall"],
        "t_spec_step_wall_ms": spec["wall"],
        "implied_speedup_wall": {
            str(mal): mal * plain["wall"] / spec["wall"] if wall else None for mal in args.mal
        },
        "measured_mal": spec.get("measured_mal"),
        "num_steps": {
            "plain": plain["num_steps"]["step"],
            "verify": spec["num_steps"]["step"],
            "propose": spec["num_steps"]["propose"],
        },
        "timer": spec["timer"],
        "async_scheduling": {"plain": plain["async_scheduling"], "spec": spec["async_scheduling"]},
        "graphs": {**plain["graphs"], **spec["graphs"]},
        "speculation_graphs": spec.get("speculation_graphs"),
        "enforce_eager": args.enforce_eager,
        "model": args.model,
        "eagle_dir": args.eagle_dir,  # None: one of the target's shape, written for the run
        "load_format": args.load_format,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "warmup_steps": args.warmup_steps,
    }


def format_line(rec: dict[str, Any]) -> str:
    if rec["implied_speedup"] and None in rec["implied_speedup"].values():
        return f"Spec cost (batch {rec['batch_size']}): too few full steps measured ({rec['num_steps']})"
    speedups = ", ".join(f"MAL {mal} -> {s:.2f}x" for mal, s in rec["implied_speedup"].items())
    return (
        f"Spec cost (batch {rec['batch_size']}, k={rec['num_speculative_tokens']}, {rec['timer']}): "
        f"plain step {rec['t_plain_ms']:.3f} ms, verify {rec['t_verify_ms']:.3f} ms "
        f"({rec['verify_over_plain']:.2f}x plain), propose {rec['t_propose_ms']:.3f} ms "
        f"({rec['propose_over_plain']:.2f}x plain); implied speedup {speedups} "
        f"(measured MAL {rec['measured_mal']:.2f}, graphs {rec['graphs']})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's HF directory")
    ap.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--mal", type=float, nargs="+", default=[3.0, 3.6], help="mean acceptance lengths")
    ap.add_argument("--eagle-dir", default=None, help="an EAGLE-1 head (default: one of the target's shape)")
    ap.add_argument(
        "--work-dir", default=None, help="where the head is written (default: a temporary directory)"
    )
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--warmup-steps", type=int, default=10, help="full steps dropped at the start of each run"
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="default: what the requests need")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: the engine's; a smaller one captures fewer CUDA graphs (a shorter start-up)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, in either engine")
    args = ap.parse_args(argv)
    if args.num_speculative_tokens < 1:
        ap.error("--num-speculative-tokens must be >= 1")
    if args.warmup_steps < 0:
        ap.error("--warmup-steps must be >= 0")
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len + args.num_speculative_tokens + 1
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.work_dir is not None:
        os.makedirs(args.work_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        head_dir = args.eagle_dir
        if head_dir is None:
            head_dir = write_eagle_head(args.model, Path(tmp) / "eagle-head", args.load_format != "dummy")
        plain = measure(args, None)
        spec = measure(
            args,
            {"method": "eagle", "model": head_dir, "num_speculative_tokens": args.num_speculative_tokens},
        )
    records = []
    for bs in args.batch_sizes:
        rec = report(args, bs, plain[bs], spec[bs])
        print(json.dumps({"spec_cost": rec}), flush=True)
        print(format_line(rec), flush=True)
        records.append(rec)
    return records


if __name__ == "__main__":
    main()
