"""The host work of a JSON-schema-constrained decode step, without a model or a GPU.

The structured-output suite's workload (``bash benchmarks/gpu.sh structured``): 256 requests, each constrained to
``DEFAULT_JSON_SCHEMA`` of ``pagedllm.benchmarks.throughput``, decoding with random weights, so almost every row
sits inside the ``name`` string. Each decode step the engine core (async scheduling) advances every row's matcher
by the token it sampled (``GrammarState.accept``) and then fills the next step's bitmask
(``grammar_bitmask_async``); that host work, not the forward pass, bounds a constrained step. This script does
exactly that through pagedllm's own ``StructuredOutputManager`` / ``GrammarState``:

1. a byte-level BPE the way the structured suite trains it (151,643 tokens from ~120 MB of the image's Python
   sources; ``--vocab-size 32000 --corpus-mb 30`` for a quick run; ``--tokenizer DIR`` loads DIR, or trains into it
   once);
2. ``--rows`` states of one compiled grammar, each fed ``[{"id": <n>, "name": "`` and then ``--warmup-steps``
   tokens drawn uniformly from its mask (what a random-weight model does): rows end up mid-string;
3. a token trajectory of ``--steps`` more steps drawn the same way, replayed for every fill thread count
   (``StructuredOutputManager.fill_threads``), with and without in-string mask reuse (``--reuse``), from the same
   starting states, timing per step: accept one token per row, then fill the batch bitmask. An untimed replay
   first compares every reused-mask step with xgrammar's own masks (the table's last column).

    python benchmarks/grammar_fill_bench.py                          # the full 151,643-token vocabulary
    python benchmarks/grammar_fill_bench.py --vocab-size 32000 --corpus-mb 30 --tokenizer /tmp/bpe-32k

The last lines printed are a table of ms per step by fill thread count: median (min) over the timed steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.benchmarks.throughput import DEFAULT_JSON_SCHEMA  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.manager import GrammarState, StructuredOutputManager  # noqa: E402

QWEN3_TOKENIZER_SIZE = 151_643
QWEN3_MODEL_VOCAB = 151_936  # the model's logits (and so the bitmask) span this many ids


def train_tokenizer(out_dir: str, vocab_size: int, corpus_mb: float) -> None:
    """The structured suite's tokenizer: a byte-level BPE trained on the standard library's and the installed
    packages' Python sources (sorted, so the same image gives the same tokenizer), saved as a transformers
    tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files: list[str] = []
    size = 0
    for top in (os.path.dirname(os.__file__), os.path.dirname(os.path.dirname(transformers.__file__))):
        for root, dirs, names in os.walk(top):
            dirs.sort()
            dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
            for name in sorted(names):
                if name.endswith(".py") and size < corpus_mb * 1e6:
                    files.append(os.path.join(root, name))
                    size += os.path.getsize(files[-1])

    def texts():
        for path in files:
            with open(path, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out_dir)
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(files)} files ({size / 1e6:.0f} MB) -> {out_dir}")


def load_tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    path = args.tokenizer or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"pagedllm-bpe-{args.vocab_size}-{args.corpus_mb:g}mb"
    )
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        t0 = time.perf_counter()
        train_tokenizer(path, args.vocab_size, args.corpus_mb)
        print(f"  (trained in {time.perf_counter() - t0:.0f} s)")
    return AutoTokenizer.from_pretrained(path)


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[np.ndarray]:
    """The allowed token ids of each row of an int32 bitmask (bit i of word w = token 32 * w + i)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return [np.flatnonzero(row) for row in bits]


def sample(bitmask: torch.Tensor, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """One token per row, uniform over the row's mask (a random-weight model's choice): the first of 16 uniform
    draws that the mask allows, else one of the row's allowed ids."""
    words = bitmask.numpy()
    draws = rng.integers(vocab_size, size=(words.shape[0], 16))
    hit = (words[np.arange(words.shape[0])[:, None], draws >> 5] >> (draws & 31)) & 1
    out = []
    for r in range(words.shape[0]):
        k = np.flatnonzero(hit[r])
        if len(k):
            out.append(int(draws[r, k[0]]))
            continue
        ids = allowed_ids(bitmask[r : r + 1], vocab_size)[0]
        if len(ids) == 0:
            raise RuntimeError("a row allows no token")
        out.append(int(ids[rng.integers(len(ids))]))
    return out


