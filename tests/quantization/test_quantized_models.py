"""Quantized checkpoints in each published layout load exactly: pagedllm on the quantized checkpoint computes the
same logits (bit for bit) and greedy tokens as on a float checkpoint of the same dequantized weights, which
transformers also decodes identically."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.linear import Linear, UnquantizedLinearMethod
from pagedllm.model_loader import get_model
from tests.quantization.quant_utils import (
    fp8_online_reference,
    quantize_awq,
    quantize_fp8,
    quantize_gptq,
    write_quantized,
)
from tests.utils import hf_greedy, make_tiny_model

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]]
MAX_NEW = 8


def gptq_config(group_size: int, desc_act: bool, v2: bool = False, **extra) -> dict:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": True,
        "damp_percent": 0.01,
        "true_sequential": True,
        **({"checkpoint_format": "gptq_v2"} if v2 else {}),
        **extra,
    }


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def ct_config(strategy: str, acts: dict | None, ignore: list[str], block=None) -> dict:
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False, "strategy": strategy}
    if block is not None:
        weights["block_structure"] = list(block)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


DYNAMIC_TOKEN = {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token", "symmetric": True}
STATIC_TENSOR = {"type": "float", "num_bits": 8, "dynamic": False, "strategy": "tensor", "symmetric": True}


def _fp8_parts(
    strategy, block=None, scale_dtype=torch.float32, scale_name="weight_scale", scalar_shape=(), static=False
):
    def quantize(name: str, w: torch.Tensor):
        q, scale, deq = quantize_fp8(w, strategy, block, scale_dtype)
        if strategy == "tensor":
            scale = scale.reshape(scalar_shape)
        parts = {"weight": q, scale_name: scale}
        if static:
            parts["input_scale"] = torch.tensor(0.01).reshape(scalar_shape)
        return parts, deq

    return quantize


def _skip(names, quantize):
    def wrapped(name: str, w: torch.Tensor):
        return None if any(name.endswith(n) for n in names) else quantize(name, w)

    return wrapped


# case -> (arch, quantizer factory (gen -> quantize(name, w)), quantization_config)
CASES = {
    "gptq-g32": ("qwen2", lambda g: lambda n, w: quantize_gptq(w, 32, False, g), gptq_config(32, False)),
    "gptq-g64-actorder": (
        "llama",
        lambda g: lambda n, w: quantize_gptq(w, 64, True, g),
        gptq_config(64, True),
    ),
    "gptq-g32-actorder": (
        "qwen2",
        lambda g: lambda n, w: quantize_gptq(w, 32, True, g),
        gptq_config(32, True),
    ),
    "gptq-g128": ("llama", lambda g: lambda n, w: quantize_gptq(w, 128, False, g), gptq_config(128, False)),
    "gptq-gall-actorder": (
        "llama",
        lambda g: lambda n, w: quantize_gptq(w, -1, True, g),
        gptq_config(-1, True),
    ),
    "gptq-v2-g32-actorder": (
        "llama",
        lambda g: lambda n, w: quantize_gptq(w, 32, True, g, v2=True),
        gptq_config(32, True, v2=True),
    ),
    "gptq-phi3-fused-actorder": (
        "phi3",
        lambda g: lambda n, w: quantize_gptq(w, 32, True, g),
        gptq_config(32, True),
    ),
    "gptq-not-convert-mlp": (
        "llama",
        lambda g: _skip(("mlp.gate_proj", "mlp.up_proj"), lambda n, w: quantize_gptq(w, 32, True, g)),
        gptq_config(32, True, modules_to_not_convert=["gate_proj", "up_proj"]),
    ),
    "awq-g32": ("qwen2", lambda g: lambda n, w: quantize_awq(w, 32), awq_config(32)),
    "awq-g64": ("llama", lambda g: lambda n, w: quantize_awq(w, 64), awq_config(64)),
    "fp8-tensor-dynamic": (
        "qwen2",
        lambda g: _fp8_parts("tensor"),
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
    ),
    "fp8-tensor-static": (
        "llama",
        lambda g: _fp8_parts("tensor", static=True),
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    ),
    "fp8-block": (
        "llama",
        lambda g: _fp8_parts("block", block=(48, 40), scale_name="weight_scale_inv"),
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [48, 40]},
    ),
    "ct-fp8-channel-dynamic": (
        "qwen2",
        lambda g: _skip(("down_proj",), _fp8_parts("channel", scale_dtype=torch.bfloat16)),
        ct_config("channel", DYNAMIC_TOKEN, ["lm_head", "re:.*down_proj$"]),
    ),
    "ct-fp8-tensor-static": (
        "llama",
        lambda g: _fp8_parts("tensor", scalar_shape=(1,), static=True),
        ct_config("tensor", STATIC_TENSOR, ["lm_head"]),
    ),
    "ct-fp8-block-weight-only": (
        "qwen2",
        lambda g: _fp8_parts("block", block=(32, 48)),
        ct_config("block", None, ["lm_head"], block=(32, 48)),
    ),
}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("float")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "qwen2", "phi3")}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, float_dirs, tmp_path_factory) -> tuple[str, str, str]:
    arch, factory, qconfig = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    quantize = factory(torch.Generator().manual_seed(0))
    quant_dir, ref_dir = write_quantized(float_dirs[arch], root / "quant", root / "ref", quantize, qconfig)
    return request.param, quant_dir, ref_dir


def load(path: str, **kwargs) -> torch.nn.Module:
    model_config = ModelConfig(model=path, dtype="float32", **kwargs)
    return get_model(model_config, torch.device("cpu"), TorchAttentionBackend())


@torch.inference_mode()
def test_dequantized_weights_match_exactly(case):
    name, quant_dir, ref_dir = case
    quant, ref = load(quant_dir), load(ref_dir)
    ref_params = dict(ref.named_parameters())
    num_quantized = 0
    for prefix, module in quant.named_modules():
        if not isinstance(module, Linear):
            continue
        expected = ref_params[f"{prefix}.weight"]
        if isinstance(module.quant_method, UnquantizedLinearMethod):
            got = module.weight
        else:
            num_quantized += 1
            assert "weight" not in module._parameters or module.weight.dtype == torch.float8_e4m3fn
            got = module.quant_method.dequantize(module)
        assert torch.equal(got, expected), f"{name}: {prefix}"
    assert num_quantized >= 4
    x = torch.randn(7, quant.config.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = quant.model.layers[0].self_attn.qkv_proj
    assert torch.equal(layer(x), ref.model.layers[0].self_attn.qkv_proj(x))


def greedy(path: str, **kwargs) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


GREEDY_CASES = (
    "gptq-g32-actorder",
    "gptq-phi3-fused-actorder",
    "awq-g32",
    "fp8-block",
    "ct-fp8-channel-dynamic",
)


def test_greedy_matches_float_reference(case):
    name, quant_dir, ref_dir = case
    if name not in GREEDY_CASES:
        pytest.skip("logits-level check only (test_dequantized_weights_match_exactly)")
    got = greedy(quant_dir)
    assert got == greedy(ref_dir)
    assert got == hf_greedy(ref_dir, PROMPTS, MAX_NEW)
    assert len({tuple(t) for t in got}) > 1


def test_online_fp8_matches_reference(float_dirs, tmp_path):
    src = float_dirs["qwen2"]
    ref = tmp_path / "ref"
    write_quantized(src, tmp_path / "unused", ref, lambda n, w: ({}, fp8_online_reference(w)), None)
    quant = load(src, quantization="fp8")
    ref_model = load(str(ref))
    ref_params = dict(ref_model.named_parameters())
    for prefix, module in quant.named_modules():
        if isinstance(module, Linear):
            assert module.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(module.quant_method.dequantize(module), ref_params[f"{prefix}.weight"]), prefix
    assert greedy(src, quantization="fp8") == greedy(str(ref))


def test_gptq_checkpoint_without_g_idx(float_dirs, tmp_path):
    """desc_act=false checkpoints may omit g_idx: it defaults to i // group_size."""
    quantize = lambda n, w: quantize_gptq(w, 32, False, torch.Generator())  # noqa: E731
    quant_dir, ref_dir = write_quantized(
        float_dirs["llama"], tmp_path / "q", tmp_path / "r", quantize, gptq_config(32, False)
    )
    path = f"{quant_dir}/model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.endswith("g_idx")}
    save_file(tensors, path, metadata={"format": "pt"})
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got, ref = load(quant_dir), load(ref_dir)
    assert torch.equal(
        got.model.layers[1].mlp.down_proj(x.repeat(1, 2)), ref.model.layers[1].mlp.down_proj(x.repeat(1, 2))
    )


