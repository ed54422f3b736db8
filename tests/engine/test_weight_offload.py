"""Weight offload (``cpu_offload_gb``, pagedllm/worker/weight_offload.py): which layers a budget offloads, greedy
tokens and logprobs identical to an engine without offload (some layers, all layers, none; checkpoint and dummy
weights), the weights staged for each forward (on CPU the staging buffer is a CPU tensor: the same path), the
loader building and loading offloaded layers in host memory (a meta "device" stands in for the GPU and records
what is allocated on it), weight updates landing in the host copy, sleep mode, MoE and LoRA layers, and refusals
naming ``cpu_offload_gb``. ``gpu``: device memory held by the weights drops by the offloaded bytes, outputs
unchanged; the peak device memory while loading drops by about the offloaded bytes."""

from __future__ import annotations

import argparse
import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.worker.weight_offload import (
    WeightOffloader,
    host_buffers,
    layer_offload_bytes,
    pinned_group_size,
    plan_offload,
)
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


def test_dummy_weights_are_the_same_with_offload(tiny_llama):
    """``load_format="dummy"``: every parameter (offloaded or not) gets the value it gets without offload."""
    runs = []
    for budget in (0, ALL):
        with LLM(tiny_llama, load_format="dummy", cpu_offload_gb=budget, **ENGINE) as llm:
            model = llm.llm_engine.engine_core.runner.model
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            runs.append((params, _tokens_and_logprobs(llm), _offloader(llm)))
    (plain, plain_out, none), (offloaded, offloaded_out, offload) = runs
    assert none is None and offload.num_layers == 2
    assert plain.keys() == offloaded.keys()
    assert all(torch.equal(plain[n], offloaded[n]) for n in plain)
    assert offloaded_out == plain_out


