"""Mixtral: Mistral attention (every layer over ``sliding_window`` when set) with a sparse MoE block in place of
the MLP (``block_sparse_moe``: router ``gate`` + ``experts.{e}.w1/w2/w3``; top-k weights renormalised).

Also home of the decoder layer and model body shared by MoE families (``qwen3_moe`` imports them): the Llama
layer with a per-layer choice of MLP module and attribute name.

Tensor parallelism: the attention splits its heads as Llama's; the MoE block splits every expert's intermediate
dim, or with ``enable_expert_parallel`` the experts themselves (``pagedllm.layers.fused_moe``), and all-reduces
its output once. Families whose body sets ``supports_tp = False`` refuse ``tensor_parallel_size > 1``.

Pipeline parallelism: as ``LlamaModel``, a stage builds only its layer range (the MLP of each chosen by its global
layer index), the first stage the embedding, the last the final norm; the rest are ``PPMissingLayer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.layers.fused_moe import EXPERT_PARALLEL_ATTR, FusedMoE
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import get_rope, rope_config
from pagedllm.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    MistralAttention,
    head_dim_of,
)

# (config, layer_idx[, tp]) -> (attribute name of the MLP in the checkpoint, the MLP module); bodies with
# ``supports_tp`` pass this rank's TP group as the third argument
MLPFactory = Callable[..., tuple[str, nn.Module]]


class MoEDecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer (its forward: pre-norm, fused residual adds) with the MLP the model's factory
    builds, stored under the checkpoint's name for it (``block_sparse_moe`` or ``mlp``)."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: nn.Module,  # RotaryEmbedding, or the family's own (DeepSeek's)
        attention_cls: type[nn.Module],  # a LlamaAttention, or the family's own (DeepSeek's MLA)
        make_mlp: MLPFactory,
        tp: TPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its dense MLP is not wanted here
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        tp_kwargs = {} if tp is None else {"tp": tp}
        self.self_attn = attention_cls(config, layer_idx, attn_backend, rotary_emb, **tp_kwargs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_name, mlp = make_mlp(config, layer_idx, *(() if tp is None else (tp,)))
        self.add_module(self.mlp_name, mlp)

    def run_mlp(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> [T, hidden_size]
        return getattr(self, self.mlp_name)(hidden)


class MoEModel(LlamaModel):
    """``LlamaModel`` (same forward, same pipeline-stage layout) whose layers are ``MoEDecoderLayer`` built with
    ``make_mlp`` around the attention ``make_rotary`` rotates."""

    make_mlp: MLPFactory
    supports_tp: bool = False  # True: make_mlp takes the TP group and builds TP-aware blocks

    @staticmethod
    def make_rotary(config: Any) -> nn.Module:
        """The rotary embedding all layers share (a family with its own rope overrides this)."""
        theta, rope_scaling = rope_config(config)
        return get_rope(head_dim_of(config), config.max_position_embeddings, theta, rope_scaling)

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        attention_cls: type[nn.Module],
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build dense MLPs
        if tp is not None and tp.size > 1 and not self.supports_tp:
            raise ValueError(f"{type(self).__name__} does not support tensor_parallel_size > 1 yet")
        layer_tp = tp if self.supports_tp else None
        rotary_emb = self.make_rotary(config)
        make_mlp = type(self).make_mlp
        self.build_stage(
            config,
            lambda i: MoEDecoderLayer(config, i, attn_backend, rotary_emb, attention_cls, make_mlp, layer_tp),
            layer_tp,
            pp,
        )


def expert_parallel(config: Any) -> bool:
    """Whether the engine asked for expert parallelism (``ParallelConfig.enable_expert_parallel``)."""
    return bool(getattr(config, EXPERT_PARALLEL_ATTR, False))


def mixtral_moe(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    return "block_sparse_moe", FusedMoE(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        renormalize=True,
        w13_name="w13",
        w2_name="w2",
        hidden_act=config.hidden_act,
        tp=tp,
        expert_parallel=expert_parallel(config),
        num_experts_field="num_local_experts",
        intermediate_size_field="intermediate_size",
    )


class MixtralModel(MoEModel):
    make_mlp = staticmethod(mixtral_moe)
    supports_tp = True


class MixtralForCausalLM(LlamaForCausalLM):
    attention_cls = MistralAttention  # every layer over sliding_window when the config sets one
    model_cls = MixtralModel
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "w13": ["w1", "w3"],  # experts.{e}.w1 / w3 -> gate / up rows of expert e's slot
    }