def test_strict_loading_still_catches_missing_and_unexpected(float_dirs, tmp_path):
    quantize = lambda n, w: quantize_gptq(w, 32, True, torch.Generator().manual_seed(0))  # noqa: E731
    quant_dir, _ = write_quantized(
        float_dirs["llama"], tmp_path / "q", tmp_path / "r", quantize, gptq_config(32, True)
    )
    path = f"{quant_dir}/model.safetensors"
    tensors = load_file(path)
    scales = tensors.pop("model.layers.0.self_attn.k_proj.scales")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing.*qkv_proj.scales"):
        load(quant_dir)
    tensors["model.layers.0.self_attn.k_proj.scales"] = scales
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected keys.*k_proj.weight"):
        load(quant_dir)


def test_dummy_weights_with_quantization(float_dirs, tmp_path):
    quantize = lambda n, w: quantize_awq(w, 32)  # noqa: E731
    quant_dir, _ = write_quantized(
        float_dirs["llama"], tmp_path / "q", tmp_path / "r", quantize, awq_config(32)
    )
    model = load(quant_dir, load_format="dummy")
    layer = model.model.layers[0].mlp.down_proj
    assert torch.isfinite(layer(torch.randn(2, 128))).all()
    assert not hasattr(layer, "weight")


@pytest.mark.parametrize(
    "qconfig, flag, match",
    [
        ({"quant_method": "bitsandbytes"}, None, "quant_method 'bitsandbytes'"),
        ({"bits": 4}, None, "quant_method is missing"),
        (gptq_config(128, False) | {"bits": 8}, None, "quantization_config.bits"),
        (gptq_config(128, False) | {"sym": False}, None, "quantization_config.sym"),
        (gptq_config(128, False) | {"checkpoint_format": "marlin"}, None, "checkpoint_format"),
        (gptq_config(128, False) | {"lm_head": True}, None, "quantization_config.lm_head"),
        (gptq_config(128, False) | {"group_size": 0}, None, "group_size"),
        (awq_config(128) | {"bits": 3}, None, "quantization_config.bits"),
        (awq_config(128) | {"version": "gemv"}, None, "quantization_config.version"),
        (awq_config(128) | {"zero_point": False}, None, "zero_point"),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, None, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, None, "weight_block_size"),
        (ct_config("group", None, []), None, "weights.strategy"),
        (ct_config("tensor", None, []) | {"format": "pack-quantized"}, None, "quantization_config.format"),
        (ct_config("tensor", None, []) | {"kv_cache_scheme": {"num_bits": 8}}, None, "kv_cache_scheme"),
        (gptq_config(128, False), "awq", "does not match"),
        (None, "gptq", "needs a checkpoint quantized"),
        (None, "int3", "quantization must be one of"),
        (
            gptq_config(32, False, modules_to_not_convert=["q_proj"]),
            None,
            "modules_to_not_convert ignores only some",
        ),
    ],
)
def test_unsupported_configs_fail_at_startup(float_dirs, tmp_path, qconfig, flag, match):
    path = tmp_path / "model"
    shutil.copytree(float_dirs["llama"], path)
    if qconfig is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = qconfig
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load(str(path), quantization=flag)


def test_flag_reaches_the_engine_config(float_dirs):
    from pagedllm.engine.arg_utils import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", float_dirs["llama"], "--quantization", "fp8", "--device", "cpu"])
    config = engine_config_from_args(args)
    assert config.model_config.quantization == "fp8"
    assert config.model_config.quant_config.strategy == "online"
