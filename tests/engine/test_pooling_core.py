"""PoolingEngineCore's scheduling: whole prompts, first come first served, under max_num_batched_tokens and
max_num_seqs; aborts; refusals."""

from __future__ import annotations

import pytest

from pagedllm.config import make_engine_config
from pagedllm.core.sched_output import EngineCoreRequest
from pagedllm.engine.pooling_core import PoolingEngineCore
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from tests.pooling.pooling_utils import make_st_embedder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_st_embedder("bert", tmp_path_factory.mktemp("core") / "bert", "cls")


def _request(req_id: str, num_tokens: int, **kwargs) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id,
        list(range(3, 3 + num_tokens)),
        None,
        None,
        0.0,
        pooling_params=PoolingParams(task="embed"),
        **kwargs,
    )


def test_steps_respect_budget_and_order(embedder) -> None:
    core = PoolingEngineCore(make_engine_config(embedder, max_num_batched_tokens=20, max_num_seqs=3))
    steps: list[list[str]] = []
    launch = core.runner.launch

    def recording(inputs):
        steps.append([x.req_id for x in inputs])
        assert sum(len(x.token_ids) for x in inputs) <= 20 and len(inputs) <= 3
        return launch(inputs)

    core.runner.launch = recording
    lengths = {"a": 12, "b": 8, "c": 20, "d": 3, "e": 4, "f": 5, "g": 6}
    for req_id, n in lengths.items():
        core.add_request(_request(req_id, n))
    core.abort_requests(["f"])
    assert core.get_stats().num_waiting_reqs == 6
    finished = []
    while core.has_unfinished_requests():
        out = core.step()
        for o in out.outputs:
            assert o.finished and len(o.pooling_output) == 64
            finished.append(o.request_id)
    # First come, first served: a request that does not fit waits for the next step (nothing jumps ahead).
    assert steps == [["a", "b"], ["c"], ["d", "e", "g"]]
    assert finished == ["a", "b", "c", "d", "e", "g"]
    assert core.get_stats().num_prompt_tokens == sum(n for r, n in lengths.items() if r != "f")
    core.shutdown()


def test_priority_policy(embedder) -> None:
    """scheduling_policy='priority': lower priority values first, then arrival, as for generation."""
    config = make_engine_config(
        embedder, max_num_batched_tokens=16, max_num_seqs=2, scheduling_policy="priority"
    )
    core = PoolingEngineCore(config)
    for req_id, priority, arrival in (
        ("late", 1, 0.0),
        ("urgent", -1, 2.0),
        ("mid", 0, 1.0),
        ("mid2", 0, 3.0),
    ):
        request = _request(req_id, 5)
        request.priority, request.arrival_time = priority, arrival
        core.add_request(request)
    order = []
    while core.has_unfinished_requests():
        # A step returns the previous step's outputs (one step stays in flight), so one step returns none.
        done = [o.request_id for o in core.step().outputs]
        if done:
            order.append(done)
    assert order == [["urgent", "mid"], ["mid2", "late"]]
    core.shutdown()


def test_refusals(embedder) -> None:
    core = PoolingEngineCore(make_engine_config(embedder, max_model_len=16, max_num_batched_tokens=12))
    with pytest.raises(ValueError, match="cannot generate"):
        core.add_request(EngineCoreRequest("x", [3, 4], SamplingParams(), None, 0.0))
    with pytest.raises(ValueError, match="maximum model length of 16"):
        core.add_request(_request("long", 17))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        core.add_request(_request("budget", 13))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(_request("empty", 0))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(
            EngineCoreRequest("v", [10**6], None, None, 0.0, pooling_params=PoolingParams(task="embed"))
        )
    with pytest.raises(ValueError, match="classif"):
        core.add_request(
            EngineCoreRequest("c", [3], None, None, 0.0, pooling_params=PoolingParams(task="classify"))
        )
    assert not core.has_unfinished_requests()
    core.shutdown()
