"""CUDA graphs for speculative decoding that reads the target's hidden states (EAGLE, EAGLE-3, MTP, Medusa): on CPU,
the host plan of the draft steps, the graphs' output slicing, and whole engines whose graphs are stand-ins that
run the forward again at each replay (``EagerGraph``): the runners' staging, padding and slicing, and the
proposers' chained draft steps, give the eager engine's drafts and the plain engine's tokens. The GPU tests (real
graphs) are in test_spec_graphs_gpu.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import Attention
from pagedllm.spec_decode.head_graphs import draft_step_plan, speculation_graphs_summary
from pagedllm.tokenizer import get_tokenizer
from pagedllm.worker.graph_io import EagerGraph, copy_output, final_hidden, slice_rows
from pagedllm.worker.piecewise_graphs import PiecewiseGraphRunner
from tests.engine.test_piecewise_graphs import _EagerPieces, _graph_cls, _Log
from tests.models.test_deepseek import make_tiny_deepseek
from tests.spec_decode.test_eagle import make_eagle_head
from tests.spec_decode.test_medusa import make_medusa_heads
from tests.spec_decode.test_mtp import V3, add_mtp_layer
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> str:
    """EAGLE-3 reads target layers 2, L/2 and L-3: a target of 8 layers."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("deep") / "llama8", num_hidden_layers=8)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3 with a random MTP layer."""
    path = make_tiny_deepseek(
        "DeepseekV3Config", tmp_path_factory.mktemp("mtp") / "v3", 41, num_nextn_predict_layers=1, **V3
    )
    return add_mtp_layer(path, seed=51)


# ---------------------------------------------------------------------------------------------------- plan


def test_draft_step_plan_rests_requests_that_need_no_more_drafts():
    """Step j runs a request at last_pos + j while it needs a draft after step j's; otherwise (and on padding
    rows) position 0, context 1, slot -1."""
    last_pos = np.array([5, 9, 2])
    num_drafts = np.array([3, 1, 2])  # steps: request 0 runs 2, request 1 none, request 2 one
    table = np.array([[7, 3, 0], [4, 8, 6], [2, 0, 0]], dtype=np.int32)
    plan = draft_step_plan(last_pos, num_drafts, table, block_size=4, rows=4)
    assert plan.num_reqs == 3 and plan.positions.shape == (2, 4)
    assert plan.positions.tolist() == [[5, 0, 2, 0], [6, 0, 0, 0]]
    assert plan.seq_lens.tolist() == [[6, 1, 3, 1], [7, 1, 1, 1]]
    # position 5 -> block 1 (id 3), offset 1; position 2 -> block 0 (id 2), offset 2
    assert plan.slot_mapping.tolist() == [[13, -1, 10, -1], [14, -1, -1, -1]]
    assert plan.block_table.shape == (4, 3) and plan.block_table[3].tolist() == [0, 0, 0]
    assert plan.block_table[:3].tolist() == table.tolist()


def test_draft_step_plan_defaults_and_a_fixed_step_count():
    plan = draft_step_plan(np.array([0]), np.array([4]), np.array([[5, 6]], dtype=np.int32), block_size=2)
    assert plan.positions.tolist() == [[0], [1], [2]]  # k - 1 steps, no padding
    assert plan.slot_mapping.tolist() == [[10], [11], [12]]
    plan = draft_step_plan(np.array([3]), np.array([1]), np.zeros((1, 1), dtype=np.int32), 4, steps=2)
    assert (plan.slot_mapping == -1).all() and (plan.seq_lens == 1).all()  # one draft: every step rests


# ---------------------------------------------------------------------------------------------------- outputs


def test_outputs_slice_and_copy_as_tensors_or_tuples():
    hidden, aux = torch.arange(12.0).view(4, 3), torch.arange(24.0).view(4, 6)
    assert slice_rows(hidden, 2).shape == (2, 3)
    h, a = slice_rows((hidden, aux), 3)
    assert h.shape == (3, 3) and a.shape == (3, 6) and a.data_ptr() == aux.data_ptr()
    assert slice_rows(None, 3) is None
    assert final_hidden((hidden, aux)) is hidden and final_hidden(hidden) is hidden
    dst = (torch.zeros(4, 3), torch.zeros(4, 6))
    copy_output(dst, (hidden, aux))
    assert torch.equal(dst[0], hidden) and torch.equal(dst[1], aux)
    calls = []
    graph = EagerGraph(lambda: calls.append(1) or (hidden * len(calls), aux))
    first = graph.output[0]
    graph.replay()  # the replay rewrites the capture's output buffers in place
    assert graph.output[0] is first and torch.equal(first, hidden * 2)


