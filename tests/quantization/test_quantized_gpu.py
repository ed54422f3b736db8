"""Quantized models end to end on CUDA (bf16, the GPU paths: the W4A16 Triton kernel for GPTQ and AWQ, W8A8
``torch._scaled_mm`` for FP8) against the CPU float32 reference of the same dequantized weights: greedy tokens agree
up to the first divergence, where each side's token is in the other's top-5 (vLLM's check_logprobs_close rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.quantization.fp8 import Fp8LinearMethod, quantize_fp8_per_token
from tests.quantization.quant_utils import fp8_online_reference, write_quantized
from tests.quantization.test_quantized_models import CASES, PROMPTS

pytestmark = pytest.mark.gpu

MAX_NEW = 16
TOP_K = 5


def _shared_perm_gptq(name: str, w: torch.Tensor):
    """Act-order with one permutation per input size (what published checkpoints have: q/k/v and gate/up are
    quantized from the same inputs), so the GPU path sorts rows at load and launches once per fused layer."""
    from tests.quantization.quant_utils import quantize_gptq

    return quantize_gptq(w, 32, True, torch.Generator().manual_seed(w.shape[1]))


GPU_CASES = {
    "gptq-g32-actorder-shared": ("llama", lambda g: _shared_perm_gptq, CASES["gptq-g32-actorder"][2]),
    **{
        name: CASES[name]
        for name in (
            "gptq-g32-actorder",  # a permutation per shard: one launch per shard, gathering by g_idx
            "gptq-g128",
            "gptq-v2-g32-actorder",
            "gptq-phi3-fused-actorder",
            "awq-g32",
            "awq-g64",
            "fp8-tensor-dynamic",
            "fp8-tensor-static",
            "fp8-block",  # the dequantize + matmul fallback
            "ct-fp8-channel-dynamic",
            "ct-fp8-tensor-static",
        )
    },
}


class _FakeW8A8(LinearMethod):
    """The W8A8 reference on CPU in float32: activations quantized per token (or statically) exactly as the GPU
    path does, then dequantized; the weight dequantized by the layer's own method."""

    def __init__(self, inner: Fp8LinearMethod) -> None:
        self.inner = inner

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        static = layer.input_scale.max().reshape(1) if self.inner.static_input_scale else None
        x2 = x.reshape(-1, layer.input_size)
        q, scale = quantize_fp8_per_token(x2, static)
        out = F.linear(q.to(torch.float32) * scale, self.inner.dequantize(layer), layer.bias)
        return out.reshape(*x.shape[:-1], layer.output_size).to(x.dtype)


def _emulate_w8a8(llm: LLM) -> int:
    n = 0
    for module in llm.llm_engine.engine_core.runner.model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8LinearMethod) and method.strategy != "block":
            module.quant_method = _FakeW8A8(method)
            n += 1
    return n


def run(
    path: str, device: str, dtype: str, emulate_w8a8: bool = False, **kwargs
) -> tuple[list[list[int]], list[list[set[int]]]]:
    extra = {"block_size": 4}
    if device == "cuda":  # graphs for decode batches of 1..8 (the kernels' decode-sized configs, captured)
        extra = {"kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256, "max_num_seqs": 8}
    llm = LLM(path, dtype=dtype, device=device, **extra, **kwargs)
    if emulate_w8a8:
        assert _emulate_w8a8(llm) > 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    tops = [[set(step) for step in o.outputs[0].logprobs] for o in outs]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return ids, tops


def check_close(got, ref) -> int:
    """Up to the first divergence equal; there each side's token is in the other's top-5. Returns how many tokens
    agree before the divergences."""
    (got_ids, got_tops), (ref_ids, ref_tops) = got, ref
    agree = 0
    for p, (a_seq, b_seq) in enumerate(zip(got_ids, ref_ids, strict=True)):
        for j, (a, b) in enumerate(zip(a_seq, b_seq, strict=True)):
            if a == b:
                agree += 1
                continue
            assert a in ref_tops[p][j], (
                f"prompt {p} step {j}: GPU token {a} not in the reference's top-{TOP_K}"
            )
            assert b in got_tops[p][j], (
                f"prompt {p} step {j}: reference token {b} not in the GPU's top-{TOP_K}"
            )
            break
    return agree


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.utils import make_tiny_model

    root = tmp_path_factory.mktemp("float")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "qwen2", "phi3")}


W8A8 = {"fp8-tensor-dynamic", "fp8-tensor-static", "ct-fp8-channel-dynamic", "ct-fp8-tensor-static"}


def _w8a8_on_this_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_quantized_bf16_cuda_close_to_cpu_float32(name, float_dirs, tmp_path):
    """Weight-only paths against the float32 checkpoint of the dequantized weights; W8A8 ones against the quantized
    checkpoint on CPU in float32 with the same activation quantization emulated (the tiny random models' logits are
    nearly flat: activation quantization alone moves their logprobs by ~0.1, as much as the gaps in the top-5)."""
    arch, factory, qconfig = GPU_CASES[name]
    quantize = factory(torch.Generator().manual_seed(0))
    quant_dir, ref_dir = write_quantized(float_dirs[arch], tmp_path / "q", tmp_path / "r", quantize, qconfig)
    got = run(quant_dir, "cuda", "bfloat16")
    if name in W8A8 and _w8a8_on_this_gpu():
        check_close(got, run(quant_dir, "cpu", "float32", emulate_w8a8=True))
    else:
        agree = check_close(got, run(ref_dir, "cpu", "float32"))
        assert agree >= len(PROMPTS) * MAX_NEW // 2, f"only {agree} tokens agree before the divergences"


def test_online_fp8_cuda_close_to_cpu_reference(float_dirs, tmp_path):
    src = float_dirs["qwen2"]
    got = run(src, "cuda", "bfloat16", quantization="fp8")
    if _w8a8_on_this_gpu():
        check_close(got, run(src, "cpu", "float32", emulate_w8a8=True, quantization="fp8"))
    else:
        ref = tmp_path / "ref"
        write_quantized(src, tmp_path / "unused", ref, lambda n, w: ({}, fp8_online_reference(w)), None)
        check_close(got, run(str(ref), "cpu", "float32"))


def test_gpu_paths_are_taken(float_dirs, tmp_path):
    """The engine's model really runs the fast paths (not the PyTorch twins) on this GPU."""
    from pagedllm.layers.linear import Linear

    cases = {"gptq-g32-actorder-shared": "grouped", "awq-g32": "grouped", "fp8-tensor-dynamic": "w8a8"}
    for name, mode in cases.items():
        arch, factory, qconfig = GPU_CASES[name]
        quantize = factory(torch.Generator().manual_seed(0))
        quant_dir, _ = write_quantized(
            float_dirs[arch], tmp_path / name / "q", tmp_path / name / "r", quantize, qconfig
        )
        llm = LLM(
            quant_dir,
            dtype="bfloat16",
            device="cuda",
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=256,
            enforce_eager=True,
        )
        model = llm.llm_engine.engine_core.runner.model
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        if mode == "w8a8":
            fast = sum(getattr(m, "fp8_w8a8", False) for m in layers)
            if torch.cuda.get_device_capability() < (8, 9):
                fast = len(layers)  # no FP8 matmul on this GPU: the weight-only fallback is expected
        else:
            fast = sum(getattr(m, "w4a16_mode", None) == mode for m in layers)
        assert fast == len(layers), f"{name}: {fast} of {len(layers)} layers on the GPU path"
        if name.startswith("gptq"):
            assert all(m.w4a16_perm is not None for m in layers)
        del llm
        torch.cuda.empty_cache()
