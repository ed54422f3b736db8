"""Weights replaced without a restart (``LLM.update_weights``, ``collective_rpc`` to the workers) give the
outputs of a fresh engine loaded with the new weights; refused updates change nothing; ``reset_prefix_cache``
drops the cached blocks."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.utils import ROLLOUT_ENGINE as ENGINE
from tests.utils import ROLLOUT_PROMPTS as PROMPTS
from tests.utils import greedy_ids as greedy
from tests.utils import perturbed_checkpoint


@pytest.fixture(scope="module")
def new_weights(updated_tiny_llama) -> tuple[str, dict[str, torch.Tensor]]:
    return updated_tiny_llama


@pytest.fixture(scope="module")
def old_tokens(tiny_llama) -> list[list[int]]:
    with LLM(tiny_llama, **ENGINE) as llm:
        return greedy(llm)


@pytest.fixture(scope="module")
def fresh_tokens(new_weights, old_tokens) -> list[list[int]]:
    with LLM(new_weights[0], **ENGINE) as llm:
        tokens = greedy(llm)
    assert tokens != old_tokens, "the new weights must change the outputs for these tests to mean anything"
    return tokens


@pytest.fixture
def llm(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as engine:
        yield engine


def test_update_from_state_dict_equals_fresh_engine(llm, new_weights, old_tokens, fresh_tokens):
    assert greedy(llm) == old_tokens  # the prompts' blocks are now in the prefix cache
    state = new_weights[1]
    assert llm.update_weights(state.items()) == len(state)
    assert greedy(llm) == fresh_tokens  # the stale cached blocks were dropped with the update
    llm.llm_engine.check_integrity()


def test_update_in_parts_through_collective_rpc(llm, new_weights, fresh_tokens):
    items = list(new_weights[1].items())
    half = len(items) // 2
    assert llm.collective_rpc("update_weights", args=(items[:half],)) == [half]
    assert llm.collective_rpc("update_weights", kwargs={"weights": items[half:]}) == [len(items) - half]
    assert llm.reset_prefix_cache()
    assert greedy(llm) == fresh_tokens


def test_update_casts_other_float_dtypes(llm, new_weights, fresh_tokens):
    # float64 values of float32 weights cast back exactly, as the loader casts checkpoint tensors
    assert llm.update_weights({k: v.double() for k, v in new_weights[1].items()}) == len(new_weights[1])
    assert greedy(llm) == fresh_tokens


def test_refused_updates_change_nothing(llm, new_weights, old_tokens):
    state = new_weights[1]
    good = list(state.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    bad_updates = {
        "model.layers.0.self_attn.nope.weight": good
        + [("model.layers.0.self_attn.nope.weight", torch.zeros(4))],
        q: good + [(q, state[q][:-1])],  # wrong shape, after every good tensor: checked before any is written
        "model.norm.weight": good + [("model.norm.weight", state["model.norm.weight"].long())],  # not a float
    }
    for name, update in bad_updates.items():
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            llm.update_weights(update)
    with pytest.raises(ValueError, match="weights"):
        llm.update_weights([("model.norm.weight", [1.0, 2.0])])
    with pytest.raises(ValueError, match=q.replace(".", r"\.")):
        llm.collective_rpc("check_weights", args=([(q, torch.float32, (3, 3))],))
    assert greedy(llm) == old_tokens


def test_collective_rpc_one_result_per_worker(llm):
    assert llm.collective_rpc(lambda worker: worker.rank) == [0]
    assert llm.collective_rpc(_param_count, args=("model.norm.weight",), kwargs={"scale": 2}) == [2 * 64]
    assert llm.collective_rpc("sleeping_tags") == [[]]
    with pytest.raises(ValueError, match="method"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(ValueError, match="method"):
        llm.collective_rpc("_updater")


def _param_count(worker, name: str, scale: int = 1) -> int:
    return scale * dict(worker.model.named_parameters())[name].numel()


def test_reset_prefix_cache_drops_cached_blocks(llm):
    prompt = [list(range(20, 40))]  # five full blocks of four tokens

    def hits() -> int:
        return llm.llm_engine.get_stats().prefix_cache_hits

    first = greedy(llm, prompt)
    before = hits()
    assert greedy(llm, prompt) == first and hits() > before  # the repeated prompt hits
    assert llm.reset_prefix_cache()
    before = hits()
    assert greedy(llm, prompt) == first and hits() == before  # no longer


def test_data_parallel_update_reaches_every_engine(tiny_llama, new_weights, old_tokens, fresh_tokens):
    with LLM(tiny_llama, data_parallel_size=2, enable_sleep_mode=True, **ENGINE) as dp:
        assert dp.collective_rpc(lambda worker: worker.rank) == [0, 0]  # one engine per data-parallel rank
        assert greedy(dp) == old_tokens
        dp.update_weights(new_weights[1])
        assert greedy(dp, PROMPTS * 2) == fresh_tokens * 2  # both engines serve
        dp.sleep(level=1)
        assert dp.is_sleeping()
        dp.wake_up()
        assert greedy(dp, PROMPTS * 2) == fresh_tokens * 2


def test_worker_extension_loads_through_model_load_weights(tiny_llama, new_weights, fresh_tokens):
    extension = "tests.distributed.rl_workers.RankProbe"
    with LLM(tiny_llama, worker_extension_cls=extension, **ENGINE) as llm:
        for name, tensor in new_weights[1].items():
            llm.collective_rpc("load_named", args=(name, tensor))
        k = "model.layers.0.self_attn.k_proj.weight"
        written = llm.collective_rpc("load_named", args=(k, new_weights[1][k]))
        assert written == [["model.layers.0.self_attn.qkv_proj.weight"]]
        with pytest.raises(ValueError, match="nope"):
            llm.collective_rpc("load_named", args=("model.nope.weight", new_weights[1][k]))
        assert llm.reset_prefix_cache()
        assert greedy(llm) == fresh_tokens
    with pytest.raises(ValueError, match="worker_extension_cls"):
        LLM(tiny_llama, worker_extension_cls="tests.nowhere.Nothing", **ENGINE)


def test_shutdown_releases_the_weights_after_updates(tiny_llama, new_weights):
    import gc
    import weakref

    llm = LLM(tiny_llama, enable_sleep_mode=True, **ENGINE)
    llm.update_weights(new_weights[1])
    k = "model.layers.0.self_attn.k_proj.weight"
    llm.collective_rpc(lambda worker: worker.model.load_weights([(k, new_weights[1][k])]))
    llm.sleep(level=1)
    llm.wake_up()
    model = weakref.ref(llm.llm_engine.engine_core.runner.model)
    param = weakref.ref(next(model().parameters()))
    llm.shutdown()
    gc.collect()
    assert model() is None and param() is None


@pytest.mark.parametrize("arch", ["phi3", "gemma", "qwen2", "qwen3_moe"])
def test_update_other_families(tiny_model_dirs, arch, tmp_path):
    """A fused q/k/v checkpoint (phi3), tied embeddings (gemma), q/k/v biases (qwen2), experts (qwen3_moe)."""
    if arch == "qwen3_moe":
        from tests.models.test_moe import make_tiny_moe

        path = make_tiny_moe(arch, tmp_path / "moe", seed=7)
    else:
        path = tiny_model_dirs[arch]
    state = perturbed_checkpoint(path, tmp_path / arch)
    with LLM(str(tmp_path / arch), **ENGINE) as fresh:
        expected = greedy(fresh)
    with LLM(path, **ENGINE) as llm:
        assert greedy(llm) != expected
        assert llm.update_weights(state) == len(state)
        assert greedy(llm) == expected


def test_quantized_models_refuse_updates_but_sleep(tiny_llama):
    with LLM(tiny_llama, quantization="fp8", enable_sleep_mode=True, **ENGINE) as llm:
        before = greedy(llm)
        with pytest.raises(ValueError, match="quantization"):
            llm.update_weights([("model.norm.weight", torch.ones(64))])
        llm.sleep(level=1)
        llm.wake_up()
        assert greedy(llm) == before
