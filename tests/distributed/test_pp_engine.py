"""Pipeline parallelism on CPU (gloo): ``LLM(..., pipeline_parallel_size=2)`` splits the decoder layers over two
stages (one worker process), each stage holding only its layers' weights and KV cache. Greedy output equals
transformers' for every tiny architecture (the MoE families and DeepSeek: tests/distributed/test_tp_pp_families.py),
and with chunked prefill, prefix hits, preemption, logprobs, prompt logprobs and a grammar bitmask that
has to reach the last stage; PP=2 x TP=2 (four ranks) too; bad combinations fail at start-up."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.distributed import PPGroup, pp_layer_partition
from tests.utils import (
    TINY_ARCHS,
    assert_greedy_and_logprobs_match_hf,
    hf_greedy,
    hf_logprobs,
    make_tiny_model,
)

MAX_NEW = 8


def pp_llm(path: str, pp: int = 2, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM(path, pipeline_parallel_size=pp, **kw)


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def greedy_ids(
    llm: LLM, prompts: list[list[int]], max_tokens_override: int | None = None, **kw
) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens_override or MAX_NEW, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama3l(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama with 3 layers (stages of 2 + 1) and a tied LM head (the last stage keeps the embedding)."""
    path = tmp_path_factory.mktemp("pp") / "llama3l"
    return make_tiny_model("llama", path, num_hidden_layers=3, tie_word_embeddings=True)


# --- no processes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layers, pp, expected",
    [
        (2, 2, (1, 1)),
        (3, 2, (2, 1)),
        (4, 3, (1, 2, 1)),
        (5, 3, (2, 2, 1)),
        (32, 4, (8, 8, 8, 8)),
        (7, 1, (7,)),
    ],
)
def test_layer_partition_is_vllms(layers, pp, expected):
    assert pp_layer_partition(layers, pp) == expected
    starts = [PPGroup(r, pp, expected).layer_range(layers) for r in range(pp)]
    assert starts[0][0] == 0 and starts[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(starts, starts[1:]))


def test_layer_partition_override_and_errors():
    assert pp_layer_partition(20, 4, "4,6,6,4") == (4, 6, 6, 4)
    for bad in ("5,5,5", "5,5,5,a", "5,5,5,5,", "20,0,0,0", "6,5,5,5"):
        with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
            pp_layer_partition(20, 4, bad)
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size \(3\) must not exceed .*num_hidden_layers \(2\)"
    ):
        pp_layer_partition(2, 3)


@torch.inference_mode()
def _stage_logits(path: str, pp_size: int) -> tuple[torch.Tensor, list[set[str]]]:
    """Logits of a ragged prefill of ``prompts_for`` through ``pp_size`` stage models run one after another in this
    process (activations handed on in memory), and each stage's parameter names."""
    from pagedllm.attention.torch_ref import TorchAttentionBackend
    from pagedllm.config import ModelConfig
    from pagedllm.model_loader import get_model
    from tests.distributed.workers import BLOCK_SIZE, _metadata, prompts_for

    mc = ModelConfig(model=path, dtype="float32")
    prompts = prompts_for(mc.vocab_size)
    lens = [len(p) for p in prompts]
    ids = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = _metadata(lens, lens, 8)
    out, names = None, []
    for rank in range(pp_size):
        pp = PPGroup(rank, pp_size)
        model = get_model(mc, torch.device("cpu"), TorchAttentionBackend(), pp=pp if pp_size > 1 else None)
        names.append({n for n, _ in model.named_parameters()})
        start, end = pp.layer_range(mc.num_layers)
        caches = [torch.zeros(2, 16, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim) for _ in range(end - start)]
        out = model(ids, positions, caches, meta, out) if rank else model(ids, positions, caches, meta)
    return model.compute_logits(out), names


