"""The engine core's side of structured outputs: compile grammars off the step loop, fill per-step bitmasks.

Data flow (see engine_core.py):

    add_request ──► StructuredOutputManager.new_state ──► compile in a worker thread (cached by constraint)
    schedule ─────► a waiting request whose grammar is not ready is skipped (others go on)
    launch step ──► forward pass on the device
    grammar_bitmask(rows that sample) ──► host [rows, ceil(V/32)] int32 ──► the sampler masks the logits
    update_from_output ──► GrammarState.accept(token) advances the request's matcher

A ``GrammarState`` belongs to one request. With a reasoning parser the grammar applies only after the reasoning
ends (the end marker, e.g. ``</think>``, in the prompt after the last start marker, or generated).
``rollback`` undoes accepted tokens (speculative decoding's rejected drafts). JSON with free whitespace gets
its whitespace runs capped here, per token (grammar.py says why): after ``MAX_JSON_WHITESPACE_TOKENS``
consecutive whitespace-only tokens, the row's mask drops every whitespace-only token until another one comes. Preemption needs no rollback: a
preempted request keeps its generated tokens (it is recomputed, not restarted), and a token sampled by a step
in flight when it was preempted is still accepted; so the matcher always matches the request's output.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import (
    MAX_JSON_WHITESPACE_TOKENS,
    _xgr,
    build_grammar,
    caps_whitespace,
)

logger = logging.getLogger(__name__)

# Batches with at least this many constrained rows fill their bitmasks with xgrammar's thread pool.
_BATCH_FILL_MIN_ROWS = 8
_CACHE_SIZE = 512  # compiled grammars kept (by constraint)


def _last_index(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Start of the last occurrence of ``sub`` in ``seq``, or -1."""
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and list(seq[i : i + n]) == list(sub):
            return i
    return -1


