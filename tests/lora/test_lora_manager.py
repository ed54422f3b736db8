"""LoRARequest validation, adapter loading (mapping onto fused layers, scaling, errors), LoRAManager slots and
LRU caches, and LoRAMapping's grouping by slot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.lora.adapter import LayerShape, load_peft_adapter
from pagedllm.lora.layers import LoRAMapping
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model_loader import get_model
from tests.lora.lora_utils import make_peft_adapter

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def llama_model(tiny_llama):
    return get_model(
        ModelConfig(model=tiny_llama, dtype="float32"), torch.device("cpu"), TorchAttentionBackend()
    )


@pytest.fixture
def manager_of(tiny_llama):
    def make(**kwargs) -> LoRAManager:
        model = get_model(
            ModelConfig(model=tiny_llama, dtype="float32"), torch.device("cpu"), TorchAttentionBackend()
        )
        kwargs.setdefault("max_lora_rank", 16)
        kwargs.setdefault("max_num_tokens", 64)
        return LoRAManager(model, **kwargs)

    return make


def llama_shapes() -> dict[str, LayerShape]:
    shapes = {}
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes[f"{attn}.qkv_proj"] = LayerShape(64, (64, 32, 32))
        shapes[f"{attn}.o_proj"] = LayerShape(64, (64,))
        shapes[f"{mlp}.gate_up_proj"] = LayerShape(64, (128, 128))
        shapes[f"{mlp}.down_proj"] = LayerShape(128, (64,))
    return shapes


def raw(adapter_dir: str, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    prefix = f"base_model.model.{module}"
    return tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]


def edited_copy(src: str, dst: Path, **config_changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


# ------------------------------------------------------------------------------------------ LoRARequest


def test_lora_request_fields_and_validation() -> None:
    req = LoRARequest("sql", 3, "/adapters/sql")
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("sql", 3, "/adapters/sql")
    assert req == LoRARequest(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")
    assert req.adapter_id == 3 and req.name == "sql" and req.path == "/adapters/sql"
    assert len({req, LoRARequest("sql", 3, "/adapters/sql")}) == 1
    for bad_id in (0, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("sql", bad_id, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("sql", 1, "")


# ------------------------------------------------------------------------------------------ loading


def test_adapter_maps_onto_fused_layers_with_scaling(lora_adapters) -> None:
    adapters = lora_adapters["llama"]
    lora = load_peft_adapter(adapters["all"], 2, llama_shapes(), PACKED, max_lora_rank=16)
    assert lora.rank == 16 and len(lora.layers) == 8
    qkv = lora.layers["model.layers.1.self_attn.qkv_proj"]
    for shard, name in enumerate(["q_proj", "k_proj", "v_proj"]):
        a, b = raw(adapters["all"], f"model.layers.1.self_attn.{name}")
        torch.testing.assert_close(qkv[shard][0], a, atol=0, rtol=0)
        torch.testing.assert_close(qkv[shard][1], b * (8 / 16), atol=0, rtol=0)  # alpha / r
    gate_up = lora.layers["model.layers.0.mlp.gate_up_proj"]
    torch.testing.assert_close(gate_up[1][0], raw(adapters["all"], "model.layers.0.mlp.up_proj")[0])

    rs = load_peft_adapter(adapters["rs"], 3, llama_shapes(), PACKED, max_lora_rank=16)
    qkv = rs.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv[0] is None  # q not targeted
    _, b = raw(adapters["rs"], "model.layers.0.self_attn.v_proj")
    torch.testing.assert_close(qkv[2][1], b * (8 / math.sqrt(4)), atol=0, rtol=0)  # rsLoRA: alpha / sqrt(r)
    assert "model.layers.0.self_attn.o_proj" not in rs.layers

    pattern = load_peft_adapter(adapters["pattern"], 4, llama_shapes(), PACKED, max_lora_rank=16)
    a, b = raw(adapters["pattern"], "model.layers.1.mlp.down_proj")
    assert a.shape[0] == 2
    torch.testing.assert_close(pattern.layers["model.layers.1.mlp.down_proj"][0][1], b * (12 / 2))
    _, b = raw(adapters["pattern"], "model.layers.0.self_attn.o_proj")
    torch.testing.assert_close(pattern.layers["model.layers.0.self_attn.o_proj"][0][1], b * (3 / 8))


def test_load_errors(lora_adapters, tiny_llama, tmp_path) -> None:
    good = lora_adapters["llama"]["attn"]
    shapes = llama_shapes()

    def load(path, max_rank=16):
        return load_peft_adapter(str(path), 1, shapes, PACKED, max_lora_rank=max_rank)

    with pytest.raises(ValueError, match="not a directory"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        load(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(Path(good) / "adapter_config.json", no_weights)
    with pytest.raises(ValueError, match="no weights file"):
        load(no_weights)
    with pytest.raises(ValueError, match="rank 8 > max_lora_rank 4"):
        load(good, max_rank=4)
    for field, value, message in [
        ("use_dora", True, "DoRA"),
        ("bias", "all", "bias='all'"),
        ("bias", "lora_only", "bias='lora_only'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("lora_bias", True, "lora_bias"),
        ("peft_type", "IA3", "peft_type"),
    ]:
        with pytest.raises(ValueError, match=message):
            load(edited_copy(good, tmp_path / f"{field}_{value}", **{field: value}))


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj", "lm_head"], "lm_head"),
        (["embed_tokens"], "embedding LoRA"),
        (["q_proj", "embed_tokens"], "embedding LoRA"),
    ],
)
def test_unsupported_targets_are_refused(tiny_llama, tmp_path, targets, message) -> None:
    path = make_peft_adapter(tiny_llama, tmp_path / "bad", seed=0, r=4, lora_alpha=8, target_modules=targets)
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(path, 1, llama_shapes(), PACKED, max_lora_rank=16)
    # also caught from the weights alone, when the config lists nothing useful
    edited = edited_copy(path, tmp_path / "edited", target_modules="q_proj|lm_head|embed_tokens")
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(edited, 1, llama_shapes(), PACKED, max_lora_rank=16)


# ------------------------------------------------------------------------------------------ manager


def test_slots_lru_and_weights(manager_of, lora_adapters) -> None:
    paths = lora_adapters["llama"]
    a, b, c = (LoRARequest(n, i, paths[n]) for i, n in [(1, "attn"), (2, "all"), (3, "rs")])
    manager = manager_of(max_loras=2)
    assert manager.activate([a, None, b, a]) == [0, -1, 1, 0]
    assert manager.activate([a]) == [0]  # a is now the most recently used slot
    assert manager.activate([c, a]) == [1, 0]  # c evicts b (least recently used, not in this step)
    assert manager.slot_of(2) is None and manager.slot_of(3) == 1
    assert manager.activate([b, c]) == [0, 1]  # a is LRU now
    with pytest.raises(ValueError, match="3 distinct LoRA adapters in one step > max_loras 2"):
        manager.activate([a, b, c])

    # slot contents: zero-padded ranks, scaling folded into B, untargeted layers cleared on reuse
    qkv = manager.layers["model.layers.0.self_attn.qkv_proj"]
    down = manager.layers["model.layers.0.mlp.down_proj"]
    slot_c = manager.slot_of(3)  # rs: r=4, k/v + up/down
    assert qkv.lora_a[slot_c, 0:16].abs().sum() == 0  # q slice empty
    ka, kb = raw(paths["rs"], "model.layers.0.self_attn.k_proj")
    torch.testing.assert_close(qkv.lora_a[slot_c, 16:20], ka, atol=0, rtol=0)
    assert qkv.lora_a[slot_c, 20:32].abs().sum() == 0
    torch.testing.assert_close(qkv.lora_b[slot_c, 64:96, :4], kb * 4.0, atol=0, rtol=0)
    assert qkv.lora_b[slot_c, :, 4:].abs().sum() == 0
    assert down.lora_b[slot_c].abs().sum() > 0
    manager.remove_lora(2)
    assert manager.activate([a]) == [manager.slot_of(1)]
    assert manager.activate([c, a])[0] == slot_c
    manager.remove_lora(3)  # frees slot_c and clears it
    assert qkv.lora_a[slot_c].abs().sum() == 0 and down.lora_b[slot_c].abs().sum() == 0
    slot_a = manager.slot_of(1)
    assert manager.activate([LoRARequest("attn", 1, paths["attn"])]) == [slot_a]
    assert down.lora_b[slot_a].abs().sum() == 0  # attention-only adapter: MLP slot stays empty
    assert manager.list_loras() == {1}


def test_host_cache_lru(manager_of, lora_adapters) -> None:
    paths = lora_adapters["llama"]
    reqs = [LoRARequest(n, i + 1, paths[n]) for i, n in enumerate(["attn", "all", "rs", "pattern"])]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        manager_of(max_loras=2, max_cpu_loras=1)
    manager = manager_of(max_loras=1, max_cpu_loras=2)
    assert manager.add_lora(reqs[0]) and manager.add_lora(reqs[1])
    assert not manager.add_lora(reqs[0])  # cached; now most recently used
    assert manager.add_lora(reqs[2])  # evicts id 2
    assert manager.list_loras() == {1, 3}
    assert manager.activate([reqs[3]]) == [0]  # loads id 4 from disk, evicts id 1 from the host cache
    assert manager.list_loras() == {3, 4}
    with pytest.raises(ValueError, match="lora_int_id 3 is already used"):
        manager.add_lora(LoRARequest("other", 3, paths["all"]))
    with pytest.raises(ValueError, match="rank 16 > max_lora_rank 8"):
        manager_of(max_loras=1, max_lora_rank=8).activate([reqs[1]])


# ------------------------------------------------------------------------------------------ mapping


def test_mapping_groups_tokens_by_slot() -> None:
    mapping = LoRAMapping(max_num_tokens=10, max_loras=4)
    slots = LoRAMapping.token_slots_of([-1, 2, 0, -1, 2], [1, 2, 2, 1, 1])
    assert slots.tolist() == [-1, 2, 2, 0, 0, -1, 2]
    mapping.update(slots)
    assert mapping.apply_lora and mapping.num_tokens == 7
    assert mapping.token_slots.tolist() == [-1, 2, 2, 0, 0, -1, 2, -1, -1, -1]
    assert mapping.slot_num_tokens.tolist() == [2, 0, 3, 0]
    assert mapping.slot_start.tolist() == [0, 2, 2, 5]
    assert mapping.sorted_token_ids[:5].tolist() == [3, 4, 1, 2, 6]
    buffers = [t.data_ptr() for t in (mapping.token_slots, mapping.sorted_token_ids, mapping.slot_num_tokens)]
    mapping.update(np.full(3, -1))
    assert not mapping.apply_lora and mapping.slot_num_tokens.tolist() == [0, 0, 0, 0]
    assert mapping.token_slots.tolist() == [-1] * 10
    mapping.update([-1], force_apply=True)
    assert mapping.apply_lora
    assert buffers == [
        t.data_ptr() for t in (mapping.token_slots, mapping.sorted_token_ids, mapping.slot_num_tokens)
    ]
    with pytest.raises(ValueError, match="token slots"):
        mapping.update([0, 4])
    with pytest.raises(ValueError, match="max_num_tokens"):
        mapping.update([0] * 11)