@pytest.mark.parametrize("arch", [*TINY_ARCHS, "llama3l"])
def test_stages_own_their_modules_and_chain_to_the_whole_model(tiny_model_dirs, llama3l, arch):
    path = llama3l if arch == "llama3l" else tiny_model_dirs[arch]
    whole, (all_names,) = _stage_logits(path, 1)
    logits, (first, last) = _stage_logits(path, 2)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    split = 2 if arch == "llama3l" else 1  # stage 0's layers are [0, split)

    def layer(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if parts[:2] == ["model", "layers"] else None

    assert {layer(n) for n in first} - {None} == set(range(split))
    assert {layer(n) for n in last} - {None} == set(range(split, 3 if arch == "llama3l" else 2))
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    assert "model.norm.weight" in last and not any(n.startswith("lm_head") for n in first)
    tied = arch in ("llama3l", "gemma", "gemma2", "gemma3")
    assert ("model.embed_tokens.weight" in last) == tied  # a tied head reads the embedding on the last stage
    assert first | last == all_names  # every weight on exactly the stages that need it


def test_each_stage_allocates_kv_cache_for_its_layers_only(llama3l):
    from pagedllm.config import make_engine_config
    from pagedllm.worker.model_runner import ModelRunner

    config = make_engine_config(
        llama3l, device="cpu", dtype="float32", pipeline_parallel_size=2, block_size=4
    )
    assert config.parallel_config.pp_layer_partition == (2, 1)
    whole = ModelRunner(make_engine_config(llama3l, device="cpu", dtype="float32", block_size=4))
    runners = [ModelRunner(config, pp=PPGroup(r, 2, (2, 1))) for r in range(2)]
    for runner, num_layers in zip(runners, (2, 1)):
        runner.init_kv_cache(5)
        assert len(runner.kv_caches) == num_layers
        assert runner.kv_block_bytes() * 3 == whole.kv_block_bytes() * num_layers


def test_pp_flag_reaches_the_engine_config(llama3l, monkeypatch):
    from pagedllm.config import make_engine_config
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", llama3l, "--device", "cpu", "-pp", "3", "-tp", "2"])
    config = make_engine_config(llama3l, **engine_kwargs_from_args(args))
    pc = config.parallel_config
    assert (pc.pipeline_parallel_size, pc.tensor_parallel_size, pc.world_size) == (3, 2, 6)
    assert pc.pp_layer_partition == (1, 1, 1) and not config.scheduler_config.async_scheduling
    assert parser.parse_args(["--pipeline-parallel-size", "2"]).pipeline_parallel_size == 2
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    config = make_engine_config(llama3l, device="cpu", pipeline_parallel_size=2)
    assert config.parallel_config.pp_layer_partition == (1, 2)


@pytest.mark.parametrize(
    "arch, kw, field",
    [
        ("llama", {"pipeline_parallel_size": 3}, r"pipeline_parallel_size \(3\) must not exceed"),
        ("llama", {"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1"),
        (
            "llama",
            {"pipeline_parallel_size": 2, "data_parallel_size": 2},
            "data_parallel_size > 1 with pipeline",
        ),
        (  # asked for, not silently dropped (left unset, a PP engine schedules synchronously)
            "llama",
            {"pipeline_parallel_size": 2, "async_scheduling": True},
            r"async_scheduling=True with pipeline_parallel_size > 1",
        ),
    ],
)
def test_bad_pipeline_configs_fail_at_startup(tiny_model_dirs, arch, kw, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model_dirs[arch], device="cpu", **kw)


def test_an_architecture_without_stages_is_refused_naming_the_field():
    from types import SimpleNamespace

    from pagedllm.distributed.parallel_state import verify_pp_config

    config = SimpleNamespace(architectures=["FooForCausalLM"], num_hidden_layers=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported for FooForCausalLM"):
        verify_pp_config(config, 2)
    verify_pp_config(config, 1)  # one stage needs nothing from the model


def test_bad_partition_env_fails_at_startup(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,0")
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
        LLM(tiny_llama, device="cpu", pipeline_parallel_size=2)


# --- the engine over worker processes ---------------------------------------------------------------------------
# (LLMs of their own first: one process holds one multi-rank engine at a time, and the fixture's lives on.)
def test_pp2_qwen3_greedy_then_a_dead_worker_fails_the_next_step(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    llm = pp_llm(path)
    try:
        prompts = [[5, 6, 7, 8], list(range(30, 52)), [200, 3]]
        assert greedy_ids(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
        llm.llm_engine.engine_core.check_integrity()
        worker = llm.llm_engine.engine_core.runner.workers[0]  # the last stage: the sampler
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            greedy_ids(llm, [[5, 6, 7]])
        assert time.monotonic() - start < 10
    finally:
        shutdown(llm)


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "qwen3"])  # (qwen3: the test above)
def test_pp2_greedy_matches_transformers(tiny_model_dirs, arch):
    """Every tiny architecture, with a prompt longer than the sliding windows of those that have one (Gemma 2/3's
    hybrid layers included: a pipeline stage keeps every block of them)."""
    path = tiny_model_dirs[arch]
    llm = pp_llm(path)
    try:
        prompts = [[5, 6, 7, 8], list(range(30, 70)), [200, 3]]
        assert greedy_ids(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        shutdown(llm)


def test_pp2_tp2_greedy_matches_transformers(llama3l):
    """Four ranks: stage s, TP rank t is global rank 2 * s + t; each TP rank sends to its peer of the next stage."""
    llm = pp_llm(llama3l, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        prompts = [[5, 6, 7, 8], list(range(30, 70)), [200, 3]]
        assert greedy_ids(llm, prompts) == hf_greedy(llama3l, prompts, MAX_NEW)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        shutdown(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_pp2_speculative_decoding_matches_transformers(llama3l, proposer):
    """Drafts ride the broadcast step to every stage; the last stage computes the verification logits and verifies,
    and every other rank appends the emitted tokens (accepted drafts plus one) with the next launch. n-gram drafts
    are accepted and rejected; the target as its own draft model (whole on rank 0) has every draft accepted."""
    from tests.spec_decode.test_spec_engine import NGRAM, make_prompts

    spec = NGRAM if proposer == "ngram" else {"model": llama3l, "num_speculative_tokens": 3}
    llm = pp_llm(llama3l, speculative_config=spec, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        core = llm.llm_engine.engine_core
        step = core.step

        def checked_step():  # every rank's batch equals rank 0's after each step
            out = step()
            core.runner.check_batches()
            return out

        core.step = checked_step
        prompts = make_prompts()
        assert greedy_ids(llm, prompts, max_tokens_override=24) == hf_greedy(llama3l, prompts, 24)
        s = llm.llm_engine.get_stats()
        if proposer == "ngram":
            assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
        else:
            assert 0 < s.spec_num_accepted_tokens == s.spec_num_draft_tokens
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llama8l(tmp_path_factory: pytest.TempPathFactory) -> str:
    """EAGLE-3 reads target layers 2, 4 and 5 of 8: three stages of (3, 3, 2) layers hold one, two and none."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("pp8") / "llama8l", num_hidden_layers=8)


@pytest.mark.parametrize(
    "method, tp, pp", [("eagle", 1, 2), ("medusa", 1, 2), ("eagle", 2, 2), ("eagle3", 1, 3)]
)
def test_pp_eagle_medusa_draft_as_in_one_process(llama3l, llama8l, tmp_path, method, tp, pp):
    """An EAGLE head (whole copies of the target's embedding and LM head) or Medusa heads run on rank 0 over the
    last stage's final hidden states, which the sampler sends after each step; EAGLE-3's states of layers 2, 4 and
    5 ride to the last stage with the activations, each stage adding its own. Greedy output equals transformers'
    (chunked prefills, a prefix hit) and the drafts are the one-process engine's (the same acceptance counts: each
    stage computes its layers as one process does, and the hidden states cross as bytes). Under TP=2 too (the
    sampler's hidden states are whole after the all-reduce: transformers' output). With EAGLE, a grammar-constrained
    and a seeded request beside greedy ones give the one-process texts. Every rank's batch equals rank 0's after
    each step; no block leaks."""
    from tests.spec_decode.test_eagle import PROMPTS, make_eagle_head
    from tests.spec_decode.test_medusa import make_medusa_heads
    from tests.spec_decode.test_spec_tp import check_every_step

    target = llama8l if method == "eagle3" else llama3l
    if method in ("eagle", "eagle3"):
        head = make_eagle_head(target, tmp_path / method, method)
    else:
        head, _ = make_medusa_heads(target, tmp_path / "medusa")
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    prompts = [list(p) for p in PROMPTS] + [list(PROMPTS[3]) + [21, 22]]  # the last one hits the prefix cache
    kw = dict(speculative_config=spec, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16)
    one = pp_llm(target, pp=1, **kw)
    recorded_one = record_drafts(one)
    expected = greedy_ids(one, prompts, max_tokens_override=24)
    drafts_one, s1 = list(recorded_one), one.llm_engine.get_stats()
    mixed = method == "eagle" and tp == 1  # also a constrained and a seeded request beside greedy ones
    mixed_expected = _mixed_texts(one) if mixed else None
    shutdown(one)
    llm = pp_llm(target, pp=pp, tensor_parallel_size=tp, **kw)
    try:
        core = llm.llm_engine.engine_core
        drafts = record_drafts(llm)
        checks = check_every_step(llm)
        assert greedy_ids(llm, prompts, max_tokens_override=24) == expected == hf_greedy(target, prompts, 24)
        assert checks[0] > 0
        if pp == 3:
            assert llm.llm_engine.engine_core.config.parallel_config.pp_layer_partition == (3, 3, 2)
        s = llm.llm_engine.get_stats()
        assert s.spec_num_draft_tokens > 0 and any(d for step_drafts in drafts for _, d in step_drafts)
        if tp == 1:  # (under TP the all-reduced sums round otherwise: a random head's near ties may flip)
            assert drafts == drafts_one
            assert (s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (
                s1.spec_num_draft_tokens,
                s1.spec_num_accepted_tokens,
            )
        if mixed:
            texts = _mixed_texts(llm)
            assert texts == mixed_expected and texts[0] in CHOICES
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        shutdown(llm)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_pp_head_speculation_with_preemption(llama3l, tmp_path, method):
    """An EAGLE head or Medusa heads under PP=2 in a pool small enough to preempt requests whose drafts are being
    verified (the heads read the hidden states rank 0 received; a preempted request restarts from nothing and
    gets drafts again once it decodes): greedy output equals transformers', preemptions happened, no block leaks."""
    from tests.spec_decode.test_eagle import PROMPTS, make_eagle_head
    from tests.spec_decode.test_medusa import make_medusa_heads

    if method == "eagle":
        head = make_eagle_head(llama3l, tmp_path / method, method)
    else:
        head, _ = make_medusa_heads(llama3l, tmp_path / method)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    prompts = [list(p) for p in PROMPTS] + [list(p)[::-1] for p in PROMPTS]
    llm = pp_llm(llama3l, speculative_config=spec, max_model_len=64, max_num_seqs=8, num_gpu_blocks_override=24)
    try:
        assert greedy_ids(llm, prompts, max_tokens_override=24) == hf_greedy(llama3l, prompts, 24)
        s = llm.llm_engine.get_stats()
        assert s.num_preemptions > 0, "the small pool was meant to preempt"
        assert s.spec_num_draft_tokens > 0
        core = llm.llm_engine.engine_core
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        shutdown(llm)


CHOICES = ["alpha beta", "gamma"]


def _mixed_texts(llm: LLM) -> list[str]:
    """A grammar-constrained request (its bitmask per draft position), a seeded random one and two greedy ones
    in one batch: their texts."""
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = ["pick one", "the quick brown fox", "once upon a time", "hello"]
    outs = llm.generate(prompts, [constrained, greedy, seeded, greedy], use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def record_drafts(llm: LLM) -> list[list[tuple[str, list[int]]]]:
    """After each proposal, every running request's drafts (request id, token ids), in a list filled as it runs."""
    core = llm.llm_engine.engine_core
    propose, record = core.proposer.propose, []

    def recorded(requests, *args, **kwargs):
        propose(requests, *args, **kwargs)
        record.append([(r.request_id, list(r.spec_token_ids or ())) for r in requests])

    core.proposer.propose = recorded
    return record


@pytest.fixture(scope="module")
def llama_pp2(llama3l):
    """PP=2 over the 3-layer tied llama, with a small pool and token budget: chunks, prefix hits, preemption."""
    llm = pp_llm(llama3l, max_num_batched_tokens=8, num_gpu_blocks_override=20, max_model_len=64)
    yield llm
    shutdown(llm)


def test_pp2_greedy_chunks_prefix_hits_preemption_and_logprobs(llama_pp2, llama3l):
    llm = llama_pp2
    core = llm.llm_engine.engine_core
    assert len(core.runner.runner.kv_caches) == 2  # rank 0 is stage 0: layers 0 and 1
    shared = list(range(40, 76))
    prompts = [shared + [5, 6, 7], list(range(100, 141)), shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_and_logprobs_match_hf(outs, llama3l, prompts, MAX_NEW)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # Prompt logprobs come from the last stage, chunk by chunk (prompt_logprobs requests skip the prefix cache).
    prompt = prompts[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ref = hf_logprobs(llama3l, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1][prompt[j]].item()) < 1e-4
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_pp2_seeded_sampling_repeats_and_n(llama_pp2):
    """The last stage samples with each request's generator: a seed gives the same tokens twice."""
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    first = llama_pp2.generate("hello hello", params, use_tqdm=False)[0].outputs
    again = llama_pp2.generate("hello hello", params, use_tqdm=False)[0].outputs
    assert len(first) == 2 and all(len(c.token_ids) == 6 for c in first)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    llama_pp2.llm_engine.engine_core.check_integrity()


def test_pp2_grammar_bitmask_reaches_the_last_stage(llama_pp2):
    choices = ["yes", "no", "maybe so"]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outs = llama_pp2.generate(["Answer:", "Well"], params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
