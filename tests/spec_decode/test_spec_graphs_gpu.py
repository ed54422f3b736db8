"""Speculative decoding that reads the target's hidden states, on CUDA graphs (GPU): the target's verification steps
(k + 1 tokens a request) and pure decodes replay decode graphs whose static outputs hold the hidden states (and
EAGLE-3's auxiliary ones), mixed steps replay piecewise graphs, and the EAGLE / MTP head's draft steps replay graphs
of their own. Greedy output (float32: a difference would be a wrong token, not rounding) equals the eager engine's
(enforce_eager=True) and plain decoding's; the graphs were replayed."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.demo import DEMO_MODEL_DIR, demo_eagle_head
from pagedllm.spec_decode.head_graphs import speculation_graphs_summary
from tests.models.test_deepseek import make_tiny_deepseek
from tests.spec_decode.test_eagle import make_eagle_head
from tests.spec_decode.test_medusa import make_medusa_heads
from tests.spec_decode.test_mtp import V3, add_mtp_layer
from tests.utils import make_tiny_model

pytestmark = pytest.mark.gpu

# Batch sizes 1..8 and piecewise sizes 16..64: a short capture, and every path (padded verification batches,
# mixed prefill chunks and verification, batches above none) within reach of five prompts.
KW = dict(
    dtype="float32",
    device="cuda",
    block_size=16,
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    kv_cache_memory_bytes=64 * 2**20,
)
PROMPTS = [
    [5, 9, 31, 7, 100],
    list(range(40, 97)),
    [7, 8, 9, 10] * 8,
    [11, 12, 13, 14, 15, 16, 17, 18, 3, 4],
    list(range(200, 233)),
]


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> str:
    """EAGLE-3 reads target layers 2, L/2 and L-3: a target of 8 layers."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("deep") / "llama8", num_hidden_layers=8)