def test_piecewise_capture_keeps_every_output_of_the_forward(deep_llama, tmp_path):
    """An EAGLE-3 target returns (final hidden, aux hidden): the last piece's outputs are both kept."""
    head = make_eagle_head(deep_llama, tmp_path / "e3", "eagle3")
    llm = _llm(deep_llama, {"method": "eagle3", "model": head, "num_speculative_tokens": 2})
    runner = llm.llm_engine.engine_core.runner
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    pw = PiecewiseGraphRunner(
        runner.model, runner.kv_caches, [16, 32], runner.device, graph_cls=_graph_cls(_Log())
    )
    assert pw.capture(len(layers))
    h = runner.config.model_config.hf_config.hidden_size
    for size in (16, 32):
        out = pw.pieces[size].output
        assert isinstance(out, tuple) and out[0].shape == (size, h) and out[1].shape == (size, 3 * h)


# ---------------------------------------------------------------------------------------------------- engines

KW = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, max_num_seqs=8)
PROMPTS = [[5, 9, 31, 7, 100], list(range(40, 57)), [7, 8, 9, 10] * 5, [11, 12, 13, 14, 15, 16, 17, 18, 3, 4]]


def _llm(target: str, spec: dict | None, **kw) -> LLM:
    return LLM(target, speculative_config=spec, **(KW | kw))


def install_stand_in_graphs(llm: LLM, piecewise: bool = True) -> None:
    """Give a CPU engine the graphs a GPU engine captures, as ``EagerGraph`` stand-ins: the target's decode
    graphs (verification steps of k + 1 tokens a request, except under MLA), its piecewise graphs (replayed as
    whole forwards over the staged buffers) and the draft head's step graphs."""
    core = llm.llm_engine.engine_core
    runner, proposer = core.runner, core.proposer
    runner._capture_decode_graphs()  # CudaGraphRunner.capture makes stand-ins where there is no GPU
    if piecewise and not runner._is_mla():
        layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
        pw = _EagerPieces(
            runner.model, runner.kv_caches, [16, 32], runner.device, graph_cls=_graph_cls(_Log())
        )
        assert pw.capture(len(layers))
        runner.piecewise = pw
    if hasattr(proposer, "capture_head_graphs"):
        proposer.capture_head_graphs()  # as at start-up, now that the target has decode graphs


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Greedy tokens; requests of different lengths. The first, the longest, has a repetition penalty: it never
    speculates, so its rows join verification steps one token long, and it ends alone in pure decodes."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens - 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[0] = SamplingParams(
        temperature=0.0, max_tokens=max_tokens + 6, ignore_eos=True, repetition_penalty=1.3
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _drafts(llm: LLM) -> tuple[int, int]:
    s = llm.llm_engine.get_stats()
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def _check_graphs_used(llm: LLM, verification: bool = True, head: bool = True) -> None:
    core = llm.llm_engine.engine_core
    graphs = core.runner.graph_runner
    assert sum(c for (_, q), c in graphs.num_replays.items() if q == 1) > 0
    if verification:
        assert sum(c for (_, q), c in graphs.num_replays.items() if q == graphs.q > 1) > 0
    if head:
        assert sum(core.proposer.step_graphs.num_replays.values()) > 0
        if verification:  # (MLA: the catch-up runs eagerly)
            assert sum(core.proposer.catch_up_graphs.num_replays.values()) > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_with_stand_in_graphs_matches_eager_and_plain(deep_llama, tmp_path, method):
    """Verification steps through the decode graphs (the target's hidden rows, and EAGLE-3's aux rows, sliced
    from the static outputs), mixed steps through the piecewise runner, drafts 2..k through the head's step
    graphs (a batch of 4 padded to 4, of 3 to 4, ...): the same drafts as the eager engine (acceptance counts),
    the same tokens as plain decoding."""
    head = make_eagle_head(deep_llama, tmp_path / method, method)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    plain = _generate(_llm(deep_llama, None), PROMPTS)
    eager = _llm(deep_llama, spec)
    want = _generate(eager, PROMPTS)
    graphed = _llm(deep_llama, spec, max_num_batched_tokens=32)
    install_stand_in_graphs(graphed)
    got = _generate(graphed, PROMPTS)
    assert got == want == plain
    assert _drafts(graphed) == _drafts(eager) and _drafts(graphed)[0] > 0
    _check_graphs_used(graphed)
    assert sum(graphed.llm_engine.engine_core.runner.piecewise.num_replays.values()) > 0
    graphed.llm_engine.engine_core.check_integrity()


