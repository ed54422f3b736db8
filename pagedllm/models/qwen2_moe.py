"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias from ``qkv_bias``) with a sparse MoE MLP
(``mlp.gate`` + ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, softmax then top-k, renormalised when
``norm_topk_prob``) plus one always-on shared expert (``mlp.shared_expert.*``, ``shared_expert_intermediate_size``
wide) whose output is scaled by ``sigmoid(mlp.shared_expert_gate(x))``, a scalar per token. Which layers are
sparse follows Qwen3-MoE's rule (``decoder_sparse_step``, ``mlp_only_layers``); the others keep a dense
``intermediate_size`` MLP.

Under tensor parallelism the shared expert is split like a dense MLP (``gate_up_proj`` column-, ``down_proj``
row-parallel, left unreduced) and its gated partial output is added to the routed experts' partial output before
the block's single all-reduce; ``shared_expert_gate`` (a per-token scalar) is replicated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, layer_types_sliding_window
from pagedllm.models.mixtral import MoEModel
from pagedllm.models.qwen3_moe import dense_mlp, is_sparse_layer, qwen_moe_kwargs


def qwen2_moe_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Only with ``use_sliding_window``; then the layers ``layer_types`` marks, which transformers' Qwen2-MoE
    derives as the even layers (0, 2, ...) below ``max_window_layers`` (the rule used without ``layer_types``)."""
    max_window_layers = getattr(config, "max_window_layers", None)
    default = layer_idx % 2 == 0 and (max_window_layers is None or layer_idx < max_window_layers)
    return layer_types_sliding_window(config, layer_idx, default)


class Qwen2MoeAttention(LlamaAttention):
    layer_sliding_window = staticmethod(qwen2_moe_layer_sliding_window)

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen2MoeSparseMoe(FusedMoE):
    """``FusedMoE`` (routing as Qwen3-MoE: float32 softmax, top-k, optional renormalisation, weights cast to the
    activations' dtype) plus the gated shared expert::

        out = experts(x) + sigmoid(x @ shared_expert_gate.T) * shared_expert(x)      # gate: [1, hidden]
    """

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(**qwen_moe_kwargs(config, tp))
        self.shared_expert = dense_mlp(config, config.shared_expert_intermediate_size, tp)
        self.shared_expert.down_proj.reduce_results = False  # summed with the routed part, then all-reduced once
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)  # replicated

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """This rank's part of the routed experts' output plus its part of the gated shared expert's; the gate
        is a per-token scalar, so it scales each rank's partial sum."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, hidden]
        return super().forward_partial(x) + shared


def qwen2_moe_mlp(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    if not is_sparse_layer(config, layer_idx):
        return "mlp", dense_mlp(config, config.intermediate_size, tp)
    return "mlp", Qwen2MoeSparseMoe(config, tp=tp)


class Qwen2MoeModel(MoEModel):
    make_mlp = staticmethod(qwen2_moe_mlp)
    supports_tp = True


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Llama's ``packed_modules_mapping`` covers all three MLP kinds: ``gate_proj``/``up_proj`` become shards 0/1
    of a dense layer's or the shared expert's ``gate_up_proj``, or of expert e's ``experts.{e}.gate_up_proj``
    slot."""

    attention_cls = Qwen2MoeAttention
    model_cls = Qwen2MoeModel
