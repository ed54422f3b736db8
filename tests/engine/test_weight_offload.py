"""Weight offload (``cpu_offload_gb``, pagedllm/worker/weight_offload.py): which layers a budget offloads, greedy
tokens and logprobs identical to an engine without offload (some layers, all layers, none), the weights staged
for each forward (on CPU the staging buffer is a CPU tensor: the same path), weight updates landing in the host
copy, sleep mode, MoE and LoRA layers, and refusals naming ``cpu_offload_gb``. ``gpu``: device memory held by
the weights drops by the offloaded bytes, outputs unchanged."""

from __future__ import annotations

import argparse
import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.worker.weight_offload import host_buffers, layer_offload_bytes, pinned_group_size, plan_offload
from tests.utils import ROLLOUT_ENGINE as ENGINE
from tests.utils import ROLLOUT_PROMPTS
from tests.utils import greedy_ids as greedy

ALL = 1.0  # GiB: far more than the tiny model's layers


def _layer_bytes(llm: LLM, index: int) -> int:
    """What offloading decoder layer ``index`` of ``llm``'s model moves to the host (aligned storages)."""
    layer = llm.llm_engine.engine_core.runner.model.model.layers[index]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in layer.parameters()}
    return layer_offload_bytes(list(storages.values()))


def _offloader(llm: LLM):
    return llm.llm_engine.engine_core.runner.weight_offload


def _tokens_and_logprobs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ROLLOUT_PROMPTS], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
        for o in outs
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """(tokens and logprobs, one layer's offload bytes) of the tiny model without offload."""
    with LLM(tiny_llama, **ENGINE) as llm:
        assert _offloader(llm) is None
        return _tokens_and_logprobs(llm), _layer_bytes(llm, 0)


def test_plan_takes_whole_layers_from_the_first():
    assert plan_offload([10, 10, 10], 25) == [0, 1]
    assert plan_offload([10, 10, 10], 30) == [0, 1, 2]
    assert plan_offload([10, 10, 10], 9) == []
    assert plan_offload([0, 10, 10], 10) == [1]  # a layer with nothing to offload is passed over
    assert plan_offload([10, 20, 5], 25) == [0]  # stops at the first layer that does not fit


@pytest.mark.parametrize("layers", [1, 2])
def test_budget_offloads_whole_layers_and_outputs_are_identical(tiny_llama, reference, layers):
    expected, layer_bytes = reference
    budget = ALL if layers == 2 else (layer_bytes + layer_bytes // 2) / 2**30  # one and a half layers -> one
    with LLM(tiny_llama, cpu_offload_gb=budget, **ENGINE) as llm:
        offload = _offloader(llm)
        assert offload.layer_indices == list(range(layers))
        assert offload.offloaded_bytes == layers * layer_bytes
        assert offload.staging_bytes == layer_bytes  # one slot on CPU
        model = llm.llm_engine.engine_core.runner.model
        staged = []  # whether layer 0's weights were views of the staging slot while it ran
        slot = offload.staging[0]
        start, end = slot.data_ptr(), slot.data_ptr() + slot.numel()
        hook = model.model.layers[0].mlp.register_forward_pre_hook(
            lambda m, args: staged.append(start <= m.down_proj.weight.data_ptr() < end)
        )
        try:
            assert _tokens_and_logprobs(llm) == expected
        finally:
            hook.remove()
        assert staged and all(staged)
        host = {layer.host.untyped_storage().data_ptr() for layer in offload.layers}
        for layer in model.model.layers[:layers]:  # between forwards: views of the host copy
            assert {p.untyped_storage().data_ptr() for p in layer.parameters()} <= host
        for layer in model.model.layers[layers:]:
            assert not {p.untyped_storage().data_ptr() for p in layer.parameters()} & host


def test_pinned_host_buffers_share_allocations_to_waste_least():
    """torch rounds each pinned allocation up to a power of two: 19 layers of 0.41 GiB would pin 19 x 0.5 GiB one by
    one, 8 GiB in one allocation; 9 layers pin 4 GiB together (not 4.5 GiB one by one, nor 6 GiB as 5 + 4)."""
    layer = 436_207_616  # a Llama-3.1-8B layer in bf16
    assert pinned_group_size([layer] * 19) == 19
    assert pinned_group_size([layer] * 9) == 9
    assert pinned_group_size([2**20] * 4) == 1  # already powers of two: one allocation each
    buffers = host_buffers([1024, 512, 2048], pin=False)  # unpinned (CPU): one exact buffer each
    assert [b.numel() for b in buffers] == [1024, 512, 2048]


def test_budget_below_one_layer_offloads_nothing(tiny_llama, reference):
    _, layer_bytes = reference
    with LLM(tiny_llama, cpu_offload_gb=(layer_bytes - 1) / 2**30, **ENGINE) as llm:
        assert _offloader(llm) is None


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, "4", True])
def test_bad_budget_is_refused_naming_the_field(tiny_llama, value):
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        make_engine_config(tiny_llama, device="cpu", cpu_offload_gb=value)


def test_pooling_model_is_refused_naming_both(tiny_model_dirs):
    with pytest.raises(ValueError, match="cpu_offload_gb is not supported with a pooling model"):
        make_engine_config(tiny_model_dirs["qwen3"], device="cpu", runner="pooling", cpu_offload_gb=1)


