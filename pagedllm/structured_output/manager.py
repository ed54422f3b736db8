"""The engine core's side of structured outputs: compile grammars off the step loop, fill per-step bitmasks.

Data flow (see engine_core.py):

    add_request ──► StructuredOutputManager.new_state ──► compile in a worker thread (cached by constraint)
    schedule ─────► a waiting request whose grammar is not ready is skipped (others go on)
    launch step ──► forward pass on the device
    grammar_bitmask(rows that sample) ──► host [rows, ceil(V/32)] int32 ──► the sampler masks the logits
        (rows whose mask provably did not change reuse it; the others: xgrammar's batch fill, fill_threads)
    update_from_output ──► GrammarState.accept(token) advances the request's matcher

A ``GrammarState`` belongs to one request. With a reasoning parser the grammar applies only after the reasoning
ends (the end marker, e.g. ``</think>``, in the prompt after the last start marker, or generated).
``rollback`` undoes accepted tokens (speculative decoding's rejected drafts).

Inside a JSON string with no length or pattern constraint, a row that accepts only "plain" tokens (whole
characters, no quote or backslash) stays in the same string with the same continuations, so its mask, xgrammar's
to the bit, is reused instead of filled again (``_StringReuse`` says why that is exact). With random weights
nearly every row of a JSON-schema batch spends its tokens there, where a fill costs ~100 us per row on a 152k
vocabulary. Such a row's plain tokens are not given to its matcher at all: it already stands where they would
take it (``GrammarState.accept``; ``rollback`` knows which tokens it skipped). ``PAGEDLLM_GRAMMAR_MASK_REUSE=0``
turns both off; ``PAGEDLLM_GRAMMAR_FILL_THREADS`` sizes the fill.

JSON with free whitespace gets its whitespace runs capped here, per token (grammar.py says why): after
``MAX_JSON_WHITESPACE_TOKENS`` consecutive whitespace-only tokens, the row's mask drops every whitespace-only
token until another one comes (applied on top of a reused mask too). Preemption needs no rollback: a
preempted request keeps its generated tokens (it is recomputed, not restarted), and a token sampled by a step
in flight when it was preempted is still accepted; so the matcher always matches the request's output.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import (
    MAX_JSON_WHITESPACE_TOKENS,
    _xgr,
    build_grammar,
    caps_whitespace,
    plain_string_tokens,
    string_loop_rules,
)

logger = logging.getLogger(__name__)

# Batches with at least this many rows to fill use xgrammar's batch fill (its thread pool).
_BATCH_FILL_MIN_ROWS = 8
_CACHE_SIZE = 512  # compiled grammars kept (by constraint)
_ROLLBACK_WINDOW = 1024  # tokens GrammarState.rollback can undo
FILL_THREADS_ENV = "PAGEDLLM_GRAMMAR_FILL_THREADS"  # threads of the batch bitmask fill (default: half the CPUs)
MASK_REUSE_ENV = "PAGEDLLM_GRAMMAR_MASK_REUSE"  # "0": fill every constrained row every step (no in-string reuse)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_fill_threads() -> int:
    """Threads for the batch bitmask fill: ``PAGEDLLM_GRAMMAR_FILL_THREADS``, else half the usable CPUs (the
    engine's own thread, the device runtime's and the front-end keep the rest)."""
    value = os.environ.get(FILL_THREADS_ENV)
    if value is None or value.strip() == "":
        return max(1, usable_cpus() // 2)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{FILL_THREADS_ENV} must be a positive integer, got {value!r}")
    return n


def _check_fill_threads(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fill_threads must be a positive integer, got {n!r}")
    return n


# One parser state of xgrammar's debug print (0.2.x): the only view of where a matcher is.
_PARSER_STATE = re.compile(
    r"ParserState\(rule_id=(-?\d+), sequence_id=(-?\d+), element_id=(-?\d+), rule_start_pos=-?\d+, "
    r"sub_element_id=(-?\d+)\)"
)


def _single_parser_state(matcher: Any) -> tuple[int, int, int, int] | None:
    """(rule, sequence, element, sub-element) of the matcher's only current parser state (its position in the
    grammar, without where the rule started), or None if it has several or the print is not understood."""
    text = matcher._debug_print_internal_state()
    if text.count("ParserState(") != 1:
        return None
    m = _PARSER_STATE.search(text)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]), int(m[4]))


class _StringReuse:
    """What one compiled grammar knows for reusing in-string masks.

    ``rules``: its unconstrained JSON string rules (``grammar.string_loop_rules``): ``R ::= "\"" | C R | "\\" E R``
    with C the strict string character class. From R's character boundary (the state after the opening quote
    or after a character) a plain token (``plain[token]``: whole characters of C, no quote, no backslash) can
    only go through ``C R`` again and again: it ends at R's character boundary of the same string, whose
    continuations (the rest of the string, then whatever follows it) are the same as before. The mask, a
    function of those continuations, is then unchanged.

    ``boundary``: R's character-boundary parser states, learned: a state that a row had at one fill and again
    at its next fill, with only plain tokens (at least one) accepted between, in one of ``rules``. No other
    state of R comes back after plain tokens: one inside a multi-byte character rejects them (they start with
    a whole character), one inside an escape needs a backslash to come back to.
    """

    __slots__ = ("rules", "boundary", "plain")

    def __init__(self, rules: frozenset[int], plain: bytes) -> None:
        self.rules = rules
        self.boundary: set[tuple[int, int, int, int]] = set()
        self.plain = plain


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
        # In-string mask reuse (_StringReuse), all touched only by the manager's fill and by accept/rollback.
        self._reuse: _StringReuse | None = None
        self._mask: np.ndarray | None = None  # [num_words] int32: xgrammar's mask now, while _mask_valid
        self._mask_valid = False
        self._mask_key: object | None = None  # new for every mask kept (what a buffer row holds, manager._held)
        self._sig: tuple[int, int, int, int] | None = None  # the single parser state at the last fill, in a string rule
        self._since = -1  # tokens accepted since the last fill, all plain; -1 once one was not
        self._plain: bytes | None = None  # _reuse.plain
        self._stop_ids: frozenset[int] = frozenset()  # the matcher's stop tokens (only they can terminate it)
        self._terminated = False  # matcher.is_terminated(), kept here (read for every row every step)
        self._capped = False  # whitespace_capped, kept here
        # Per recent accepted token: whether the matcher skipped it (a plain token at a known string boundary, see
        # accept). Only rollback reads it, and speculative decoding rolls back a few tokens at most.
        self._skipped: deque[bool] = deque(maxlen=_ROLLBACK_WINDOW)

    def ready(self) -> bool:
        """Whether the grammar compiled (or failed: then ``error`` says why). Creates the matcher once."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            compiled, start_ids, end_ids, self._ws_ids, self._reuse = self._future.result()
        except Exception as e:  # noqa: BLE001 - the front-end validated the constraint; report whatever is left
            self.error = f"{type(e).__name__}: {e}"
            return True
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None)
        self._stop_ids = frozenset(self.matcher.stop_token_ids)
        self._plain = None if self._reuse is None else self._reuse.plain
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
        return self.matcher is not None and self.reasoning_ended and not self._terminated

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
        if self._terminated:
            return True  # past the end: the scheduler stops a request at the token that ends its grammar
        plain = self._plain
        is_plain = plain is not None and 0 <= token_id < len(plain) and plain[token_id]
        if is_plain and self._mask_valid:
            # At a string's character boundary whose mask is known, a plain token leads back to the same boundary
            # of the same string, with the same continuations (_StringReuse): the matcher is already in the state
            # it would reach, so it does not see the token (xgrammar's accept is most of a constrained step's
            # host work). A later non-plain token, fill or rollback starts from that same state.
            self._skipped.append(True)
        else:
            if not self.matcher.accept_token(token_id):
                self._mask_valid = False
                self._since = -1
                return False
            self._skipped.append(False)
            if token_id in self._stop_ids:
                self._terminated = self.matcher.is_terminated()
        self.num_accepted += 1
        if plain is not None:
            if is_plain:
                if self._since >= 0:
                    self._since += 1
            else:
                self._mask_valid = False
                self._since = -1
        ws = self._ws_ids
        if ws is not None:
            runs = self._ws_runs
            runs.append((runs[-1] + 1 if runs else 1) if token_id in ws else 0)
            self._capped = runs[-1] >= MAX_JSON_WHITESPACE_TOKENS
        return True

    @property
    def terminated(self) -> bool:
        """Whether the grammar has accepted a stop token that ends it: nothing may follow (the scheduler then
        finishes the request, whatever ``min_tokens`` and ``ignore_eos`` say)."""
        return self._terminated

    @property
    def whitespace_capped(self) -> bool:
        """Whether the next token must not be whitespace-only (the run reached ``MAX_JSON_WHITESPACE_TOKENS``)."""
        return self._capped

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            if num_tokens > len(self._skipped):
                raise ValueError(f"cannot roll back {num_tokens} tokens (at most {len(self._skipped)})")
            real = sum(not self._skipped.pop() for _ in range(num_tokens))  # the ones the matcher saw
            self.num_accepted -= num_tokens
            if real:
                self.matcher.rollback(real)
                self._terminated = self.matcher.is_terminated()
                self._mask_valid = False
                self._since = -1
            else:  # only skipped plain tokens: still at the same string boundary, mask unchanged
                self._since = max(self._since - num_tokens, 0)
            if self._ws_ids is not None:
                del self._ws_runs[len(self._ws_runs) - num_tokens :]
                self._capped = bool(self._ws_runs) and self._ws_runs[-1] >= MAX_JSON_WHITESPACE_TOKENS


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
        fill_threads: int | None = None,
        reuse_string_masks: bool | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._fill_threads = default_fill_threads() if fill_threads is None else _check_fill_threads(fill_threads)
        if reuse_string_masks is None:
            reuse_string_masks = os.environ.get(MASK_REUSE_ENV, "1").strip() != "0"
        self.reuse_string_masks = reuse_string_masks
        self._plain: bytes | None = None  # plain_string_tokens of the vocabulary (set with the compiler)
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
        # Per buffer and row: the _mask_key of the reused mask the row holds (so it is not copied again), or None.
        self._held: list[list[object | None]] = []
        self._turn = 0

    @property
    def fill_threads(self) -> int:
        """Threads of xgrammar's batch bitmask fill (``PAGEDLLM_GRAMMAR_FILL_THREADS``; default half the usable
        CPUs). Settable between steps (not while a fill runs)."""
        return self._fill_threads

    @fill_threads.setter
    def fill_threads(self, n: int) -> None:
        self._fill_threads = _check_fill_threads(n)
        self._batch_matcher = None

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
                if self.reuse_string_masks and hasattr(xgr.GrammarMatcher, "_debug_print_internal_state"):
                    self._plain = plain_string_tokens(
                        info.decoded_vocab, self.vocab_size, [*info.special_token_ids, *(stop or [])]
                    )
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
    ) -> tuple[Any, list[int], list[int], frozenset[int] | None, _StringReuse | None]:
        compiler = self._ensure_compiler()
        compiled = compiler.compile_grammar(build_grammar(params))
        ws_ids = self._ws_ids if caps_whitespace(params) else None
        reuse = None
        if self._plain is not None and params.kind in ("json", "json_object"):
            rules = string_loop_rules(str(compiled.grammar))
            if rules:
                reuse = _StringReuse(rules, self._plain)
        return compiled, self._marker_ids[0], self._marker_ids[1], ws_ids, reuse

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
        return self._fill(states, rows, *self._buffer(len(states)))

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
        buf, held = self._buffer(sum(len(d) + 1 for d in drafts))
        buf.fill_(-1)
        held[:] = [None] * len(held)
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
        buf, held = self._buffer(len(states))  # chosen here, on the caller's thread (the alternation is not locked)
        if self._fill_executor is None:
            self._fill_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-bitmask")
        return self._fill_executor.submit(self._fill, states, rows, buf, held)

    def _fill(
        self, states: Sequence[GrammarState | None], rows: list[int], buf: torch.Tensor, held: list[object | None]
    ) -> torch.Tensor:
        """Rows ``rows`` get their states' masks (reused or filled by xgrammar), the others allow everything.
        ``held``: what the rows of ``buf`` hold (a reused mask already in place, from two steps ago, is kept)."""
        n = buf.shape[0]
        if len(rows) < n:
            buf.fill_(-1)
            held[:n] = [None] * n
        host = buf.numpy()
        todo = []
        for i in rows:
            state = states[i]
            if state._mask_valid:
                key = state._mask_key
                if held[i] is not key:
                    host[i] = state._mask
                    held[i] = key
            else:
                todo.append(i)
        if len(todo) >= _BATCH_FILL_MIN_ROWS:
            if self._batch_matcher is None:
                self._batch_matcher = _xgr().BatchGrammarMatcher(min(self._fill_threads, os.cpu_count() or 1))
            self._batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in todo], buf, todo)
        else:
            for i in todo:
                states[i].matcher.fill_next_token_bitmask(buf, i)
        for i in todo:
            state = states[i]
            if state._reuse is not None:
                self._note_fill(state, host[i])
            held[i] = state._mask_key if state._mask_valid else None
        capped = [i for i in rows if states[i]._capped]
        if capped:
            buf[capped] &= self._not_ws_mask
            for i in capped:
                held[i] = None
        return buf

    def _note_fill(self, state: GrammarState, mask: np.ndarray) -> None:
        """After xgrammar filled ``mask`` for ``state``: keep it for reuse if the row is at a string's character
        boundary (learning that state first, see ``_StringReuse``)."""
        reuse = state._reuse
        sig = _single_parser_state(state.matcher)
        if sig is not None and sig[0] in reuse.rules:
            if sig not in reuse.boundary and sig == state._sig and state._since > 0:
                reuse.boundary.add(sig)
            if sig in reuse.boundary:
                if state._mask is None:
                    state._mask = np.empty(self.num_words, dtype=np.int32)
                state._mask[:] = mask
                state._mask_key = object()
                state._mask_valid = True
            state._sig = sig
        else:
            state._sig = None
        state._since = 0

    def _buffer(self, n: int) -> tuple[torch.Tensor, list[object | None]]:
        """A host buffer of ``n`` rows and its ``held`` list. Two alternate, so filling step N+1's mask never
        overwrites step N's while its copy to the device may still be queued."""
        self._turn ^= 1
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, self.num_words, dtype=torch.int32))
            self._held.append([])
        buf = self._buffers[self._turn]
        if buf.shape[0] < n:
            size = max(n, 2 * buf.shape[0])
            buf = torch.empty(size, self.num_words, dtype=torch.int32, pin_memory=self._pin_memory)
            self._buffers[self._turn] = buf
            self._held[self._turn] = [None] * size
        return buf[:n], self._held[self._turn]

    def shutdown(self) -> None:
        """Stop the compile and fill threads: queued work is cancelled, a running compile or fill ends first, so
        no thread of this manager outlives the call. Idempotent."""
        for executor in (self._executor, self._fill_executor):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
