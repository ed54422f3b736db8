"""Beam search over the engine: vLLM's ``BeamSearchParams`` / ``BeamSearchOutput``, transformers' scoring.

Each step every live beam of every prompt becomes a one-token request (``max_tokens=1``, ``logprobs`` = the
number of candidates kept per step), and all of them go to the engine in one ``LLM.generate`` call, so they run
as one batch. A beam's prompt is the original prompt plus the tokens the beam has chosen; with prefix caching
(on by default) the beams share every full KV block of their common history, cached when the previous step's
requests finished, so each step recomputes only a beam's last, partly filled block (or the one its new token
just filled). Without prefix caching every step recomputes every beam's whole sequence.

Which candidates survive and how finished sequences are scored follows transformers'
``generate(num_beams=beam_width, num_return_sequences=beam_width, do_sample=False, early_stopping=False)``:

- candidates: the top ``beams_to_keep = max(2, 1 + number of EOS ids) * beam_width`` (beam, token) pairs by
  cumulative log-probability over all live beams. A beam's contribution to that set lies within its own top
  ``beams_to_keep`` tokens, so asking the engine for that many logprobs per beam makes the choice exact;
- a candidate that ends in an EOS id becomes a finished hypothesis only if it ranks within the first
  ``beam_width`` candidates, with score ``cum_logprob / generated_len ** length_penalty`` (``generated_len``
  counts the EOS token, not the prompt); lower-ranked EOS candidates are dropped. The best ``beam_width``
  non-EOS candidates go on as the next step's beams; at step ``max_tokens`` every top-``beam_width``
  candidate is scored as finished;
- at most ``beam_width`` finished hypotheses are kept (best scores). A prompt is done once it holds
  ``beam_width`` of them and its best live beam, scored at its current length, cannot beat the worst
  (transformers' ``early_stopping=False`` heuristic), or at ``max_tokens``.

``run_beam_search_async`` runs the same search for one prompt on an ``AsyncLLM`` (the server's
``use_beam_search``): each step's one-token requests are all added before any is awaited, so they batch.

vLLM's own loop differs (EOS candidates take live-beam slots; the prompt counts in the length penalty); the
parameters, output types and field meanings are vLLM's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM, RequestStream
    from pagedllm.engine.input_processor import InputProcessor, PromptType
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's names and defaults). Invalid values raise ``ValueError`` naming the field.

    ``temperature``: only 0 (vLLM's default). The search is deterministic and ranks by the model's unscaled
    log-probabilities, as transformers' beam search with ``do_sample=False``; another value is refused rather than
    ignored.
    ``include_stop_str_in_output``: keep the EOS token at the end of a finished sequence's ``tokens`` and text.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not (_is_int(self.beam_width) and self.beam_width >= 1):
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not (isinstance(self.temperature, (int, float)) and self.temperature == 0.0):
            raise ValueError(
                f"temperature must be 0 (beam search ranks by the model's log-probabilities), got {self.temperature!r}."
            )
        if not (isinstance(self.length_penalty, (int, float)) and np.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")


@dataclass
class BeamSearchSequence:
    """One returned sequence. ``tokens`` holds the prompt and the generated tokens; ``logprobs`` one dict per
    generated token (the candidates the engine returned at that step, the chosen token among them);
    ``cum_logprob`` sums the chosen tokens' log-probabilities (an EOS token's included, even when it is left
    out of ``tokens``); ``text`` decodes ``tokens``."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id) | "length" (max_tokens)
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best (highest length-penalized score) first."""

    sequences: list[BeamSearchSequence]


def _f32_add(a: float, b: float) -> float:
    """``a + b`` rounded as float32 arithmetic rounds it (transformers keeps beam scores in float32)."""
    return float(np.float32(a) + np.float32(b))


def _f32_div(a: float, b: float) -> float:
    return float(np.float32(a) / np.float32(b))


@dataclass
class _Beam:
    token_ids: list[int]  # generated so far
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float


@dataclass
class _Hypothesis:
    beam: _Beam
    score: float
    stop_reason: int | None


class PromptBeamSearch:
    """The search state of one prompt: live beams and finished hypotheses. Pure bookkeeping, no model.

    ``beams`` are the live beams (best first); feed ``advance`` one top-logprobs dict per live beam, in that
    order, until ``is_done``; then ``results()``.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        beam_width: int,
        max_tokens: int,
        length_penalty: float,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = float(length_penalty)
        self.eos_token_ids = eos_token_ids
        self.beams_to_keep = max(2, 1 + len(eos_token_ids)) * beam_width
        self.beams: list[_Beam] = [_Beam([], [], 0.0)]
        self.finished: list[_Hypothesis] = []  # best first, at most beam_width
        self.num_steps = 0
        self.is_done = False

    def _penalized(self, cum_logprob: float, length: int) -> float:
        return _f32_div(cum_logprob, float(length) ** self.length_penalty)

    def advance(self, step_logprobs: list[dict[int, float]]) -> None:
        """One step: ``step_logprobs[i]`` maps at least the ``beams_to_keep`` most likely next tokens of
        ``beams[i]`` to their log-probabilities."""
        assert not self.is_done and len(step_logprobs) == len(self.beams)
        self.num_steps += 1
        length = self.num_steps  # generated tokens, the new one included
        candidates: list[tuple[float, int, int]] = []  # (cumulative logprob, beam index, token id)
        for i, (beam, lps) in enumerate(zip(self.beams, step_logprobs)):
            top = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))[: self.beams_to_keep]
            candidates.extend((_f32_add(beam.cum_logprob, lp), i, tok) for tok, lp in top)
        # Ties broken by (beam, token): the order of the flattened beams x vocab index.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: self.beams_to_keep]
        last_step = length >= self.max_tokens
        next_beams: list[_Beam] = []
        new_finished: list[_Hypothesis] = []
        for rank, (cum, i, tok) in enumerate(candidates):
            parent = self.beams[i]
            hits_eos = tok in self.eos_token_ids
            if not (hits_eos or last_step):
                if len(next_beams) < self.beam_width:
                    child_lps = parent.logprobs + [_logprob_dict(step_logprobs[i])]
                    next_beams.append(_Beam(parent.token_ids + [tok], child_lps, cum))
                continue
            if rank < self.beam_width:  # only the top beam_width ranks may finish
                child_lps = parent.logprobs + [_logprob_dict(step_logprobs[i])]
                child = _Beam(parent.token_ids + [tok], child_lps, cum)
                new_finished.append(
                    _Hypothesis(child, self._penalized(cum, length), tok if hits_eos else None)
                )
        # Earlier hypotheses first, so a tie keeps the one found first (a stable sort).
        merged = self.finished + new_finished
        merged.sort(key=lambda h: -h.score)
        self.finished = merged[: self.beam_width]
        self.beams = next_beams
        if last_step or not next_beams:
            self.is_done = True
        elif len(self.finished) == self.beam_width:
            best_possible = self._penalized(next_beams[0].cum_logprob, length)
            self.is_done = best_possible <= self.finished[-1].score

    def results(self, include_stop_str_in_output: bool) -> list[tuple[list[int], _Hypothesis]]:
        """(prompt + generated token ids, hypothesis) per finished hypothesis, best first."""
        out = []
        for hyp in self.finished:
            gen = hyp.beam.token_ids
            if hyp.stop_reason is not None and not include_stop_str_in_output:
                gen = gen[:-1]
            out.append((self.prompt_token_ids + gen, hyp))
        return out


