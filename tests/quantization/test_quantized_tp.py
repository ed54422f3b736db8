"""Quantized checkpoints under tensor parallelism (CPU, gloo): each rank holds exactly its slice of every quantized
layer (dequantized, it equals the matching rows / columns of the one-process layer), and ``LLM(...,
tensor_parallel_size=2)`` decodes the same greedy tokens as the one-process quantized model, for GPTQ (with and
without act-order), AWQ, FP8 checkpoints (per-tensor and per-channel scales) and online FP8. Sizes that cannot
be split fail at start-up naming ``tensor_parallel_size``. Pipeline stages (``pipeline_parallel_size=2``) load
quantized checkpoints too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.distributed import TPGroup
from pagedllm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, UnquantizedLinearMethod
from pagedllm.model_loader import get_model
from tests.quantization.quant_utils import quantize_awq, quantize_gptq, write_quantized
from tests.quantization.test_quantized_models import (
    DYNAMIC_TOKEN,
    _fp8_parts,
    _skip,
    awq_config,
    ct_config,
    gptq_config,
)
from tests.utils import make_tiny_model

# tiny dims: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128. Over 2 ranks every column-parallel shard
# is a multiple of 16 and the row-parallel inputs per rank (32 for o_proj, 64 for down_proj) of group size 32.
CASES = {  # name -> (arch, quantizer factory (gen -> quantize(name, w)) or None for online FP8, config)
    "gptq-g32": ("qwen2", lambda g: lambda n, w: quantize_gptq(w, 32, False, g), gptq_config(32, False)),
    "gptq-g32-actorder": (
        "qwen2",
        lambda g: lambda n, w: quantize_gptq(w, 32, True, g),
        gptq_config(32, True),
    ),
    "gptq-phi3-fused-actorder": (
        "phi3",
        lambda g: lambda n, w: quantize_gptq(w, 32, True, g),
        gptq_config(32, True),
    ),
    "gptq-gall-actorder": (
        "llama",
        lambda g: lambda n, w: quantize_gptq(w, -1, True, g),
        gptq_config(-1, True),
    ),
    "awq-g32": ("qwen2", lambda g: lambda n, w: quantize_awq(w, 32), awq_config(32)),
    "fp8-tensor": (
        "qwen2",
        lambda g: _fp8_parts("tensor"),
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
    ),
    "ct-fp8-channel": (
        "qwen2",
        lambda g: _skip(("down_proj",), _fp8_parts("channel", scale_dtype=torch.bfloat16)),
        ct_config("channel", DYNAMIC_TOKEN, ["lm_head", "re:.*down_proj$"]),
    ),
    "fp8-online": ("qwen2", None, None),
}
ENGINE_CASES = ("gptq-g32", "gptq-g32-actorder", "awq-g32", "fp8-tensor", "ct-fp8-channel", "fp8-online")
PROMPTS = [[5, 17, 42, 99, 7], [64, 65, 66, 67, 68, 69, 70]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("float")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "qwen2", "phi3")}


@pytest.fixture(scope="module")
def checkpoints(
    float_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, dict]]:
    """name -> (checkpoint directory, extra LLM / ModelConfig arguments)."""
    out = {}
    for name, (arch, factory, qconfig) in CASES.items():
        if factory is None:
            out[name] = (float_dirs[arch], {"quantization": "fp8"})
            continue
        root = tmp_path_factory.mktemp(name)
        quantize = factory(torch.Generator().manual_seed(0))
        quant_dir, _ = write_quantized(float_dirs[arch], root / "quant", root / "ref", quantize, qconfig)
        out[name] = (quant_dir, {})
    return out


def _load(path: str, tp: TPGroup | None = None, **kwargs) -> torch.nn.Module:
    model_config = ModelConfig(model=path, dtype="float32", **kwargs)
    return get_model(model_config, torch.device("cpu"), TorchAttentionBackend(), tp=tp)


def _expected_slice(full: Linear, part: Linear, weight: torch.Tensor) -> torch.Tensor:
    """The rows / columns of the one-process weight ``[out, in]`` that ``part`` (one rank's layer) holds."""
    if isinstance(part, RowParallelLinear):
        return weight[:, part.tp.rank * part.input_size : (part.tp.rank + 1) * part.input_size]
    if isinstance(part, ColumnParallelLinear):
        rows = [
            weight[offset + start : offset + start + size]
            for offset, start, size in zip(full.shard_offsets, part.shard_slice_starts, part.output_sizes)
        ]
        return torch.cat(rows)
    return weight


def _weight(layer: Linear) -> torch.Tensor:
    if isinstance(layer.quant_method, UnquantizedLinearMethod):
        return layer.weight
    return layer.quant_method.dequantize(layer)


@pytest.mark.parametrize("name", list(CASES))
@torch.inference_mode()
def test_each_rank_holds_its_slice(checkpoints, name: str) -> None:
    path, kwargs = checkpoints[name]
    full = dict(_load(path, **kwargs).named_modules())
    for rank in range(2):
        part = _load(path, TPGroup(rank=rank, size=2), **kwargs)
        num_quantized = 0
        for prefix, layer in part.named_modules():
            if not isinstance(layer, Linear):
                continue
            num_quantized += not isinstance(layer.quant_method, UnquantizedLinearMethod)
            expected = _expected_slice(full[prefix], layer, _weight(full[prefix]))
            assert torch.equal(_weight(layer), expected), f"{name} rank {rank}: {prefix}"
        assert num_quantized >= 4
        o_proj = part.model.layers[0].self_attn.o_proj
        if name == "gptq-g32-actorder":  # row-parallel act-order: whole scales, g_idx of global groups
            assert o_proj.scales.shape == (2, 64) and o_proj.qweight.shape == (4, 64)
            assert torch.equal(o_proj.scales, full["model.layers.0.self_attn.o_proj"].scales)
        if name == "gptq-g32":  # row-parallel: the rank's group of scales, g_idx local
            assert o_proj.scales.shape == (1, 64) and not o_proj.g_idx.any()
        if name == "awq-g32":
            assert o_proj.qweight.shape == (32, 8) and o_proj.scales.shape == (1, 64)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_tp2_greedy_matches_one_process(checkpoints, name: str) -> None:
    path, kwargs = checkpoints[name]
    common = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_model_len": 64, **kwargs}
    expected = _greedy(LLM(path, **common))
    # GPTQ and FP8 engines also schedule asynchronously (the default on CUDA, under TP too)
    asynchronous = name.startswith(("gptq", "fp8"))
    llm = LLM(
        path,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        async_scheduling=asynchronous,
        **common,
    )
    try:
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len({tuple(t) for t in expected}) > 1


@pytest.mark.parametrize("name", ["gptq-g32-actorder", "awq-g32", "ct-fp8-channel", "fp8-online"])
def test_pp2_greedy_matches_one_process(checkpoints, name: str) -> None:
    """Pipeline stages load only their layers' quantized tensors (qweight / scales / zeros / g_idx, FP8 weights
    and scales) and give the one-process model's tokens."""
    path, kwargs = checkpoints[name]
    common = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_model_len": 64, **kwargs}
    expected = _greedy(LLM(path, **common))
    llm = LLM(path, pipeline_parallel_size=2, **common)
    try:
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.engine_core.shutdown()


def _with_quant_config(src: str, dst: Path, qconfig: dict) -> str:
    """A copy of float checkpoint ``src`` claiming ``qconfig``: enough to reach the per-rank size checks, which
    run before any tensor is read."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize(
    "qconfig, match",
    [
        # o_proj: 32 inputs per rank, not a multiple of group_size 64
        (gptq_config(64, False), r"tensor_parallel_size 2.*input size per rank \(32\).*group_size \(64\)"),
        (gptq_config(64, True), r"tensor_parallel_size 2.*input size per rank \(32\).*group_size \(64\)"),
        (awq_config(64), r"input size per rank with tensor_parallel_size 2 \(32\).*group_size \(64\)"),
        ({"quant_method": "fp8", "weight_block_size": [32, 32]}, "block-wise FP8.*tensor_parallel_size > 1"),
    ],
)
def test_sizes_that_do_not_split_fail_at_startup(float_dirs, tmp_path, qconfig: dict, match: str) -> None:
    path = _with_quant_config(float_dirs["qwen2"], tmp_path / "m", qconfig)
    with pytest.raises(ValueError, match=match):
        _load(path, TPGroup(rank=0, size=2))


def test_packed_output_that_does_not_split_fails_at_startup(tmp_path) -> None:
    # intermediate 136: gate/up shards of 68 rows per rank, not a multiple of AWQ's 8 packed outputs
    src = make_tiny_model("qwen2", tmp_path / "float", intermediate_size=136)
    path = _with_quant_config(src, tmp_path / "m", awq_config(-1))
    with pytest.raises(ValueError, match=r"output size 68 .*multiple of 8.*tensor_parallel_size 2"):
        _load(path, TPGroup(rank=0, size=2))