class _DeviceAllocations(TorchDispatchMode):
    """Bytes of new storages each op makes on ``device``, summed under the current ``phase`` label."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.phase = "load"
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self.bytes[self.phase] += storage.nbytes()
        return out


def _load_on_meta(path: str, budget_bytes: int, monkeypatch) -> tuple:
    """``get_model`` on a meta "device" (it allocates nothing; the host is the CPU) with a ``WeightOffloader`` of
    ``budget_bytes``: (model, offloader, device bytes allocated per phase: ``plan``, ``build``, ``load``, then
    ``layer i`` while offloaded layer ``i`` is processed, ``staging``)."""
    import pagedllm.model_loader as loader
    from pagedllm.attention.torch_ref import TorchAttentionBackend
    from pagedllm.config import ModelConfig
    from pagedllm.model_loader import get_model

    device = torch.device("meta")
    offload = WeightOffloader(budget_bytes, device)
    recorder = _DeviceAllocations("meta")
    builds = iter(["plan", "build"])  # the meta build the layers are chosen from, then the model's
    with monkeypatch.context() as m:
        m.setattr(loader, "_build_model", _labelled(loader._build_model, recorder, lambda *args: next(builds)))
        for name, label in [
            ("adopt", lambda self, model: "load"),  # the real build is done: weights are written next
            ("start", lambda self: "staging"),
        ]:
            m.setattr(WeightOffloader, name, _labelled(getattr(WeightOffloader, name), recorder, label))
        # A host tensor cannot become a meta one (``.data``): count the device copies post-load processing makes
        # of each offloaded layer (one per storage) and let it run on the host copy.
        m.setattr(WeightOffloader, "_to_device", _counted_to_device(recorder))
        model_config = ModelConfig(model=path, dtype="float32")
        with recorder:
            model = get_model(model_config, device, TorchAttentionBackend(), weight_offload=offload)
    return model, offload, recorder.bytes


def _labelled(method, recorder, label):
    """``method``, counting the device allocations from its call on (to the next label) under ``label(*args)``."""

    def wrapper(*args, **kwargs):
        recorder.phase = label(*args)
        return method(*args, **kwargs)

    return wrapper


def _counted_to_device(recorder):
    def to_device(self, layer) -> None:
        recorder.phase = f"layer {layer.index}"
        for _, nbytes in layer.segments:
            torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    return to_device


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (meta ones too)."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def test_loader_builds_and_loads_offloaded_layers_in_host_memory(tiny_llama, reference, monkeypatch):
    """The loader never puts an offloaded layer on the device but for its post-load processing. A meta "device"
    stands in for the GPU: right after loading, the offloaded layer's parameters are host tensors inside its host
    buffer and every other tensor is on the device; building allocated on the device what it allocates without
    offload less that layer's bytes, loading no more than without offload, processing that layer's bytes once (its
    copies, counted: a host tensor cannot turn into a meta one), and staging one slot."""
    _, layer_bytes = reference
    plain, none, plain_bytes = _load_on_meta(tiny_llama, 0, monkeypatch)
    assert none.layers == [] and none.staging == []
    model, offload, got = _load_on_meta(tiny_llama, layer_bytes + layer_bytes // 2, monkeypatch)  # layer 0 of 2
    assert offload.layer_indices == [0]
    host = offload.layers[0].host.untyped_storage().data_ptr()
    for p in model.model.layers[0].parameters():
        assert p.device.type == "cpu" and p.untyped_storage().data_ptr() == host
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith("model.layers.0."):
            assert t.device.type == "meta", name
    layer0 = _storage_bytes(plain.model.layers[0].parameters())  # as built (unaligned)
    assert 0 < layer0 <= layer_bytes
    assert got["build"] == plain_bytes["build"] - layer0
    assert got["load"] <= plain_bytes["load"]
    assert got["layer 0"] == layer0
    assert got["staging"] == layer_bytes == offload.staging_bytes
    assert set(got) <= {"plan", "build", "load", "layer 0", "staging"}


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_quantized_layers_load_into_host_memory(tiny_llama, tmp_path, load_format):
    """GPTQ (act-order): the offloaded layers' packed tensors are created and loaded in host memory and processed
    one layer at a time; greedy tokens as without offload, checkpoint and dummy weights."""
    from tests.quantization.quant_utils import quantize_gptq, write_quantized

    gen = torch.Generator().manual_seed(0)
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    quant_dir, _ = write_quantized(
        tiny_llama, tmp_path / "q", tmp_path / "ref", lambda name, w: quantize_gptq(w, 32, True, gen), qconfig
    )
    outs = []
    for budget in (0, ALL):
        with LLM(quant_dir, load_format=load_format, cpu_offload_gb=budget, **ENGINE) as llm:
            if budget:
                offload = _offloader(llm)
                assert offload.num_layers == 2
                qkv = llm.llm_engine.engine_core.runner.model.model.layers[1].self_attn.qkv_proj
                assert qkv.qweight.untyped_storage().data_ptr() == offload.layers[1].host.untyped_storage().data_ptr()
            outs.append(greedy(llm))
    assert outs[0] == outs[1]


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


@pytest.mark.gpu
def test_gpu_peak_memory_while_loading_drops_by_about_the_budget(tmp_path):
    """On the GPU, with a model whose decoder layers outweigh the rest: the peak device memory while loading
    (``max_memory_allocated``) with 6 of 8 layers offloaded is the all-on-GPU peak less the offloaded bytes, plus
    the two staging slots (and the processing copy of one layer, freed before them); greedy outputs unchanged,
    also with dummy weights."""
    from pagedllm.attention.torch_ref import TorchAttentionBackend
    from pagedllm.config import ModelConfig
    from pagedllm.model_loader import get_model
    from pagedllm.worker.weight_offload import new_offloader
    from tests.utils import make_tiny_model

    path = make_tiny_model(
        "llama", tmp_path / "deep", num_hidden_layers=8, hidden_size=512, intermediate_size=2048
    )
    device = torch.device("cuda")

    def load(budget_layers: int, layer_bytes: int = 0, load_format: str = "auto"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        offload = new_offloader((budget_layers * layer_bytes + 1024) / 2**30, device) if budget_layers else None
        config = ModelConfig(model=path, dtype="bfloat16", load_format=load_format)
        model = get_model(config, device, TorchAttentionBackend(), weight_offload=offload)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        del model
        return peak, offload

    peak_all, _ = load(0)
    with LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True, max_model_len=64) as llm:
        layer = llm.llm_engine.engine_core.runner.model.model.layers[0]
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in layer.parameters()}
        layer_bytes = layer_offload_bytes(list(storages.values()))
        expected = greedy(llm)
    peak, offload = load(6, layer_bytes)
    assert offload.layer_indices == list(range(6))
    assert offload.offloaded_bytes == 6 * layer_bytes and offload.staging_bytes == 2 * layer_bytes
    assert peak <= peak_all - offload.offloaded_bytes + offload.staging_bytes + layer_bytes // 4
    assert peak < peak_all - 3 * layer_bytes
    for load_format in ("auto", "dummy"):
        outs = []
        for budget in (0, (6 * layer_bytes + 1024) / 2**30):
            engine = dict(device="cuda", dtype="bfloat16", enforce_eager=True, max_model_len=64)
            with LLM(path, cpu_offload_gb=budget, load_format=load_format, **engine) as llm:
                outs.append(greedy(llm))
        assert outs[0] == outs[1]
        if load_format == "auto":
            assert outs[0] == expected