def _logprob_dict(lps: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))
    return {tok: Logprob(logprob=lp, rank=r + 1) for r, (tok, lp) in enumerate(ranked)}


def run_beam_search(
    llm: LLM,
    prompts: PromptType | Sequence[PromptType],
    params: BeamSearchParams,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: one ``BeamSearchOutput`` per prompt, in input order (see the module docstring)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and _is_int(prompts[0])):
        prompts = [prompts]
    prompts = list(prompts)
    if not isinstance(lora_request, (list, tuple)):
        lora_list = [lora_request] * len(prompts)
    else:
        lora_list = list(lora_request)
        if len(lora_list) != len(prompts):
            raise ValueError(
                f"lora_request has {len(lora_list)} entries but there are {len(prompts)} prompts"
            )
    if concurrency_limit is not None and not (_is_int(concurrency_limit) and concurrency_limit >= 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1, got {concurrency_limit!r}.")
    ip = llm.llm_engine.input_processor
    eos_ids = beam_search_eos_ids(ip, params)
    step_params = _step_params(ip, params, eos_ids)
    searches = [_new_search(ip, _prompt_token_ids(ip, p), params, eos_ids) for p in prompts]
    chunk = concurrency_limit or max(len(searches), 1)
    pbar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(searches), desc="Beam search", dynamic_ncols=True)
    try:
        for start in range(0, len(searches), chunk):
            group = list(range(start, min(start + chunk, len(searches))))
            while True:
                live = [i for i in group if not searches[i].is_done]
                if not live:
                    break
                step_prompts, step_loras = [], []
                for i in live:
                    s = searches[i]
                    for beam in s.beams:
                        step_prompts.append({"prompt_token_ids": s.prompt_token_ids + beam.token_ids})
                        step_loras.append(lora_list[i])
                outs = llm.generate(step_prompts, step_params, use_tqdm=False, lora_request=step_loras)
                pos = 0
                for i in live:
                    s = searches[i]
                    n = len(s.beams)
                    s.advance([_step_logprobs(o) for o in outs[pos : pos + n]])
                    pos += n
                    if s.is_done and pbar is not None:
                        pbar.update(1)
    finally:
        if pbar is not None:
            pbar.close()
    tokenizer = llm.get_tokenizer()
    return [_output(s, params, tokenizer) for s in searches]


