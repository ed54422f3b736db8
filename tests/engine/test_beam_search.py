"""``LLM.beam_search`` against transformers' ``generate(num_beams=...)`` (float32, CPU): the same sequences in
the same order and the same length-penalized scores, with EOS out of reach, one EOS id and two; bad input; no
leaked KV blocks."""

from __future__ import annotations

import collections
import functools
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams, PromptBeamSearch
from tests.utils import _load_hf, hf_greedy, make_tiny_model

MAX_TOKENS = 10
BLOCK_SIZE = 4


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 19)]


@pytest.fixture(scope="module")
def eos_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[int]]]:
    """EOS setup -> (checkpoint, EOS ids): "none" (EOS ignored), "one" (the tokenizer's EOS is a token the
    model often picks, so beams finish early), "two" (the tokenizer's EOS plus that token in
    generation_config.json)."""
    root = tmp_path_factory.mktemp("beam_models")
    base = make_tiny_model("llama", root / "base")
    tok = AutoTokenizer.from_pretrained(base)
    greedy = hf_greedy(base, make_prompts(len(tok)), 6)
    counts = collections.Counter(t for out in greedy for t in out)
    liked = min(counts, key=lambda t: (-counts[t], t))
    one = make_tiny_model("llama", root / "one", eos_token_id=liked)
    tok_one = AutoTokenizer.from_pretrained(one)
    tok_one.eos_token = tok_one.convert_ids_to_tokens(liked)
    tok_one.save_pretrained(one)
    _set_generation_eos(one, liked)
    two = make_tiny_model("llama", root / "two")
    _set_generation_eos(two, [tok.eos_token_id, liked])
    return {"none": (base, []), "one": (one, [liked]), "two": (two, [tok.eos_token_id, liked])}


def _set_generation_eos(path: str, eos: int | list[int]) -> None:
    gen_path = Path(path) / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = eos
    gen_path.write_text(json.dumps(gen))


@functools.cache
def make_llm(path: str, enable_prefix_caching: bool = True) -> LLM:
    return LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
    )