def fresh_states(
    manager: StructuredOutputManager, params: StructuredOutputsParams, prefixes: list[list[int]], eos: int
) -> list[GrammarState]:
    states = []
    for prefix in prefixes:
        state = manager.new_state(params, [0], [eos])
        state.wait(600)
        if not state.ready() or state.error is not None:
            raise RuntimeError(f"the grammar did not compile: {state.error}")
        for t in prefix:
            if not state.accept(t):
                raise RuntimeError(f"the grammar rejects token {t} of the prefix")
        states.append(state)
    return states


def make_manager(vocab: int, tok: Any, reuse: bool) -> StructuredOutputManager:
    try:
        return StructuredOutputManager(vocab, lambda: tok, reuse_string_masks=reuse)
    except TypeError:  # an older manager: no reuse to turn off
        return StructuredOutputManager(vocab, lambda: tok)


def set_threads(manager: StructuredOutputManager, n: int) -> None:
    if hasattr(manager, "fill_threads"):
        manager.fill_threads = n
    else:  # an older manager without the knob: its batch matcher, sized here
        import xgrammar

        manager._batch_matcher = xgrammar.BatchGrammarMatcher(n)


def fill(manager: StructuredOutputManager, states: list[GrammarState]) -> torch.Tensor:
    """The engine's fill (async scheduling: a worker thread; the caller waits here)."""
    return manager.grammar_bitmask_async(states).result()


def reference_masks(manager: StructuredOutputManager, states: list[GrammarState]) -> torch.Tensor:
    """xgrammar's own masks of the states now, one by one (plus the manager's whitespace cap)."""
    ref = torch.empty(len(states), manager.num_words, dtype=torch.int32)
    for i, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(ref, i)
        if state.whitespace_capped:
            ref[i] &= manager._not_ws_mask
    return ref


