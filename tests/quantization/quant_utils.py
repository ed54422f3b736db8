"""Write tiny quantized checkpoints in each published layout, plus the float checkpoint of the very same
dequantized weights (the reference).

The packers here are written from the formats' definitions with numpy bit arithmetic, independently of
``pagedllm.quantization`` (a shared packer would hide a wrong nibble order on both sides).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# nibble j of an AWQ int32 holds output channel 8k + AWQ_PACK_ORDER[j]
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_NAMES += ("qkv_proj", "gate_up_proj")  # Phi-3 checkpoints hold them fused


def _to_int32(packed: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())


def pack_rows_gptq(q: np.ndarray) -> torch.Tensor:
    """``q: [rows, cols]`` uint4 -> ``[rows / 8, cols] int32``: nibble j of row k holds ``q[8k + j]``."""
    out = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint64)
    for j in range(8):
        out |= q[j::8, :].astype(np.uint64) << np.uint64(4 * j)
    return _to_int32(out)


def pack_cols(q: np.ndarray, order: tuple[int, ...]) -> torch.Tensor:
    """``q: [rows, cols]`` uint4 -> ``[rows, cols / 8] int32``: nibble j of column k holds ``q[:, 8k + order[j]]``."""
    out = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint64)
    for j in range(8):
        out |= q[:, order[j] :: 8].astype(np.uint64) << np.uint64(4 * j)
    return _to_int32(out)


def is_linear_weight(name: str) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


# -------------------------------------------------------------------------------------------------- quantizers
# Each takes a float32 weight [out, in] and returns (checkpoint tensors by suffix, dequantized float32 [out, in]).
def quantize_gptq(
    w: torch.Tensor, group_size: int, desc_act: bool, gen: torch.Generator, v2: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    num_groups = math.ceil(in_f / gs)
    if desc_act:  # AutoGPTQ: columns quantized in a permuted order; g_idx[perm[i]] = i // gs
        perm = torch.randperm(in_f, generator=gen)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)
    else:
        g_idx = (torch.arange(in_f) // gs).to(torch.int32)
    scales = torch.empty(num_groups, out_f)
    for g in range(num_groups):
        cols = (g_idx == g).nonzero().flatten()
        scales[g] = w[:, cols].abs().amax(dim=1).clamp_min(1e-4) / 7.0
    scales16 = scales.half()  # [G, out], the published dtype
    s = scales16.float()[g_idx.long()]  # [in, out]
    q = (torch.round(w.t() / s) + 8).clamp(0, 15).to(torch.int64)  # [in, out]
    deq = ((q - 8).float() * s).t().contiguous()  # [out, in]
    zeros = np.full((num_groups, out_f), 8 if v2 else 7, dtype=np.uint8)  # v1 stores zero - 1
    tensors = {
        "qweight": pack_rows_gptq(q.numpy().astype(np.uint8)),
        "qzeros": pack_cols(zeros, tuple(range(8))),
        "scales": scales16,
        "g_idx": g_idx,
    }
    return tensors, deq


def quantize_awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    wg = w.t().reshape(in_f // gs, gs, out_f)  # [G, gs, out]
    lo, hi = wg.amin(dim=1), wg.amax(dim=1)  # [G, out]
    scales16 = ((hi - lo).clamp_min(1e-4) / 15).half()
    s = scales16.float()
    zeros = torch.round(-lo / s).clamp(0, 15)  # [G, out]
    q = (torch.round(wg / s[:, None]) + zeros[:, None]).clamp(0, 15)  # [G, gs, out]
    deq = ((q - zeros[:, None]) * s[:, None]).reshape(in_f, out_f).t().contiguous()  # [out, in]
    q_np = q.reshape(in_f, out_f).to(torch.int64).numpy().astype(np.uint8)
    tensors = {
        "qweight": pack_cols(q_np, AWQ_PACK_ORDER),
        "qzeros": pack_cols(zeros.to(torch.int64).numpy().astype(np.uint8), AWQ_PACK_ORDER),
        "scales": scales16,
    }
    return tensors, deq


def quantize_fp8(
    w: torch.Tensor, strategy: str, block: tuple[int, int] | None = None, scale_dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight e4m3 [out, in], scale as saved, dequantized [out, in])`` for strategy tensor/channel/block."""
    out_f, in_f = w.shape
    if strategy == "tensor":
        scale = (w.abs().max() / 448).reshape(())
        full = scale.expand(out_f, in_f)
    elif strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).to(scale_dtype)  # [out, 1]
        full = scale.float().expand(out_f, in_f)
    else:
        bn, bk = block
        scale = torch.empty(math.ceil(out_f / bn), math.ceil(in_f / bk))
        for r in range(scale.shape[0]):
            for c in range(scale.shape[1]):
                scale[r, c] = w[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk].abs().max() / 448
        full = scale.repeat_interleave(bn, 0)[:out_f].repeat_interleave(bk, 1)[:, :in_f]
    scale = scale.to(scale_dtype)
    full = full.to(scale_dtype).float()
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def fp8_online_reference(w: torch.Tensor) -> torch.Tensor:
    """What ``quantization="fp8"`` makes of a float weight: per-row ``max|w| / 448`` scales (module docstring)."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 448.0
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale[:, None]


# ------------------------------------------------------------------------------------------------ checkpoints
Quantizer = Callable[[str, torch.Tensor], "tuple[dict[str, torch.Tensor], torch.Tensor] | None"]


def write_quantized(
    src: str | Path, dst: str | Path, ref: str | Path, quantize: Quantizer, quantization_config: dict | None
) -> tuple[str, str]:
    """Copy the float checkpoint ``src`` twice: to ``dst`` with each linear weight replaced by what
    ``quantize(module_name, weight)`` returns (suffix -> tensor; None keeps the float weight) and
    ``quantization_config`` in config.json, and to ``ref`` with the dequantized float weights."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    for d in (dst, ref):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        result = quantize(name[: -len(".weight")], tensor.float()) if is_linear_weight(name) else None
        if result is None:
            quantized[name] = dequantized[name] = tensor
            continue
        parts, deq = result
        module = name[: -len(".weight")]
        for suffix, t in parts.items():
            quantized[f"{module}.{suffix}"] = t.contiguous()
        dequantized[name] = deq.to(tensor.dtype)
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst), str(ref)