def _generate(
    llm: LLM, prompts: list[list[int]], max_tokens: int = 40, penalty: bool = True
) -> list[list[int]]:
    """Greedy tokens; requests of different lengths, so that batches shrink and verification mixes with the
    prefill chunks of the requests behind. With ``penalty``, the first, the longest, has a repetition penalty: it
    never speculates, so its rows join verification steps one token long, and it ends alone in pure decodes."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens - 5 * i, ignore_eos=True) for i in range(5)
    ]
    if penalty:
        params[0] = SamplingParams(
            temperature=0.0, max_tokens=max_tokens + 6, ignore_eos=True, repetition_penalty=1.3
        )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params[: len(prompts)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check_graphs(llm: LLM, method: str, verification: bool = True, head: bool = True) -> None:
    core = llm.llm_engine.engine_core
    runner, proposer = core.runner, core.proposer
    graphs = runner.graph_runner
    assert graphs is not None
    if verification:
        assert graphs.q > 1 and sum(c for (_, q), c in graphs.num_replays.items() if q == graphs.q) > 0
        assert runner.piecewise is not None and sum(runner.piecewise.num_replays.values()) > 0
    else:  # MLA: pure decodes only
        assert sum(c for (_, q), c in graphs.num_replays.items() if q == 1) > 0
    if head:
        assert proposer.step_graphs is not None and sum(proposer.step_graphs.num_replays.values()) > 0
        if verification:  # (MLA: the catch-up runs eagerly)
            assert sum(proposer.catch_up_graphs.num_replays.values()) > 0
    line = speculation_graphs_summary(
        method, runner, getattr(proposer, "step_graphs", None), getattr(proposer, "catch_up_graphs", None)
    )
    assert ("draft head's steps replay CUDA graphs" in line) == head
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_drafts > 0
    core.check_integrity()


def _compare(target: str, spec: dict, prompts: list[list[int]], max_tokens: int = 40, **kw) -> LLM:
    plain = _generate(LLM(target, **(KW | kw)), prompts, max_tokens)
    eager = _generate(
        LLM(target, speculative_config=spec, enforce_eager=True, **(KW | kw)), prompts, max_tokens
    )
    graphed = LLM(target, speculative_config=spec, **(KW | kw))
    got = _generate(graphed, prompts, max_tokens)
    assert got == eager
    assert got == plain
    return graphed


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_on_graphs_matches_eager_and_plain(deep_llama, tmp_path, method):
    head = make_eagle_head(deep_llama, tmp_path / method, method)
    llm = _compare(deep_llama, {"method": method, "model": head, "num_speculative_tokens": 3}, PROMPTS)
    _check_graphs(llm, method)


def test_medusa_on_graphs_matches_eager_and_plain(deep_llama, tmp_path):
    heads, _ = make_medusa_heads(deep_llama, tmp_path / "medusa")
    llm = _compare(deep_llama, {"method": "medusa", "model": heads, "num_speculative_tokens": 3}, PROMPTS)
    _check_graphs(llm, "medusa", head=False)
    heads = llm.llm_engine.engine_core.proposer.head_graphs  # the heads' pass, by padded batch size
    assert sum(heads.num_replays.values()) > 0
    assert "the heads replay CUDA graphs" in llm.llm_engine.engine_core.proposer.graphs_summary


def test_mtp_on_graphs_matches_eager_and_plain(tmp_path):
    path = make_tiny_deepseek("DeepseekV3Config", tmp_path / "v3", 41, num_nextn_predict_layers=1, **V3)
    add_mtp_layer(path, seed=51)
    prompts = [[t % 60 + 3 for t in p] for p in PROMPTS]
    llm = _compare(path, {"method": "mtp", "num_speculative_tokens": 3}, prompts, max_tokens=24)
    _check_graphs(llm, "mtp", verification=False)


def test_demo_model_with_its_eagle_head_on_graphs():
    """The bundled demo and its trained EAGLE head (what ``pagedllm bench latency --speculative-config
    '{"method":"eagle","model":"pagedllm/demo_model/eagle","num_speculative_tokens":3}'`` runs): graphs for
    the target and the head, the eager engine's tokens, drafts accepted."""
    spec = {"method": "eagle", "model": demo_eagle_head(), "num_speculative_tokens": 3}
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    llm = _compare(str(DEMO_MODEL_DIR), spec, prompts)
    _check_graphs(llm, "eagle")
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    summary = (
        llm.llm_engine.engine_core.proposer.graphs_summary
    )  # logged at start-up, printed by bench latency
    assert "verification steps (4 tokens a request) replay CUDA graphs" in summary
    assert "catch-up after verification replays" in summary and "draft head's steps replay" in summary


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_demo_drafts_queued_on_the_device_equal_the_host_path(method, async_scheduling):
    """On real graphs, the proposals queued on the device right after sampling (the runner's after_spec_sample
    hook) give the drafts the host path gives: the same acceptance counts, the same tokens as plain decoding.
    Every request speculates (no penalty), so that verification steps where all of them verified k drafts, the
    ones the hook queues proposals after, come."""
    spec = {"method": method, "model": str(DEMO_MODEL_DIR / method), "num_speculative_tokens": 3}
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    plain = _generate(LLM(str(DEMO_MODEL_DIR), **KW), prompts, penalty=False)
    runs = {}
    for on_device in (False, True):
        llm = LLM(str(DEMO_MODEL_DIR), speculative_config=spec, async_scheduling=async_scheduling, **KW)
        core = llm.llm_engine.engine_core
        core.spec_ahead = False  # (a launch ahead does not cut drafts at max_tokens: other counts)
        if not on_device:
            core.runner.after_spec_sample = None
        assert _generate(llm, prompts, penalty=False) == plain
        stats = llm.llm_engine.get_stats()
        runs[on_device] = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        assert (core.proposer.num_device_proposals > 0) == on_device
        core.check_integrity()
    assert runs[True] == runs[False] and runs[True][1] > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_demo_async_launches_ahead_on_graphs(method):
    """Async speculation launched ahead of the host on real graphs: the verification graph's static inputs are
    filled as if every draft in flight were accepted, and the device moves them back over the rejected ones and
    feeds the queued drafts. Plain decoding's tokens for four requests of uneven lengths and for one alone, most
    launches ahead, no block leaks."""
    spec = {"method": method, "model": str(DEMO_MODEL_DIR / method), "num_speculative_tokens": 3}
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    plain = _generate(LLM(str(DEMO_MODEL_DIR), **KW), prompts, penalty=False)
    llm = LLM(str(DEMO_MODEL_DIR), speculative_config=spec, async_scheduling=True, **KW)
    core = llm.llm_engine.engine_core
    assert _generate(llm, prompts, penalty=False) == plain
    assert _generate(llm, prompts[:1], penalty=False) == plain[:1]
    assert core.num_spec_launches_ahead > core.num_spec_launches / 2
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_demo_draft_model_steps_on_graphs_equal_its_passes(async_scheduling):
    """The demo draft model's steps 2..k replay its step graphs after the catch-up pass: the drafts of the
    pass-by-pass runner (acceptance counts), plain decoding's tokens."""
    spec = {"model": str(DEMO_MODEL_DIR / "draft"), "num_speculative_tokens": 4}
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    plain = _generate(LLM(str(DEMO_MODEL_DIR), **KW), prompts)
    runs = {}
    for graphs in (False, True):
        llm = LLM(str(DEMO_MODEL_DIR), speculative_config=spec, async_scheduling=async_scheduling, **KW)
        proposer = llm.llm_engine.engine_core.proposer
        assert proposer.step_graphs is not None
        if not graphs:
            proposer.step_graphs = None
        assert _generate(llm, prompts) == plain
        stats = llm.llm_engine.get_stats()
        runs[graphs] = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        if graphs:
            assert sum(proposer.step_graphs.num_replays.values()) > 0
        llm.llm_engine.engine_core.check_integrity()
    assert runs[True] == runs[False] and runs[True][1] > 0