def run(
    manager: StructuredOutputManager,
    params: StructuredOutputsParams,
    prefixes: list[list[int]],
    eos: int,
    trajectory: list[list[int]],
    warmup: int,
    check: bool,
) -> tuple[list[float], list[float], int]:
    """Fresh states, the warm-up tokens, then the timed steps: (accept ms, fill ms, rows whose mask differed from
    xgrammar's when ``check``)."""
    states = fresh_states(manager, params, prefixes, eos)
    for tokens in trajectory[:warmup]:
        for state, t in zip(states, tokens, strict=True):
            state.accept(t)
    fill(manager, states)  # the mask the first timed step's tokens were drawn from
    accept_ms, fill_ms, wrong = [], [], 0
    for tokens in trajectory[warmup:]:
        t1 = time.perf_counter()
        for state, t in zip(states, tokens, strict=True):
            state.accept(t)
        t2 = time.perf_counter()
        mask = fill(manager, states)
        t3 = time.perf_counter()
        accept_ms.append((t2 - t1) * 1e3)
        fill_ms.append((t3 - t2) * 1e3)
        if check:
            wrong += int((mask != reference_masks(manager, states)).any(dim=1).sum())
    return accept_ms, fill_ms, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=QWEN3_TOKENIZER_SIZE, help="BPE size when training")
    ap.add_argument("--corpus-mb", type=float, default=120, help="training text (the structured suite: 120)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory to load (trained into it if absent)")
    ap.add_argument("--model-vocab-size", type=int, default=None,
                    help="bitmask width (default: 151,936 for a 151,643-token BPE, as Qwen3; else the tokenizer's)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=16, help="random in-grammar tokens before timing")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per configuration")
    ap.add_argument("--threads", default=None, help="comma-separated fill thread counts (default: 1,2,4,8,12,16 "
                    "up to the CPUs this process may use)")
    ap.add_argument("--reuse", choices=("both", "on", "off"), default="both",
                    help="in-string mask reuse (PAGEDLLM_GRAMMAR_MASK_REUSE): time with it, without it, or both")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the untimed replay that compares every reused-mask step with xgrammar's own masks")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    ncpu = len(os.sched_getaffinity(0))
    if args.threads:
        threads = [int(t) for t in args.threads.split(",")]
    else:
        threads = [t for t in (1, 2, 4, 8, 12, 16) if t <= ncpu] or [1]
        if ncpu not in threads and ncpu < 16:
            threads.append(ncpu)
    from importlib.metadata import version

    print(f"CPUs usable: {ncpu}; torch {torch.__version__}, xgrammar {version('xgrammar')}")
    t0 = time.perf_counter()
    tok = load_tokenizer(args)
    vocab = args.model_vocab_size or (QWEN3_MODEL_VOCAB if len(tok) == QWEN3_TOKENIZER_SIZE else len(tok))
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.reuse]
    managers = {reuse: make_manager(vocab, tok, reuse) for reuse in modes}
    params = StructuredOutputsParams(json=DEFAULT_JSON_SCHEMA)
    rng = np.random.default_rng(args.seed)
    prefixes = [
        tok.encode(f'[{{"id": {int(rng.integers(1_000_000))}, "name": "', add_special_tokens=False)
        for _ in range(args.rows)
    ]
    manager = managers[modes[0]]
    states = fresh_states(manager, params, prefixes, tok.eos_token_id)
    print(f"tokenizer {len(tok)} tokens, bitmask {vocab} ids; grammar ready in {time.perf_counter() - t0:.1f} s")

    # The trajectory: warm-up tokens then timed tokens, each uniform over its row's mask.
    set_threads(manager, max(threads))
    trajectory: list[list[int]] = []
    for _ in range(args.warmup_steps + args.steps):
        tokens = sample(fill(manager, states), len(tok), rng)
        for state, t in zip(states, tokens, strict=True):
            if not state.accept(t):
                raise RuntimeError(f"the grammar rejects token {t} from its own mask")
        trajectory.append(tokens)
    one_state = sum(s.matcher._debug_print_internal_state().count("ParserState") == 1 for s in states)
    text = tok.decode(prefixes[0] + [r[0] for r in trajectory])
    print(f"after the trajectory {one_state}/{args.rows} rows have a single parser state; row 0: {text[:80]!r}")

    verdict = "-"
    if True in managers and not args.no_check:  # untimed: every reused-mask step against xgrammar's own masks
        _, _, wrong = run(managers[True], params, prefixes, tok.eos_token_id, trajectory, args.warmup_steps, True)
        verdict = "= xgrammar" if wrong == 0 else f"{wrong} row-steps DIFFER"
        print(f"reused masks, {args.steps} steps x {args.rows} rows, compared with xgrammar's: {verdict}")
    results = []
    for n in threads:
        for reuse in modes:
            manager = managers[reuse]
            set_threads(manager, n)
            a, f, _ = run(manager, params, prefixes, tok.eos_token_id, trajectory, args.warmup_steps, False)
            results.append((n, reuse, a, f, verdict if reuse else "-"))
            print(f"  threads {n:>2} reuse {'on ' if reuse else 'off'}: accept {statistics.median(a):.2f} ms, "
                  f"fill {statistics.median(f):.2f} ms (median per step)", flush=True)
    for manager in managers.values():
        manager.shutdown()

    print(f"\n{args.rows} rows x {args.steps} steps, {len(tok)}-token BPE, {ncpu} CPUs: ms per step, median (min)")
    print(f"{'threads':>7} | {'reuse':>5} | {'accept':>13} | {'fill':>13} | {'accept+fill':>13} | masks")
    for n, reuse, a, f, checked in results:
        total = [x + y for x, y in zip(a, f, strict=True)]
        cells = " | ".join(f"{statistics.median(x):6.2f} ({min(x):5.2f})" for x in (a, f, total))
        print(f"{n:>7} | {'on' if reuse else 'off':>5} | {cells} | {checked}")
    print(f"(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