def test_flag_reaches_the_engine_arguments():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs_from_args(parser.parse_args(["--cpu-offload-gb", "4"]))["cpu_offload_gb"] == 4.0
    assert engine_kwargs_from_args(parser.parse_args([]))["cpu_offload_gb"] == 0


def test_config_file_takes_the_flag_name():
    from pagedllm.entrypoints.config_file import config_to_defaults
    from pagedllm.entrypoints.openai.serve_cli import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_to_defaults(parser, {"cpu-offload-gb": 4}) == {"cpu_offload_gb": 4.0}


def _offload_report(worker) -> tuple[int, int]:
    offload = worker.model_runner.weight_offload
    return offload.num_layers, offload.offloaded_bytes


def test_tensor_parallel_ranks_offload_their_own_shards(tiny_llama, reference):
    """Each rank offloads its shard of the same layers (about half a layer's bytes each); greedy tokens as without."""
    expected, layer_bytes = reference
    engine = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    with LLM(tiny_llama, tensor_parallel_size=2, cpu_offload_gb=ALL, **engine) as llm:
        reports = llm.collective_rpc(_offload_report)
        assert [n for n, _ in reports] == [2, 2]
        assert all(0.4 * 2 * layer_bytes < nbytes < 0.7 * 2 * layer_bytes for _, nbytes in reports)
        assert greedy(llm) == [tokens for tokens, _ in expected]


def test_weight_update_lands_in_the_host_copy(tiny_llama, updated_tiny_llama):
    """An update through an engine that offloads every layer gives what a fresh engine on the new weights gives."""
    updated_dir, state = updated_tiny_llama
    with LLM(updated_dir, **ENGINE) as fresh:
        expected = greedy(fresh)
    with LLM(tiny_llama, cpu_offload_gb=ALL, **ENGINE) as llm:
        before = greedy(llm)
        llm.update_weights(state)
        assert greedy(llm) == expected != before


def test_sleep_level1_keeps_offloaded_weights_on_the_host(tiny_llama, reference):
    expected, _ = reference
    with LLM(tiny_llama, cpu_offload_gb=ALL, enable_sleep_mode=True, **ENGINE) as llm:
        offload = _offloader(llm)
        llm.sleep(level=1)
        assert all(layer.host.untyped_storage().nbytes() >= layer.nbytes for layer in offload.layers)
        assert all(t.untyped_storage().nbytes() == 0 for t in offload.staging)  # the device slot is released
        llm.wake_up()
        assert _tokens_and_logprobs(llm) == expected


def test_moe_layers_offload_their_stacked_experts(tmp_path):
    """An MoE layer's experts are buffers sharing the parameters' storage: they are offloaded and staged too."""
    from pagedllm.layers.fused_moe import FusedMoE
    from tests.models.test_moe import make_tiny_moe

    path = make_tiny_moe("mixtral", tmp_path / "mixtral", seed=0)
    with LLM(path, **ENGINE) as llm:
        expected = greedy(llm)
    with LLM(path, cpu_offload_gb=ALL, **ENGINE) as llm:
        offload = _offloader(llm)
        assert offload.num_layers == 2
        layer = llm.llm_engine.engine_core.runner.model.model.layers[0]
        (moe,) = [m for m in layer.modules() if isinstance(m, FusedMoE)]
        host = offload.layers[0].host.untyped_storage().data_ptr()
        assert moe.w13.untyped_storage().data_ptr() == host  # the stacked buffer follows its parameters
        assert greedy(llm) == expected


def test_lora_with_offloaded_layers(tiny_llama, tmp_path):
    """Adapter slots stay on the device; the base weights under them are staged."""
    from pagedllm.lora.request import LoRARequest
    from tests.lora.lora_utils import adapter_kwargs, make_peft_adapter

    adapter = make_peft_adapter(tiny_llama, tmp_path / "all", seed=1, **adapter_kwargs("llama")["all"])
    lora = LoRARequest("all", 1, adapter)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ROLLOUT_PROMPTS]
    outs = []
    for budget in (0, ALL):
        with LLM(tiny_llama, enable_lora=True, cpu_offload_gb=budget, **ENGINE) as llm:
            if budget:
                assert _offloader(llm).num_layers == 2
            got = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in got])
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_gpu_memory_drops_by_the_offloaded_bytes(tiny_llama):
    """On the GPU: the device memory the weights hold drops by the offloaded bytes, the host copies are pinned, no
    CUDA graph is captured, and the outputs equal those of the engine without offload (which captures graphs)."""
    engine = dict(ENGINE, device="cuda", enforce_eager=False)

    def run(budget: float):
        with LLM(tiny_llama, cpu_offload_gb=budget, **engine) as llm:
            runner = llm.llm_engine.engine_core.runner
            storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in runner.model.parameters()}
            held = sum(s.nbytes() for s in storages.values() if s.device.type == "cuda")
            offload = runner.weight_offload
            graphs = runner.graph_runner is not None
            return greedy(llm), held, offload, graphs

    expected, held_all, none, graphs = run(0)
    assert none is None and graphs
    got, held, offload, graphs = run(ALL)
    assert got == expected
    assert offload.num_layers == 2 and not graphs
    assert all(layer.host.is_pinned() for layer in offload.layers)
    assert offload.staging_bytes == 2 * offload.layers[0].nbytes  # two slots: the next layer's copy overlaps
    assert held_all - held == pytest.approx(offload.offloaded_bytes, rel=0.05)