class GrammarState:
    """One request's matcher, created when its compiled grammar is ready."""

    def __init__(self, future: Future, prompt_token_ids: Sequence[int], stop_token_ids: list[int]) -> None:
        self._future = future
        self._prompt = prompt_token_ids
        self._stop_token_ids = stop_token_ids
        self.matcher: Any = None
        self.error: str | None = None
        self.reasoning_ended = True
        self._end_ids: list[int] = []
        self._tail: list[int] = []  # last generated tokens while reasoning (to spot the end marker)
        self.num_accepted = 0  # tokens the matcher accepted (what rollback may undo)
        self._ws_ids: frozenset[int] | None = None  # whitespace-only token ids, when this grammar caps their runs
        self._ws_runs: list[int] = []  # after each accepted token: how many whitespace-only tokens end the output

    def ready(self) -> bool:
        """Whether the grammar compiled (or failed: then ``error`` says why). Creates the matcher once."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            compiled, start_ids, end_ids, self._ws_ids = self._future.result()
        except Exception as e:  # noqa: BLE001 - the front-end validated the constraint; report whatever is left
            self.error = f"{type(e).__name__}: {e}"
            return True
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None)
        if end_ids:
            self._end_ids = end_ids
            self.reasoning_ended = _last_index(self._prompt, end_ids) > _last_index(self._prompt, start_ids)
        self._prompt = ()
        return True

    def wait(self, timeout: float) -> None:
        try:
            self._future.result(timeout)
        except Exception:  # noqa: BLE001 - surfaced by ready()
            pass

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (ready, past the reasoning, not yet terminated)."""
        return self.matcher is not None and self.reasoning_ended and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token. False if the grammar rejects it (the engine then stops the request)."""
        if self.matcher is None:
            return True
        if not self.reasoning_ended:
            self._tail.append(token_id)
            n = len(self._end_ids)
            if self._tail[-n:] == self._end_ids:
                self.reasoning_ended = True
                self._tail = []
            elif len(self._tail) > 4 * n:
                del self._tail[:-n]
            return True
        if self.matcher.is_terminated():
            return True  # past the end (ignore_eos): nothing left to check
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        if ok and self._ws_ids is not None:
            run = self._ws_runs[-1] + 1 if self._ws_runs and token_id in self._ws_ids else int(token_id in self._ws_ids)
            self._ws_runs.append(run)
        return ok

    @property
    def whitespace_capped(self) -> bool:
        """Whether the next token must not be whitespace-only (the run reached ``MAX_JSON_WHITESPACE_TOKENS``)."""
        return self._ws_ids is not None and bool(self._ws_runs) and self._ws_runs[-1] >= MAX_JSON_WHITESPACE_TOKENS

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            if self._ws_ids is not None:
                del self._ws_runs[len(self._ws_runs) - num_tokens :]


class StructuredOutputManager:
    """Compiles constraints against the model's vocabulary and fills token bitmasks for a step's rows.

    ``load_tokenizer`` is called once, in the worker thread, at the first constrained request (the engine core
    never loads a tokenizer otherwise). ``reasoning_markers``: (start, end) strings of a reasoning parser, or None.
    """

    def __init__(
        self,
        vocab_size: int,
        load_tokenizer: Callable[[], Any],
        reasoning_markers: tuple[str, str] | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._load_tokenizer = load_tokenizer
        self._reasoning_markers = reasoning_markers
        self._pin_memory = pin_memory
        self._executor: ThreadPoolExecutor | None = None  # compiles
        self._fill_executor: ThreadPoolExecutor | None = None  # bitmask fills (grammar_bitmask_async)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._marker_ids: tuple[list[int], list[int]] = ([], [])
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._batch_matcher: Any = None
        self._ws_ids: frozenset[int] = frozenset()  # whitespace-only token ids (set with the compiler)
        self._not_ws_mask: torch.Tensor | None = None  # [num_words] int32: bit set = not whitespace-only
        self._buffers: list[torch.Tensor] = []  # two host bitmask buffers, used in turn
        self._turn = 0

    # ------------------------------------------------------------------ compiling

    def _ensure_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                tokenizer = self._load_tokenizer()
                stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                )
                if self._reasoning_markers is not None:
                    start, end = self._reasoning_markers
                    self._marker_ids = (
                        tokenizer.encode(start, add_special_tokens=False),
                        tokenizer.encode(end, add_special_tokens=False),
                    )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
                self._set_whitespace_tokens(info.decoded_vocab)
            return self._compiler

    def _set_whitespace_tokens(self, decoded_vocab: Sequence[bytes]) -> None:
        ws = [i for i, b in enumerate(decoded_vocab[: self.vocab_size]) if b and not b.strip(b" \t\n\r")]
        self._ws_ids = frozenset(ws)
        allowed = torch.ones(self.num_words * 32, dtype=torch.bool)
        allowed[ws] = False
        words = (allowed.view(self.num_words, 32).to(torch.int64) << torch.arange(32)).sum(-1)  # [num_words]
        self._not_ws_mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bits

    def _compile(
        self, params: StructuredOutputsParams
    ) -> tuple[Any, list[int], list[int], frozenset[int] | None]:
        compiler = self._ensure_compiler()
        compiled = compiler.compile_grammar(build_grammar(params))
        ws_ids = self._ws_ids if caps_whitespace(params) else None
        return compiled, self._marker_ids[0], self._marker_ids[1], ws_ids

    def new_state(
        self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int], stop_token_ids: list[int]
    ) -> GrammarState:
        """Start compiling ``params`` (or reuse the compiled grammar of an equal constraint)."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarState(future, prompt_token_ids, stop_token_ids)

    # ------------------------------------------------------------------ per step

    def grammar_bitmask(self, states: Sequence[GrammarState | None]) -> torch.Tensor | None:
        """[len(states), ceil(vocab_size / 32)] int32 host bitmask for one step's sampling rows (row i for
        ``states[i]``; rows without an active grammar allow everything), or None when no row is constrained."""
        rows = [i for i, s in enumerate(states) if s is not None and s.active]
        if not rows:
            return None
        return self._fill(states, rows, self._buffer(len(states)))

    def grammar_bitmask_spec(
        self, states: Sequence[GrammarState | None], drafts: Sequence[Sequence[int]]
    ) -> torch.Tensor | None:
        """Speculative decoding: ``[sum(len(d) + 1 for d in drafts), ceil(vocab_size / 32)]`` int32, the rows of
        request i at ``sum(len(d) + 1 for d in drafts[:i])``: its mask now, then after each of its drafts. Each
        matcher walks through its drafts and is rolled back; past a draft the grammar rejects (or that ends it),
        rows allow everything: verification rejects that draft at the row before, so they are never used.
        None when no row is constrained."""
        if not any(s is not None and s.active for s in states):
            return None
        buf = self._buffer(sum(len(d) + 1 for d in drafts))
        buf.fill_(-1)
        row = 0
        for state, draft in zip(states, drafts, strict=True):
            if state is not None and state.active:
                self._fill_row(state, buf, row)
                before = state.num_accepted
                for i, token_id in enumerate(draft):
                    if not state.accept(token_id) or not state.active:
                        break
                    self._fill_row(state, buf, row + i + 1)
                state.rollback(state.num_accepted - before)
            row += len(draft) + 1
        return buf

    def _fill_row(self, state: GrammarState, buf: torch.Tensor, row: int) -> None:
        state.matcher.fill_next_token_bitmask(buf, row)
        if state.whitespace_capped:
            buf[row] &= self._not_ws_mask

    def grammar_bitmask_async(self, states: Sequence[GrammarState | None]) -> Future:
        """``grammar_bitmask`` in a worker thread (xgrammar releases the GIL while it fills), so the caller can
        schedule the next step meanwhile. Nothing may advance these matchers until the future is done."""
        rows = [i for i, s in enumerate(states) if s is not None and s.active]
        if not rows:
            done: Future = Future()
            done.set_result(None)
            return done
        buf = self._buffer(len(states))  # chosen here, on the caller's thread (the alternation is not locked)
        if self._fill_executor is None:
            self._fill_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-bitmask")
        return self._fill_executor.submit(self._fill, states, rows, buf)

    def _fill(
        self, states: Sequence[GrammarState | None], rows: list[int], buf: torch.Tensor
    ) -> torch.Tensor:
        buf.fill_(-1)
        if len(rows) >= _BATCH_FILL_MIN_ROWS:
            if self._batch_matcher is None:
                self._batch_matcher = _xgr().BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], buf, rows)
        else:
            for i in rows:
                states[i].matcher.fill_next_token_bitmask(buf, i)
        capped = [i for i in rows if states[i].whitespace_capped]
        if capped:
            buf[capped] &= self._not_ws_mask
        return buf

    def _buffer(self, n: int) -> torch.Tensor:
        """A host buffer of ``n`` rows. Two alternate, so filling step N+1's mask never overwrites step N's
        while its copy to the device may still be queued."""
        self._turn ^= 1
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, self.num_words, dtype=torch.int32))
        buf = self._buffers[self._turn]
        if buf.shape[0] < n:
            size = max(n, 2 * buf.shape[0])
            buf = torch.empty(size, self.num_words, dtype=torch.int32, pin_memory=self._pin_memory)
            self._buffers[self._turn] = buf
        return buf[:n]

    def shutdown(self) -> None:
        for executor in (self._executor, self._fill_executor):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