@functools.cache
def hf_beams(
    path: str, prompt: tuple[int, ...], beam_width: int, length_penalty: float, eos: tuple[int, ...]
) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search: (prompt + generated ids, sequence score) per returned beam, best first; a
    sequence that ended in EOS keeps it, padding is cut off."""
    model = _load_hf(path)
    model.generation_config.eos_token_id = (
        list(eos) or None
    )  # else generate() merges the checkpoint's back in
    input_ids = torch.tensor([prompt], dtype=torch.long)  # [1, prompt_len]
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            num_beams=beam_width,
            num_return_sequences=beam_width,
            length_penalty=length_penalty,
            early_stopping=False,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=list(eos) or None,
            pad_token_id=model.config.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    sequences = []
    for row in out.sequences.tolist():  # [beam_width, <= prompt_len + MAX_TOKENS]
        gen = row[len(prompt) :]
        ends = [j for j, t in enumerate(gen) if t in eos]
        sequences.append(list(prompt) + (gen[: ends[0] + 1] if ends else gen))
    return sequences, out.sequences_scores.tolist()


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("eos", ["none", "one", "two"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("beam_width", [2, 4])
def test_matches_transformers(eos_models, eos, length_penalty, beam_width):
    path, eos_ids = eos_models[eos]
    llm = make_llm(path)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    params = BeamSearchParams(
        beam_width=beam_width,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        ignore_eos=eos == "none",
        include_stop_str_in_output=True,
    )
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    num_stopped = 0
    for prompt, out in zip(prompts, outs):
        ref_seqs, ref_scores = hf_beams(path, tuple(prompt), beam_width, length_penalty, tuple(eos_ids))
        assert [s.tokens for s in out.sequences] == ref_seqs
        for seq, ref_score in zip(out.sequences, ref_scores):
            gen_len = len(seq.tokens) - len(prompt)
            assert seq.cum_logprob / gen_len**length_penalty == pytest.approx(ref_score, abs=1e-4)
            assert len(seq.logprobs) == gen_len
            chosen = sum(lps[t].logprob for lps, t in zip(seq.logprobs, seq.tokens[len(prompt) :]))
            assert seq.cum_logprob == pytest.approx(chosen, abs=1e-4)
            if seq.finish_reason == "stop":
                assert seq.tokens[-1] in eos_ids and seq.stop_reason == seq.tokens[-1]
                num_stopped += 1
            else:
                assert seq.finish_reason == "length" and gen_len == MAX_TOKENS
    if eos != "none" and length_penalty < 2.0:  # (length_penalty 2 favours the long ones that never stop)
        assert num_stopped > 0  # the EOS path was exercised
    assert_no_leaks(llm)


def test_eos_left_out_of_tokens_by_default(eos_models):
    path, eos_ids = eos_models["one"]
    llm = make_llm(path)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    kept, dropped = (
        llm.beam_search(
            [{"prompt_token_ids": p} for p in prompts],
            BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, include_stop_str_in_output=keep),
        )
        for keep in (True, False)
    )
    tokenizer = llm.get_tokenizer()
    for a, b in zip(kept, dropped):
        for sa, sb in zip(a.sequences, b.sequences):
            assert sa.cum_logprob == sb.cum_logprob
            want = sa.tokens[:-1] if sa.finish_reason == "stop" else sa.tokens
            assert sb.tokens == want and sb.text == tokenizer.decode(want)


def test_text_prompts_batch_and_prefix_cache(eos_models):
    """Text prompts give what their token ids give; one prompt alone, a batch, and no prefix caching agree;
    beams reuse each other's cached blocks."""
    path, _ = eos_models["none"]
    llm = make_llm(path)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello"]
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = llm.llm_engine.get_stats()
    batch = llm.beam_search(texts, params)
    after = llm.llm_engine.get_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert hits >= queries // 2 > 0
    ids = [llm.llm_engine.input_processor.tokenize(t) for t in texts]
    alone = [llm.beam_search([{"prompt_token_ids": p}], params)[0] for p in ids]
    uncached = make_llm(path, enable_prefix_caching=False).beam_search(texts, params)
    for b, a, u, p in zip(batch, alone, uncached, ids):
        assert (
            [s.tokens for s in b.sequences]
            == [s.tokens for s in a.sequences]
            == [s.tokens for s in u.sequences]
        )
        assert all(s.tokens[: len(p)] == p for s in b.sequences)
        for sb, sa in zip(b.sequences, a.sequences):
            assert sb.cum_logprob == pytest.approx(sa.cum_logprob, abs=1e-4)
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=2.0, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=None), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    ],
)
def test_bad_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_call_leaves_engine_untouched(eos_models):
    path, _ = eos_models["none"]
    llm = make_llm(path)
    with pytest.raises(ValueError, match="beam_width"):  # 2 * 11 logprobs > max_logprobs (20)
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=10_000))
    assert_no_leaks(llm)


def test_eos_outside_top_ranks_is_dropped():
    """With beam_width 1: an EOS candidate ranked second is dropped, not finished; ranked first, it finishes."""
    eos = 9
    search = PromptBeamSearch(
        [1, 2], beam_width=1, max_tokens=5, length_penalty=1.0, eos_token_ids=frozenset({eos})
    )
    search.advance([{5: -0.1, eos: -0.5, 6: -3.0}])
    assert not search.finished and [b.token_ids for b in search.beams] == [[5]]
    search.advance([{eos: -0.2, 7: -0.3, 8: -4.0}])
    assert [h.beam.token_ids for h in search.finished] == [[5, eos]]
    assert search.finished[0].score == pytest.approx((-0.1 - 0.2) / 2)
    # The live beam [5, 7] scores -0.4 / 2 = -0.2 at best, below the finished -0.15: the search is done.
    assert search.is_done
