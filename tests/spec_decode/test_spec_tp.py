"""Speculative decoding under tensor parallelism (CPU, gloo, TP=2): the drafts ride in the scheduler output every
rank gets; only rank 0 verifies them, and the workers append the emitted tokens (accepted drafts plus one) that
ride with the next launch, dropping the rejected drafts as rank 0's runner does. Greedy output equals
transformers' with drafts both accepted and rejected, with stop tokens and max_tokens inside drafts, for n-gram and
draft-model proposers, for EAGLE / EAGLE-3 heads (whole on rank 0, with whole copies of the target's
embedding and LM head) and for Medusa heads; no KV block leaks. (Speculation under pipeline parallelism: tests/distributed/test_pp_engine.py.)

One process holds one multi-rank engine at a time: the tests with an LLM of their own come first and shut it
down, then the module's n-gram LLM serves the rest (and lives until the module ends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.spec_decode.test_spec_engine import (
    MAX_NEW,
    NGRAM,
    assert_no_leaks,
    greedy,
    make_prompts,
    reference,
    stats,
)


def tp_spec_llm(path: str, spec: dict, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    return LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", speculative_config=spec, **kw)


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def assert_accepted_and_rejected(llm: LLM) -> None:
    s = stats(llm)
    assert s.spec_num_drafts > 0
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, "the test meant to accept and reject"
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens


def test_tp2_draft_model_matches_transformers(tiny_model_dirs, tiny_llama):
    """A draft model runs whole (unsharded) on rank 0, its KV cache keyed by the target's block ids. The target
    as its own draft: every greedy draft is the target's token, so all are accepted (n-gram below rejects)."""
    spec = {"model": tiny_llama, "num_speculative_tokens": 3}
    llm = tp_spec_llm(tiny_llama, spec, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        prompts = make_prompts()
        checks = check_every_step(llm)
        assert greedy(llm, prompts) == reference(tiny_llama, tuple(map(tuple, prompts)))
        s = stats(llm)
        assert 0 < s.spec_num_accepted_tokens == s.spec_num_draft_tokens
        assert checks[0] > 0
        assert_no_leaks(llm)
    finally:
        shutdown(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tp2_eagle_matches_transformers(method, tmp_path_factory):
    """An EAGLE head runs whole on rank 0 over rank 0's hidden states (full after each all-reduce), with whole
    copies of the target's vocabulary-sharded embedding and (EAGLE-1) LM head; greedy output equals
    transformers' with chunks and a prefix hit, every rank's batch equals rank 0's after each step."""
    from safetensors.torch import load_file

    from tests.spec_decode.test_eagle import PROMPTS, make_eagle_head
    from tests.spec_decode.test_eagle import reference as eagle_reference
    from tests.utils import make_tiny_model

    root = tmp_path_factory.mktemp("tp_eagle")
    target = make_tiny_model("llama", root / "llama8", num_hidden_layers=8)  # EAGLE-3 reads layers 2, 4, 5
    head = make_eagle_head(target, root / method, method)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    llm = tp_spec_llm(target, spec, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16)
    try:
        checks = check_every_step(llm)
        prompts = list(PROMPTS) + [PROMPTS[3] + (21, 22)]  # the last one hits the prefix cache
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == eagle_reference(target, tuple(prompts))
        assert stats(llm).spec_num_draft_tokens > 0 and checks[0] > 0
        assert_no_leaks(llm)
        # The head reads whole tables, the checkpoint's (rank 0's own are vocabulary shards). Its drafts are not
        # compared with a one-process run: a random head's logits are near ties that float32 sums in another
        # order may flip.
        proposer = llm.llm_engine.engine_core.proposer
        weights = load_file(str(Path(target) / "model.safetensors"))
        torch.testing.assert_close(
            proposer.embed.weight, weights["model.embed_tokens.weight"], rtol=0, atol=0
        )
        own = llm.llm_engine.engine_core.runner.runner.model.model.embed_tokens.weight
        assert own.shape[0] < proposer.embed.weight.shape[0]  # rank 0's shard
        if method == "eagle":
            lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
            torch.testing.assert_close(proposer.lm_head.weight, lm_head, rtol=0, atol=0)
        else:
            assert proposer.lm_head is None  # EAGLE-3 scores its own draft vocabulary
    finally:
        shutdown(llm)


def test_tp2_medusa_matches_transformers(tiny_llama, tmp_path):
    """Medusa heads run whole on rank 0 over rank 0's final hidden states (full after the last all-reduce); they
    keep no KV cache, so nothing else crosses ranks."""
    from tests.spec_decode.test_medusa import PROMPTS, make_medusa_heads
    from tests.spec_decode.test_medusa import reference as medusa_reference

    heads, _ = make_medusa_heads(tiny_llama, tmp_path / "medusa")
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": 3}
    llm = tp_spec_llm(tiny_llama, spec, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16)
    try:
        checks = check_every_step(llm)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == medusa_reference(tiny_llama, tuple(PROMPTS))
        assert stats(llm).spec_num_draft_tokens > 0 and checks[0] > 0
        assert_no_leaks(llm)
    finally:
        shutdown(llm)


def check_every_step(llm: LLM) -> list[int]:
    """Compare every rank's persistent batch with rank 0's after each engine step (``MultiprocRunner.check_batches``:
    the emitted tokens in, the rejected drafts out); returns a one-element counter of the checks made."""
    core = llm.llm_engine.engine_core
    step, checks = core.step, [0]

    def checked_step():
        out = step()
        core.runner.check_batches()
        checks[0] += 1
        return out

    core.step = checked_step
    return checks


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def ngram_llm(request, tiny_model_dirs):
    """One TP=2 n-gram LLM per architecture (pytest ends one before it starts the next)."""
    path = tiny_model_dirs[request.param]
    llm = tp_spec_llm(path, NGRAM)
    llm.checks = check_every_step(llm)
    llm.path = path
    yield llm
    shutdown(llm)


def test_tp2_ngram_matches_transformers(ngram_llm):
    prompts = make_prompts()
    assert greedy(ngram_llm, prompts) == reference(ngram_llm.path, tuple(map(tuple, prompts)))
    assert_accepted_and_rejected(ngram_llm)
    assert ngram_llm.checks[0] > 0
    assert_no_leaks(ngram_llm)
    # The check sees a difference: rank 0's rows still hold the finished requests until the next launch.
    batch = ngram_llm.llm_engine.engine_core.runner.runner.input_batch
    row = next(iter(batch.req_id_to_row.values()))
    batch.token_ids_np[row, 0] += 1
    try:
        with pytest.raises(RuntimeError, match="rank 1: persistent batch differs"):
            ngram_llm.llm_engine.engine_core.runner.check_batches()
    finally:
        batch.token_ids_np[row, 0] -= 1


def test_tp2_ngram_stop_token_and_max_tokens_inside_drafts(ngram_llm):
    prompts = make_prompts()
    full = reference(ngram_llm.path, tuple(map(tuple, prompts)))
    for max_tokens in (2, 13):
        assert greedy(ngram_llm, prompts, max_tokens=max_tokens) == [t[:max_tokens] for t in full]
    stop_id = full[-1][len(full[-1]) // 2]  # a token the last (repetitive) prompt's output produces midway
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_id])
    outs = ngram_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for want, out in zip(full, outs):
        comp = out.outputs[0]
        if stop_id in want:
            assert comp.token_ids == want[: want.index(stop_id) + 1]
            assert (comp.finish_reason, comp.stop_reason) == ("stop", stop_id)
        else:
            assert comp.token_ids == want and comp.finish_reason == "length"
    assert_no_leaks(ngram_llm)
