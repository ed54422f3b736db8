"""CUDA graphs for speculative decoding that reads the target's hidden states (EAGLE, EAGLE-3, MTP, Medusa): on CPU,
the plan of the draft steps (the eager steps' and the step graphs'), the graphs' output slicing, and whole engines
whose graphs are stand-ins that run the forward again at each replay (``EagerGraph``): the runners' staging, padding
and slicing, and the proposers' chained draft steps, give the eager engine's drafts and the plain engine's tokens.
The GPU tests (real graphs) are in test_spec_graphs_gpu.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.base import AttentionMetadata
from pagedllm.layers.attention import Attention
from pagedllm.spec_decode.head_graphs import (
    DraftStepGraphs,
    plan_draft_step,
    run_draft_steps,
    speculation_graphs_summary,
)
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
    """Step j runs a request at last_pos + j while that is below its limit (last_pos + num_drafts - 1: it needs a
    draft after step j's); otherwise (and on padding rows) position 0, context 1, slot -1."""
    last_pos = torch.tensor([5, 9, 2, 0])
    num_drafts = torch.tensor([3, 1, 2])  # steps: request 0 runs 2, request 1 none, request 2 one
    limit = torch.tensor([*(last_pos[:3] + num_drafts - 1).tolist(), 0])  # row 3: padding, as the graphs pad
    table = torch.tensor([[7, 3, 0], [4, 8, 6], [2, 0, 0], [0, 0, 0]], dtype=torch.int32)
    plans = [plan_draft_step(last_pos, limit, j, table, block_size=4) for j in range(2)]
    assert [p.tolist() for p, _, _ in plans] == [[5, 0, 2, 0], [6, 0, 0, 0]]
    assert [s.tolist() for _, _, s in plans] == [[6, 1, 3, 1], [7, 1, 1, 1]]
    # position 5 -> block 1 (id 3), offset 1; position 2 -> block 0 (id 2), offset 2
    assert [s.tolist() for _, s, _ in plans] == [[13, -1, 10, -1], [14, -1, -1, -1]]
    assert [(p.dtype, s.dtype, c.dtype) for p, s, c in plans[:1]] == [(torch.long, torch.long, torch.int32)]
    # a graph's step counter (a [1] tensor on the device) plans the same step
    for j, plan in enumerate(plans):
        got = plan_draft_step(last_pos, limit, torch.tensor([j]), table, block_size=4)
        assert all(torch.equal(a, b) for a, b in zip(got, plan))


def test_draft_step_plan_crosses_blocks_and_rests_a_request_of_one_draft():
    table = torch.tensor([[5, 6]], dtype=torch.int32)
    last_pos, limit = torch.tensor([0]), torch.tensor([0 + 4 - 1])  # 4 drafts
    plans = [plan_draft_step(last_pos, limit, j, table, block_size=2) for j in range(3)]  # k - 1 steps
    assert [p.tolist() for p, _, _ in plans] == [[0], [1], [2]]
    assert [s.tolist() for _, s, _ in plans] == [[10], [11], [12]]
    table = torch.zeros(1, 1, dtype=torch.int32)
    last_pos, limit = torch.tensor([3]), torch.tensor([3 + 1 - 1])  # 1 draft
    for j in range(2):  # one draft: every step it is planned for rests
        pos, slots, seq_lens = plan_draft_step(last_pos, limit, j, table, 4)
        assert pos.tolist() == [0] and slots.tolist() == [-1] and seq_lens.tolist() == [1]


def test_eager_draft_steps_match_the_step_graphs_with_resting_requests():
    """The eager steps (batches no graph fits) and the step graphs (stand-ins, padded to 4 rows) over the same
    requests, two of which rest from some step on: the same plans, the same KV writes, the same drafts."""
    block_size, hidden_size = 4, 3
    last_pos = np.array([5, 9, 2], dtype=np.int64)
    num_drafts = np.array([4, 1, 2], dtype=np.int64)  # request 0 runs 3 steps, request 1 none, request 2 one
    table = np.array([[7, 3, 0], [4, 8, 6], [2, 5, 0]], dtype=np.int32)
    n, steps = len(last_pos), int(num_drafts.max()) - 1
    tokens = torch.tensor([11, 22, 33])  # [n] draft 1
    hidden = torch.arange(n * hidden_size, dtype=torch.float32).view(n, hidden_size)  # [n, H]

    def toy_head(cache: torch.Tensor, plans: list) -> Callable:
        """A step that writes each row's key at its slot and reads its context through the block table, like
        attention; its drafts depend on the tokens, positions, contexts and hidden."""

        def step(tok: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):
            m = tok.shape[0]
            plans.append((pos[:n].clone(), meta.slot_mapping[:n].clone(), meta.seq_lens[:n].clone()))
            assert torch.equal(meta.seq_lens_cpu[:m], meta.seq_lens[:m])
            write = meta.slot_mapping >= 0
            cache[meta.slot_mapping[write]] = tok[write] + 1
            p = torch.arange(meta.block_table.shape[1] * block_size)  # [P] every position the table covers
            slots = meta.block_table[:m, p // block_size].long() * block_size + p % block_size  # [m, P]
            context = torch.where(p < meta.seq_lens[:m, None], cache[slots], 0).sum(1)  # [m]
            hid = hid + (context + pos)[:, None]
            return hid, (tok * 31 + pos * 7 + context + hid.sum(1).long()) % 1000

        return step

    initial = torch.arange(9 * block_size) * 3  # 9 blocks: every id in the table; the keys before the steps
    eager_cache, eager_plans = initial.clone(), []
    eager_out = torch.full((n, steps), -7)
    step = toy_head(eager_cache, eager_plans)
    run_draft_steps(step, block_size, last_pos, num_drafts, table, tokens, hidden, eager_out)

    graph_cache, graph_plans = initial.clone(), []
    graphs = DraftStepGraphs(
        toy_head(graph_cache, graph_plans), hidden_size, torch.float32, 4, steps, 3, 12, torch.device("cpu"),
        block_size,
    )  # fmt: skip
    graphs.capture()
    assert graphs.padded_size(n) == 4 and torch.equal(graph_cache, initial)  # (capturing writes no key)
    graph_plans.clear()
    graph_out = torch.full((n, steps), -7)
    graphs.run(last_pos, num_drafts, table, tokens, hidden, graph_out)
    assert graphs.num_replays == {4: steps}

    assert [[t.tolist() for t in plan] for plan in eager_plans] == [
        [[5, 0, 2], [13, -1, 10], [6, 1, 3]],
        [[6, 0, 0], [14, -1, -1], [7, 1, 1]],
        [[7, 0, 0], [15, -1, -1], [8, 1, 1]],
    ]
    assert [[t.tolist() for t in plan] for plan in graph_plans] == [
        [t.tolist() for t in plan] for plan in eager_plans
    ]
    assert torch.equal(graph_cache, eager_cache) and not torch.equal(eager_cache, initial)
    assert torch.equal(graph_out, eager_out) and (eager_out >= 0).all()


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
def test_head_drafts_on_the_device_after_verification(deep_llama, tmp_path, head, async_scheduling, monkeypatch):
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
    # (async: every launch waits for the step in flight, as the host's proposals do; test_async_launches_ahead
    # takes the other way, whose drafts are not cut at max_tokens or the blocks' end)
    monkeypatch.setenv("PAGEDLLM_SPEC_AHEAD", "0")
    graphed = _llm(target, spec, async_scheduling=async_scheduling)
    install_stand_in_graphs(graphed, piecewise=False)
    got = run(graphed)
    assert got == want == plain
    assert len(got[-1]) == 128 - 100  # stopped by max_model_len
    assert _drafts(graphed) == _drafts(host)
    assert _drafts(graphed)[1] > 0 if head.startswith("demo-") else _drafts(graphed)[0] > 0
    assert graphed.llm_engine.engine_core.proposer.num_device_proposals > 0
    assert host.llm_engine.engine_core.proposer.num_device_proposals == 0
    assert graphed.llm_engine.engine_core.num_spec_launches_ahead == 0  # (the switch holds)
    graphed.llm_engine.engine_core.check_integrity()


@pytest.mark.parametrize("head", ["demo-eagle", "eagle3", "demo-medusa"])
def test_async_launches_ahead(deep_llama, tmp_path, head):
    """Async speculation whose drafts stay on the device: a verification step is launched before the host has
    read the step in flight (EngineCore._plan_ahead); the device feeds it that step's last token and the queued
    drafts, and moves its positions, slots and context lengths back over the drafts that step rejected. Greedy
    output equals plain decoding through uneven max_tokens, a stop token, max_model_len, a request arriving
    mid-run (that step waits), preemptions in a small pool and prefix hits; no block leaks. The demo heads
    accept drafts (every accepted count); a random EAGLE-3 head accepts none (every draft moved back)."""
    if head.startswith("demo-"):
        method = head[len("demo-") :]
        target, spec = DEMO, {"method": method, "model": f"{DEMO}/{method}", "num_speculative_tokens": 3}
        code = get_tokenizer(DEMO).encode(CODE, add_special_tokens=False)
        prompts = [code[:9], code[5:30], code[12:], code[3:20], (code * 5)[:100]]
    else:
        target = deep_llama
        spec = {"method": "eagle3", "model": make_eagle_head(deep_llama, tmp_path / head, head), "num_speculative_tokens": 3}
        prompts = PROMPTS + [list(range(60, 160))]
    prefix = prompts[1][:12]  # three requests share a 12-token prefix (three blocks)
    prompts = prompts + [prefix + p[:5] for p in prompts[:2]]
    params = [SamplingParams(temperature=0.0, max_tokens=24 - 3 * i, ignore_eos=True) for i in range(len(prompts))]
    params[4] = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # 100 tokens in: max_model_len

    def run(llm: LLM, stop: int | None = None) -> list[list[int]]:
        ps = list(params)
        if stop is not None:
            ps[0] = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
        engine = llm.llm_engine
        for i, (p, sp) in enumerate(zip(prompts[:-1], ps)):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        outs, late = {}, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
            if late is None and outs:  # the last request arrives while the others decode
                late = str(len(prompts) - 1)
                engine.add_request(late, {"prompt_token_ids": prompts[-1]}, ps[-1])
        return [outs[str(i)] for i in range(len(prompts))]

    plain = run(_llm(target, None))
    stop = plain[0][6]
    plain_stop = run(_llm(target, None), stop)
    assert plain_stop[0] != plain[0]  # the stop token ends request 0 early
    for kw in ({}, {"num_gpu_blocks_override": 36}):
        llm = _llm(target, spec, async_scheduling=True, **kw)
        install_stand_in_graphs(llm, piecewise=False)
        core = llm.llm_engine.engine_core
        assert run(llm) == plain
        assert run(llm, stop) == plain_stop
        assert len(plain[4]) == 128 - 100  # stopped by max_model_len
        assert 0 < core.num_spec_launches_ahead < core.num_spec_launches
        s = llm.llm_engine.get_stats()
        assert s.prefix_cache_hits > 0
        if kw:
            assert s.num_preemptions > 0, "the small pool was meant to preempt"
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
        core.check_integrity()
    if head == "demo-eagle":
        # Logprobs take the general sampling path, its drafts read where the device left them.
        lp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
        requests = [{"prompt_token_ids": p} for p in prompts[:3]]
        want = _llm(target, None).generate(requests, lp, use_tqdm=False)
        before = core.num_spec_launches_ahead
        got = llm.generate(requests, lp, use_tqdm=False)
        assert core.num_spec_launches_ahead > before
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for wrow, grow in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert wrow.keys() == grow.keys()
                assert all(grow[t].logprob == pytest.approx(wrow[t].logprob, abs=1e-4) for t in wrow)


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
