"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm) with a sparse MoE MLP (``mlp.gate`` + ``mlp.experts.{e}.gate_proj/
up_proj/down_proj``) in the layers ``decoder_sparse_step`` selects and ``mlp_only_layers`` does not exclude; the
others keep a dense ``intermediate_size`` MLP. The top-k weights are renormalised when ``norm_topk_prob``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.mixtral import MoEModel, expert_parallel
from pagedllm.models.qwen3 import Qwen3Attention


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule: MoE unless listed in ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


def dense_mlp(config: Any, intermediate_size: int, tp: TPGroup | None = None) -> LlamaMLP:
    """A dense SwiGLU MLP of ``intermediate_size`` (the Qwen MoE families' dense layers and shared expert)."""
    dense = SimpleNamespace(
        hidden_size=config.hidden_size,
        intermediate_size=intermediate_size,
        hidden_act=config.hidden_act,
        mlp_bias=False,
    )
    return LlamaMLP(dense, tp=tp)


def qwen_moe_kwargs(config: Any, tp: TPGroup | None = None) -> dict[str, Any]:
    """``FusedMoE``'s arguments for the Qwen MoE families (routing, checkpoint names, TP / expert parallel)."""
    return dict(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        w13_name="gate_up_proj",
        w2_name="down_proj",
        cast_weights_to_input_dtype=True,
        hidden_act=config.hidden_act,
        tp=tp,
        expert_parallel=expert_parallel(config),
        num_experts_field="num_experts",
        intermediate_size_field="moe_intermediate_size",
    )


def qwen3_moe_mlp(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    if not is_sparse_layer(config, layer_idx):
        return "mlp", dense_mlp(config, config.intermediate_size, tp)
    return "mlp", FusedMoE(**qwen_moe_kwargs(config, tp))


class Qwen3MoeModel(MoEModel):
    make_mlp = staticmethod(qwen3_moe_mlp)
    supports_tp = True


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Llama's ``packed_modules_mapping`` covers both MLP kinds: ``gate_proj``/``up_proj`` become shards 0/1 of a
    dense layer's ``gate_up_proj`` or of expert e's ``experts.{e}.gate_up_proj`` slot."""

    attention_cls = Qwen3Attention
    model_cls = Qwen3MoeModel