DEMO = "pagedllm/demo_model"
CODE = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nfor i in range(10):\n"


@pytest.mark.parametrize("head", ["demo-eagle", "eagle3", "demo-medusa"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_head_drafts_on_the_device_after_verification(deep_llama, tmp_path, head, async_scheduling):
    """Every request speculating: after each verification step through the target's multi-token graph, the head's
    catch-up (over all k + 1 positions) and draft steps are queued on the device behind the sampling, planned
    there from the accepted counts. The same drafts as the host's proposals (acceptance counts), the same tokens
    as plain decoding; requests near max_tokens and max_model_len get their drafts cut as on the host. The demo
    target and its trained EAGLE head accept drafts (every accepted count is exercised); a random EAGLE-3 head
    accepts none, through the other head layout. Medusa's heads read each request's last kept row, queued the
    same way (the demo target's trained heads)."""
    if head.startswith("demo-"):
        method = head[len("demo-") :]
        target, spec = DEMO, {"method": method, "model": f"{DEMO}/{method}", "num_speculative_tokens": 3}
        code = get_tokenizer(DEMO).encode(CODE, add_special_tokens=False)
        prompts = [code[:9], code[5:30], code[12:]] + [(code * 5)[:100]]
    else:
        target = deep_llama
        spec = {"method": "eagle3", "model": make_eagle_head(deep_llama, tmp_path / head, head), "num_speculative_tokens": 3}
        prompts = PROMPTS[1:] + [list(range(60, 160))]
    # the last prompt ends at max_model_len (128): its drafts are cut there
    params = [SamplingParams(temperature=0.0, max_tokens=20 - 2 * i, ignore_eos=True) for i in range(len(prompts))]
    params[-1] = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = run(_llm(target, None))
    host = _llm(target, spec, async_scheduling=async_scheduling)
    install_stand_in_graphs(host, piecewise=False)
    host.llm_engine.engine_core.runner.after_spec_sample = None  # every proposal on the host
    want = run(host)
    graphed = _llm(target, spec, async_scheduling=async_scheduling)
    install_stand_in_graphs(graphed, piecewise=False)
    got = run(graphed)
    assert got == want == plain
    assert len(got[-1]) == 128 - 100  # stopped by max_model_len
    assert _drafts(graphed) == _drafts(host)
    assert _drafts(graphed)[1] > 0 if head.startswith("demo-") else _drafts(graphed)[0] > 0
    assert graphed.llm_engine.engine_core.proposer.num_device_proposals > 0
    assert host.llm_engine.engine_core.proposer.num_device_proposals == 0
    graphed.llm_engine.engine_core.check_integrity()


def test_eagle_batch_above_the_step_graphs_runs_eagerly(deep_llama, tmp_path):
    """max_num_seqs 2: graphs for 1 and 2 requests; a batch of 4 draft steps eagerly, with the same drafts."""
    head = make_eagle_head(deep_llama, tmp_path / "e", "eagle")
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2}
    eager = _llm(deep_llama, spec)
    want = _generate(eager, PROMPTS)
    graphed = _llm(deep_llama, spec)
    install_stand_in_graphs(graphed, piecewise=False)
    graphed.llm_engine.engine_core.proposer.step_graphs.sizes = [1, 2]  # as if max_num_seqs were 2
    assert _generate(graphed, PROMPTS) == want
    assert _drafts(graphed) == _drafts(eager)
    assert set(graphed.llm_engine.engine_core.proposer.step_graphs.num_replays) <= {1, 2}


def test_mtp_with_stand_in_graphs_matches_eager_and_plain(mtp_target):
    """MLA target: pure decodes through the decode graphs (verification steps stay eager), drafts 2..k through
    the MTP layer's step graphs."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    path = mtp_target
    prompts = [[p % 60 + 3 for p in prompt] for prompt in PROMPTS]
    plain = _generate(_llm(path, None), prompts, 16)
    eager = _llm(path, spec)
    want = _generate(eager, prompts, 16)
    graphed = _llm(path, spec)
    install_stand_in_graphs(graphed)
    assert graphed.llm_engine.engine_core.runner.graph_runner.q == 1
    assert _generate(graphed, prompts, 16) == want == plain
    assert _drafts(graphed) == _drafts(eager) and _drafts(graphed)[0] > 0
    _check_graphs_used(graphed, verification=False)


def test_medusa_with_stand_in_graphs_matches_plain(deep_llama, tmp_path):
    heads, _ = make_medusa_heads(deep_llama, tmp_path / "medusa")
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": 3}
    plain = _generate(_llm(deep_llama, None), PROMPTS)
    eager = _llm(deep_llama, spec)
    want = _generate(eager, PROMPTS)
    graphed = _llm(deep_llama, spec)
    install_stand_in_graphs(graphed)
    assert _generate(graphed, PROMPTS) == want == plain
    assert _drafts(graphed) == _drafts(eager) and _drafts(graphed)[0] > 0
    _check_graphs_used(graphed, head=False)
    heads = graphed.llm_engine.engine_core.proposer.head_graphs  # the heads' pass, by padded batch size
    assert sum(heads.num_replays.values()) > 0


def test_startup_summary_names_the_graphs(deep_llama, tmp_path):
    head = make_eagle_head(deep_llama, tmp_path / "e", "eagle")
    llm = _llm(deep_llama, {"method": "eagle", "model": head, "num_speculative_tokens": 3})
    core = llm.llm_engine.engine_core
    assert "run eagerly" in speculation_graphs_summary("eagle", core.runner, None)  # CPU: no graphs
    install_stand_in_graphs(llm)
    line = speculation_graphs_summary(
        "eagle", core.runner, core.proposer.step_graphs, core.proposer.catch_up_graphs
    )
    assert "verification steps (4 tokens a request) replay CUDA graphs for batch sizes 1..8" in line
    assert "piecewise CUDA graphs up to 32 tokens" in line
    assert "draft head's steps replay CUDA graphs for batch sizes 1..8" in line
    assert "catch-up after verification replays CUDA graphs for batch sizes 1..8" in line


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_device_drafts_with_structured_outputs(method, async_scheduling):
    """Constrained requests beside free ones, proposals queued on the device after each verification (the demo
    target's trained heads, stand-in graphs): the drafts are unconstrained, the grammar masks every draft position
    (async: filled after the previous step's tokens advance the matchers, then sampled, then the hook runs), and
    the tokens equal plain decoding's, the constraint obeyed, no block left."""
    from pagedllm import StructuredOutputsParams

    spec = {"method": method, "model": f"{DEMO}/{method}", "num_speculative_tokens": 3}
    regex = r"(ab|cd)+[0-9]{2,6}"
    so = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(choice=["for i in range", "while True"])]
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=s) for s in so]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    prompts = ["abab12 cdcd", "for i in range(3):\n", CODE, CODE[20:]]

    def run(llm: LLM) -> list:
        return llm.generate(prompts, params, use_tqdm=False)

    plain = run(_llm(DEMO, None))
    llm = _llm(DEMO, spec, async_scheduling=async_scheduling)
    install_stand_in_graphs(llm, piecewise=False)
    got = run(llm)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert re.fullmatch(regex, got[0].outputs[0].text) and got[1].outputs[0].text in so[1].choice
    assert llm.llm_engine.engine_core.proposer.num_device_proposals > 0
    assert _drafts(llm)[1] > 0
    llm.llm_engine.engine_core.check_integrity()


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_draft_model_steps_through_step_graphs(deep_llama, tiny_llama, draft, async_scheduling):
    """A draft model's steps 2..k replay step graphs (stand-ins) after its catch-up pass, fed draft 1 on the device
    and read once: the drafts of the pass-by-pass runner (acceptance counts; a draft equal to the target accepts
    every one), plain decoding's tokens, drafts cut at max_tokens."""
    model = deep_llama if draft == "self" else tiny_llama
    spec = {"model": model, "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.0, max_tokens=20 - 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = run(_llm(deep_llama, None))
    passes = _llm(deep_llama, spec, async_scheduling=async_scheduling)
    want = run(passes)
    graphed = _llm(deep_llama, spec, async_scheduling=async_scheduling)
    install_stand_in_graphs(graphed, piecewise=False)
    got = run(graphed)
    assert got == want == plain
    assert _drafts(graphed) == _drafts(passes) and _drafts(graphed)[0] > 0
    if draft == "self":
        assert _drafts(graphed)[1] == _drafts(graphed)[0]
    proposer = graphed.llm_engine.engine_core.proposer
    assert sum(proposer.step_graphs.num_replays.values()) > 0
    line = speculation_graphs_summary(
        "draft_model", graphed.llm_engine.engine_core.runner, proposer.step_graphs, proposer.runner.graph_runner
    )
    assert "its steps 2..k replay CUDA graphs" in line and "catch-up passes run eagerly" in line
    assert "its steps 2..k run eagerly" in passes.llm_engine.engine_core.proposer.graphs_summary  # at start-up
    graphed.llm_engine.engine_core.check_integrity()
