"""Build a model from its HF config and fill its weights (safetensors checkpoint or dummy values).

Loading is strict: every checkpoint tensor must land in a parameter (or shard of a fused one) and every
parameter must be filled completely, else ``ValueError`` listing the offending names. Checkpoint names are
mapped to our parameters through the model's ``packed_modules_mapping`` (``q_proj`` -> shard 0 of
``qkv_proj``, ...). Parameters shared by two names (tied ``lm_head``/``embed_tokens``) load from either.

Quantized models (``ModelConfig.quant_config``): the model is built with placeholder linear weights, each
``Linear`` then gets its quantization method's parameters (``qweight``, ``scales``, ``weight_scale``, ...; see
``pagedllm.quantization``), the same strict loading fills them (a parameter marked ``optional``, such as
GPTQ's ``g_idx``, may keep its initial value), and each method's ``process_weights_after_loading`` runs last.

FP8 KV-cache scales: per-layer ``k_scale`` / ``v_scale`` tensors (one number each) that vLLM, llm-compressor and
ModelOpt put next to the attention (``model.layers.0.self_attn.k_scale``, ``...self_attn.attn.k_scale``,
``...self_attn.k_proj.k_scale``; the older ``kv_scale`` sets both; compressed-tensors' ``k_proj.output_scale`` /
``v_proj.output_scale`` too) go to that layer's :class:`~pagedllm.layers.attention.Attention` (``set_kv_scales``),
not through the parameter check. They are read whatever ``kv_cache_dtype`` is and used only by an FP8 cache;
layers without them keep 1.0.

Tensor parallelism: ``get_model(..., tp=group)`` builds this rank's part of the model (``pagedllm.distributed``);
each parameter's loader copies only its rank's slice of each checkpoint tensor, read one tensor at a time.

Pipeline parallelism: ``get_model(..., pp=stage)`` builds the stage's modules only; checkpoint tensors of modules
another stage owns (``PPMissingLayer``: other stages' layers, the embedding, norm or LM head) are skipped.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import PPGroup, TPGroup, verify_pp_config, verify_tp_config
from pagedllm.distributed.pipeline import PPMissingLayer
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import Linear, default_weight_loader, deferred_linear_weights
from pagedllm.layers.placement import layers_on_host
from pagedllm.models.registry import get_model_class, get_pooling_model_class

if TYPE_CHECKING:
    from pagedllm.worker.weight_offload import WeightOffloader

# Checkpoint tensors that are derived state, not weights: skipped silently.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_config: ModelConfig,
    device: torch.device,
    attn_backend: AttentionBackend,
    tp: TPGroup | None = None,
    pp: PPGroup | None = None,
    weight_offload: WeightOffloader | None = None,
) -> nn.Module:
    """Instantiate ``hf_config.architectures[0]`` in ``model_config.dtype`` on ``device``, load weights, eval().

    ``tp``: this rank's tensor-parallel group (one rank when None); the config is checked against its size
    first (``ValueError`` naming the field that does not split). ``pp``: this rank's pipeline stage (the whole
    model when None); ``ValueError`` naming ``pipeline_parallel_size`` when the architecture cannot be split.
    ``weight_offload`` (``cpu_offload_gb``): the decoder layers it chooses (from a build on the meta device) are
    built, loaded and kept in host memory, never whole on ``device`` (pagedllm/worker/weight_offload.py)."""
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("the model config names no architecture (config.json 'architectures' is empty)")
    if getattr(model_config, "runner_type", "generate") == "pooling":
        model_cls = get_pooling_model_class(architectures[0])
    else:
        model_cls = get_model_class(architectures[0])
    tp_kwargs = {}
    if tp is not None and tp.size > 1:
        verify_tp_config(hf_config, tp.size)  # quantized methods check their packed sizes per rank
        tp_kwargs["tp"] = tp
    if pp is not None and pp.size > 1:
        verify_pp_config(hf_config, pp.size, pp.partition)
        tp_kwargs["pp"] = pp
    if weight_offload is not None:
        meta_model = _build_model(model_cls, model_config, attn_backend, tp_kwargs, torch.device("meta"))
        weight_offload.plan(meta_model)
        del meta_model
    with layers_on_host(weight_offload.planned if weight_offload is not None else ()):
        model = _build_model(
            model_cls,
            model_config,
            attn_backend,
            tp_kwargs,
            device,
            weight_offload.planned_modules if weight_offload is not None else (),
        )
    if weight_offload is not None:
        weight_offload.adopt(model)  # before loading: the checkpoint is written into the host buffers
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed, device=device)
    else:
        load_weights(model, iter_safetensors(model_config.model_path))
    if weight_offload is None:
        process_weights_after_loading(model)
    else:
        process_weights_after_loading(model, skip=[layer.module for layer in weight_offload.layers])
        weight_offload.process(model, process_weights_after_loading)  # one layer at a time on the device
        weight_offload.start()
    return model.eval()


def _build_model(
    model_cls: type[nn.Module],
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    tp_kwargs: dict,
    device: torch.device,
    host_modules: Sequence[str] = (),
) -> nn.Module:
    """The model with its parameters allocated (not filled) on ``device``; the modules named in ``host_modules``
    (decoder layers weight offload keeps on the host: ``layers_on_host`` is active) get host parameters."""
    hf_config = model_config.hf_config
    quant_config = getattr(model_config, "quant_config", None)
    # A multimodal model is built from its whole config (vision tower, projector, text model).
    build_config = getattr(model_config, "mm_hf_config", None) or hf_config
    with _default_dtype(model_config.dtype), torch.device(device):
        if quant_config is None:
            return model_cls(build_config, attn_backend, **tp_kwargs)
        from pagedllm.quantization import quantize_model

        with deferred_linear_weights():
            model = model_cls(hf_config, attn_backend, **tp_kwargs)
        quantize_model(model, quant_config, host_modules=host_modules)
        return model


def process_weights_after_loading(model: nn.Module, skip: Sequence[nn.Module] = ()) -> None:
    """Once the checkpoint is in: each linear method's post-processing (quantized layouts; on CPU, the
    oneDNN-packed copies of ``layers/cpu_gemm.py``), and the LM head's packing. Modules in ``skip`` (and all
    under them) are left out."""
    skipped = {id(m) for root in skip for m in root.modules()}
    for module in model.modules():
        if id(module) in skipped:
            continue
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, LMHead):
            module.process_weights_after_loading()


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint files: those named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path!r}")
    return files


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu tensor)`` one tensor at a time, file by file."""
    from safetensors import safe_open

    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def _param_aliases(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, str]]:
    """``(canonical name -> parameter, any name -> canonical name)``; tied parameters have two names."""
    params = dict(model.named_parameters())
    canonical_by_id = {id(p): name for name, p in params.items()}
    aliases = {name: canonical_by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    return params, aliases


def _map_name(name: str, packed: dict[str, list[str]]) -> tuple[str, int | None]:
    """Checkpoint name -> (our parameter name, shard index or None)."""
    parts = name.split(".")
    for fused, sources in packed.items():
        for shard_id, source in enumerate(sources):
            if source in parts[:-1]:
                parts[parts.index(source)] = fused
                return ".".join(parts), shard_id
    return name, None


_KV_SCALE_LEAVES = ("k_scale", "v_scale", "kv_scale", "output_scale")


def _kv_scale_target(name: str, attn_layers: dict[str, Attention]) -> tuple[Attention, str] | None:
    """``(attention layer, "k" | "v" | "kv")`` when checkpoint tensor ``name`` is an FP8 KV-cache scale, else None.

    ``<attn>.k_scale`` / ``.v_scale`` / ``.kv_scale`` where ``<attn>`` is the layer or its parent (``self_attn``), or
    the same on ``<attn>.k_proj`` / ``.v_proj`` (``output_scale`` only there)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in _KV_SCALE_LEAVES:
        return None
    base, _, last = prefix.rpartition(".")
    proj = {"k_proj": "k", "v_proj": "v"}.get(last)
    if proj is None:
        base = prefix
    which = {"k_scale": "k", "v_scale": "v"}.get(leaf) or proj or ("kv" if leaf == "kv_scale" else None)
    if which is None:
        return None
    for candidate in (base, f"{base}.attn"):
        if candidate in attn_layers:
            return attn_layers[candidate], which
    return None


def _load_kv_scale(attn: Attention, which: str, tensor: torch.Tensor, ckpt_name: str) -> None:
    if tensor.numel() != 1:
        raise ValueError(
            f"KV-cache scale {ckpt_name!r} has {tensor.numel()} elements; only per-tensor (one number) scales are "
            "supported"
        )
    value = float(tensor.float().reshape(()))
    try:
        attn.set_kv_scales(value if "k" in which else None, value if "v" in which else None)
    except ValueError as e:
        raise ValueError(f"bad KV-cache scale {ckpt_name!r}: {e}") from e


def _owned_by(name: str, modules: set[str]) -> bool:
    """Whether checkpoint tensor ``name`` lies under one of ``modules`` (``model.layers.3.mlp.up_proj.weight`` under
    ``model.layers.3``)."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in modules for i in range(1, len(parts)))


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``; ``ValueError`` on unexpected, missing or mis-shaped ones."""
    params, aliases = _param_aliases(model)
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: dict[str, set[int | None]] = {}  # canonical name -> shards filled
    unexpected: list[str] = []
    attn_layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    absent = {name for name, m in model.named_modules() if isinstance(m, PPMissingLayer)}  # other stages'
    # A model may rename checkpoint tensors, or skip those it does not use (None): pooling models drop an LM
    # head, or the prefix of the task model that wrapped their body (pagedllm/models/bert.py).
    rename = getattr(model, "checkpoint_name", None)
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(_IGNORED_SUFFIXES):
            continue
        if rename is not None:
            ckpt_name = rename(ckpt_name)
            if ckpt_name is None:
                continue
        if absent and _owned_by(ckpt_name, absent):
            continue
        kv_scale = _kv_scale_target(ckpt_name, attn_layers)
        if kv_scale is not None:
            _load_kv_scale(*kv_scale, tensor, ckpt_name)
            continue
        name, shard_id = _map_name(ckpt_name, packed)
        canonical = aliases.get(name)
        if canonical is None:
            unexpected.append(ckpt_name)
            continue
        try:
            shards = load_tensor(params[canonical], params[canonical], tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {ckpt_name!r} into {canonical!r}: {e}") from e
        loaded.setdefault(canonical, set()).update(shards)
    missing = []
    for name, param in params.items():
        num_shards = getattr(param, "num_shards", None)
        expected = {None} if num_shards is None else set(range(num_shards))
        if getattr(param, "optional", False) and name not in loaded:
            continue
        if loaded.get(name, set()) != expected:
            missing.append(name)
    if unexpected or missing:
        raise ValueError(
            "checkpoint does not match the model: "
            f"unexpected keys {sorted(unexpected)}; missing (or partly loaded) parameters {sorted(missing)}"
        )


def load_tensor(
    param: nn.Parameter, target: torch.Tensor, tensor: torch.Tensor, shard_id: int | None
) -> set[int | None]:
    """Copy checkpoint tensor ``tensor`` (shard ``shard_id`` of a fused parameter, or the whole of it) into
    ``target`` through ``param``'s loaders (``target`` is ``param`` itself, or a stand-in of the same shape: a
    meta tensor checks shapes without writing anything). Returns the shards it filled; ``ValueError`` on a shape
    the parameter cannot take."""
    num_shards = getattr(param, "num_shards", None)
    if shard_id is not None:
        param.weight_loader(target, tensor, shard_id)
        return {shard_id}
    if num_shards is not None:  # the checkpoint already holds the fused tensor
        getattr(param, "fused_weight_loader", default_weight_loader)(target, tensor)
        return set(range(num_shards))
    getattr(param, "weight_loader", default_weight_loader)(target, tensor)
    return {None}


@torch.no_grad()
def init_dummy_weights(
    model: nn.Module, seed: int, std: float = 0.02, device: torch.device | str | None = None
) -> None:
    """Random weights, deterministic per ``seed`` and device: N(0, std) matrices, zero biases, unit norms.

    Quantized parameters: random bits for packed integers, N(0, 1) FP8 weights, ``std / 4`` scales (about ``std``
    dequantized); ``optional`` ones (GPTQ's ``g_idx``) keep their valid initial value.

    ``device``: the model's device. Parameters held elsewhere (offloaded decoder layers in host memory) are drawn
    on it from the same generator, in the same order, and copied over: the values do not depend on which layers
    are offloaded. None: each parameter is drawn where it lives."""
    draw_device = None if device is None else torch.device(device)
    if draw_device is not None and draw_device.type == "cuda" and draw_device.index is None:
        draw_device = torch.device("cuda", torch.cuda.current_device())
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "scale" in name.rsplit(".", 1)[-1]:
            param.fill_(std / 4)
            continue
        if getattr(param, "optional", False):
            continue
        if param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        target = param
        if draw_device is not None and param.device.type != draw_device.type:
            target = torch.empty_like(param, device=draw_device)  # one parameter at a time on the device
        gen = generators.get(target.device)
        if gen is None:
            gen = generators[target.device] = torch.Generator(device=target.device).manual_seed(seed)
        if not target.is_floating_point():
            target.random_(-(2**31), 2**31 - 1, generator=gen)
        elif target.dtype.itemsize == 1:  # float8: no normal_ kernel
            target.copy_(torch.randn(target.shape, generator=gen, device=target.device))
        else:
            target.normal_(0.0, std, generator=gen)
        if target is not param:
            param.copy_(target)
