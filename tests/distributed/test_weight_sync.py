"""The rollout-engine hooks on a tensor-parallel engine (TP=2 on CPU, gloo): ``collective_rpc`` reaches both
ranks, weight updates (a state dict, or tensors broadcast by a trainer in another process through a separate
group) give the outputs of a fresh engine loaded with the new weights, and sleep mode releases every rank."""

from __future__ import annotations

import multiprocessing

import pytest

from pagedllm import LLM
from tests.distributed.rl_workers import BAD_TENSOR, checkpoint_tensors, trainer_broadcast
from tests.entrypoints.server_utils import free_port
from tests.utils import ROLLOUT_ENGINE as ENGINE
from tests.utils import greedy_ids as greedy


@pytest.fixture(scope="module")
def old_tokens(tiny_llama) -> list[list[int]]:
    with LLM(tiny_llama, **ENGINE) as llm:
        return greedy(llm)


@pytest.fixture(scope="module")
def fresh_tokens(updated_tiny_llama, old_tokens) -> list[list[int]]:
    with LLM(updated_tiny_llama[0], **ENGINE) as llm:
        tokens = greedy(llm)
    assert tokens != old_tokens
    return tokens


def test_pipeline_parallel_update_and_sleep(tiny_llama, updated_tiny_llama, old_tokens, fresh_tokens):
    """Each stage takes the tensors of its own layers and skips the others'; a name no stage holds is refused
    before any stage writes."""
    with LLM(tiny_llama, pipeline_parallel_size=2, enable_sleep_mode=True, **ENGINE) as llm:
        assert greedy(llm) == old_tokens
        state = updated_tiny_llama[1]
        bogus = "model.layers.1.mlp.bogus.weight"  # under the second stage's layer: only that stage can tell
        with pytest.raises(ValueError, match=r"rank 1: .*bogus"):
            llm.update_weights(list(state.items()) + [(bogus, state["model.norm.weight"])])
        assert greedy(llm) == old_tokens
        counts = llm.collective_rpc(
            "check_weights", args=([(n, t.dtype, tuple(t.shape)) for n, t in state.items()],)
        )
        assert counts == [None, None]
        llm.update_weights(state)
        assert greedy(llm) == fresh_tokens
        llm.sleep(level=1)
        llm.wake_up()
        assert greedy(llm) == fresh_tokens


def test_async_scheduling_sleep_and_update(tiny_llama, updated_tiny_llama, old_tokens, fresh_tokens):
    """With async scheduling the workers get each step's tokens with the next launch: sleeping, waking and
    writing weights in between keep every rank's batch in step."""
    state = updated_tiny_llama[1]
    with LLM(
        tiny_llama, tensor_parallel_size=2, async_scheduling=True, enable_sleep_mode=True, **ENGINE
    ) as llm:
        assert greedy(llm) == old_tokens
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.update_weights(state)
        llm.wake_up(tags=["kv_cache"])
        assert greedy(llm) == fresh_tokens
        llm.llm_engine.engine_core.runner.check_batches()


@pytest.fixture(scope="module")
def tp_llm(tiny_llama):
    """One TP=2 engine for the tests below it (a process joins one torch.distributed group at a time: the tests
    above start and end their own engines first)."""
    with LLM(
        tiny_llama,
        tensor_parallel_size=2,
        enable_sleep_mode=True,
        worker_extension_cls="tests.distributed.rl_workers.RankProbe",
        **ENGINE,
    ) as llm:
        yield llm


def _fail_on_rank1(worker) -> int:
    if worker.rank == 1:
        raise ValueError("rank one says no")
    return worker.rank


def test_collective_rpc_reaches_every_rank(tp_llm, old_tokens):
    assert greedy(tp_llm) == old_tokens
    assert tp_llm.collective_rpc(lambda worker: worker.rank) == [0, 1]
    # the extension's method; each rank holds half of q/k/v's rows (4 heads + 2 + 2 kv heads of 16)
    assert tp_llm.collective_rpc("probe", kwargs={"offset": 1}) == [(0, 65), (1, 65)]
    with pytest.raises(ValueError, match="rank 1: rank one says no"):
        tp_llm.collective_rpc(_fail_on_rank1)
    with pytest.raises(ValueError, match="method"):
        tp_llm.collective_rpc("no_such_method")
    assert greedy(tp_llm) == old_tokens  # the ranks are still in step


def test_update_from_state_dict(tp_llm, tiny_llama, updated_tiny_llama, old_tokens, fresh_tokens):
    state = updated_tiny_llama[1]
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=q.replace(".", r"\.")):
        tp_llm.update_weights(list(state.items()) + [(q, state[q][:, :-1])])
    assert greedy(tp_llm) == old_tokens
    assert tp_llm.update_weights(state) == len(state)
    assert greedy(tp_llm) == fresh_tokens
    tp_llm.update_weights(checkpoint_tensors(tiny_llama))  # back to the old weights
    assert greedy(tp_llm) == old_tokens


def test_sleep_and_wake_on_every_rank(tp_llm, old_tokens):
    tp_llm.sleep(level=1)
    released = tp_llm.collective_rpc(
        lambda w: (
            sum(p.untyped_storage().nbytes() for p in w.model.parameters())
            + sum(t.untyped_storage().nbytes() for t in w.model_runner.kv_caches)
        )
    )
    assert released == [0, 0]
    with pytest.raises(RuntimeError, match="sleeping"):
        greedy(tp_llm)
    tp_llm.wake_up()
    assert greedy(tp_llm) == old_tokens


def test_broadcast_from_trainer_process(tp_llm, updated_tiny_llama, old_tokens, fresh_tokens):
    port = free_port()
    world_size = 1 + 2  # the trainer, then the engine's two ranks
    trainer = multiprocessing.get_context("spawn").Process(
        target=trainer_broadcast, args=(port, world_size, updated_tiny_llama[0]), daemon=True
    )
    trainer.start()
    try:
        tp_llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, world_size))
        name, shape = BAD_TENSOR
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            tp_llm.collective_rpc("update_weight", args=(name, "float32", shape))
        assert greedy(tp_llm) == old_tokens  # refused: nothing changed
        for name, tensor in checkpoint_tensors(updated_tiny_llama[0]):
            tp_llm.collective_rpc("update_weight", args=(name, str(tensor.dtype), tuple(tensor.shape)))
        trainer.join(60)
        assert trainer.exitcode == 0
        assert tp_llm.reset_prefix_cache()
        assert greedy(tp_llm) == fresh_tokens
    finally:
        tp_llm.collective_rpc("destroy_weight_update_group")
        if trainer.is_alive():
            trainer.kill()
            trainer.join()