async def run_beam_search_async(
    engine: AsyncLLM,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    lora_request: LoRARequest | None = None,
) -> BeamSearchOutput:
    """Beam search for one prompt on an ``AsyncLLM`` (the server's engine), with the same search as
    ``run_beam_search``: each step adds one one-token request per live beam, all before awaiting any, so the
    engine runs them as one batch. The step requests are ``{request_id}-{step}-{beam}``; cancelling the task
    aborts those in flight. Raises ``ValueError`` (naming the field) as ``run_beam_search`` does."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    ip = engine.input_processor
    eos_ids = beam_search_eos_ids(ip, params)
    step_params = _step_params(ip, params, eos_ids)
    search = _new_search(ip, list(prompt_token_ids), params, eos_ids)
    while not search.is_done:
        streams: list[RequestStream] = []
        try:
            for j, beam in enumerate(search.beams):
                prompt = {"prompt_token_ids": search.prompt_token_ids + beam.token_ids}
                step_id = f"{request_id}-{search.num_steps}-{j}"
                streams.append(engine.add_request(step_id, prompt, step_params, lora_request=lora_request))
            outs = await asyncio.gather(*(_final_output(stream) for stream in streams))
        finally:
            for stream in streams:
                stream.close()  # aborts a request still running (cancelled, or a sibling failed)
        search.advance([_step_logprobs(o) for o in outs])
    return _output(search, params, engine.tokenizer)


async def _final_output(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    if final is None or not final.outputs or not final.outputs[0].logprobs:
        reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
        raise RuntimeError(f"beam search step {stream.request_id} ended without a token ({reason})")
    return final


def beam_search_eos_ids(ip: InputProcessor, params: BeamSearchParams) -> frozenset[int]:
    """The token ids that end a beam: the model's EOS ids, none with ``ignore_eos``."""
    if params.ignore_eos:
        return frozenset()
    return frozenset(t for t in [ip.eos_token_id, *ip.extra_eos_token_ids] if t is not None)


def beam_search_num_logprobs(beam_width: int, eos_ids: frozenset[int]) -> int:
    """Logprobs each step request asks for: the candidates a step may keep (``PromptBeamSearch.beams_to_keep``)."""
    return max(2, 1 + len(eos_ids)) * beam_width


def _step_params(ip: InputProcessor, params: BeamSearchParams, eos_ids: frozenset[int]) -> SamplingParams:
    num_logprobs = beam_search_num_logprobs(params.beam_width, eos_ids)
    if num_logprobs > ip.max_logprobs:
        raise ValueError(
            f"beam_width {params.beam_width} needs {num_logprobs} logprobs per step, more than this engine's "
            f"max_logprobs ({ip.max_logprobs})"
        )
    return SamplingParams(
        temperature=0.0,
        max_tokens=1,
        logprobs=num_logprobs,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _new_search(
    ip: InputProcessor, token_ids: list[int], params: BeamSearchParams, eos_ids: frozenset[int]
) -> PromptBeamSearch:
    if len(token_ids) + params.max_tokens > ip.max_model_len:
        raise ValueError(
            f"max_tokens {params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds "
            f"max_model_len ({ip.max_model_len})"
        )
    return PromptBeamSearch(token_ids, params.beam_width, params.max_tokens, params.length_penalty, eos_ids)


def _step_logprobs(out: RequestOutput) -> dict[int, float]:
    """The candidates of a step request's one token: token id -> log-probability."""
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def _output(search: PromptBeamSearch, params: BeamSearchParams, tokenizer: Any) -> BeamSearchOutput:
    sequences = []
    for token_ids, hyp in search.results(params.include_stop_str_in_output):
        sequences.append(
            BeamSearchSequence(
                tokens=token_ids,
                logprobs=hyp.beam.logprobs,
                cum_logprob=hyp.beam.cum_logprob,
                text=tokenizer.decode(token_ids) if tokenizer is not None else None,
                finish_reason="stop" if hyp.stop_reason is not None else "length",
                stop_reason=hyp.stop_reason,
            )
        )
    return BeamSearchOutput(sequences)


def _prompt_token_ids(ip: InputProcessor, prompt: PromptType) -> list[int]:
    if isinstance(prompt, str):
        return ip.tokenize(prompt)
    if isinstance(prompt, Mapping):
        if prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data: beam search with images is not supported yet")
        if prompt.get("prompt_token_ids") is not None:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt.get("prompt"), str):
            return ip.tokenize(prompt["prompt"])
    elif isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise ValueError(
        f"a prompt must be a string, token ids, or a dict with 'prompt' or 'prompt_token_ids': {prompt!r}"
    )
