"""Mixture-of-experts MLP: a router (gate linear -> softmax -> top-k) and SiLU-GLU experts held stacked.

Experts live in two stacked tensors, ``w13: [num_experts, 2 * inter, hidden]`` (gate rows, then up rows) and
``w2: [num_experts, hidden, inter]``, which the forward hands whole to ``pagedllm.kernels.fused_moe``. Checkpoints
hold one tensor per expert and projection (``experts.{e}.w1/w3/w2`` in Mixtral, ``experts.{e}.gate_proj/
up_proj/down_proj`` in Qwen3-MoE; what transformers' ``save_pretrained`` writes). Each expert therefore exposes
its slot of the stacked tensors as parameters under those names (``experts.{e}.<w13_name>.weight``, a
two-shard view into ``w13[e]``, and ``experts.{e}.<w2_name>.weight``, a view of ``w2[e]``): the model's
``packed_modules_mapping`` sends ``w1``/``w3`` (or ``gate_proj``/``up_proj``) to shards 0/1 of the first, the
loader copies each checkpoint tensor into its slot and checks that every slot got filled. The stacked tensors
themselves are non-persistent buffers sharing that storage, so the weights exist once.

Routing follows transformers: softmax over the float32 router logits, top-k, then (``renormalize``, always for
Mixtral, ``norm_topk_prob`` for Qwen3-MoE) the k weights divided by their sum.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.fused_moe import fused_experts, fused_experts_ref
from pagedllm.layers.linear import Linear, default_weight_loader
from pagedllm.platform import use_fused_kernels


def _stacked_shard_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
    """Load gate (``shard_id`` 0) or up (1) rows of one expert's ``[2 * inter, hidden]`` slot."""
    rows = param.shape[0] // 2
    default_weight_loader(param.data[shard_id * rows : (shard_id + 1) * rows], loaded_weight)


def _stacked_fused_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    default_weight_loader(param, loaded_weight)


class _ExpertWeight(nn.Module):
    """Holds one expert's view of a stacked tensor as ``weight`` (what the checkpoint name ends with)."""

    def __init__(self, view: torch.Tensor, num_shards: int | None) -> None:
        super().__init__()
        weight = nn.Parameter(view, requires_grad=False)  # shares storage with the stacked tensor
        if num_shards is None:
            weight.weight_loader = default_weight_loader
        else:
            weight.weight_loader = _stacked_shard_loader
            weight.fused_weight_loader = _stacked_fused_loader
            weight.num_shards = num_shards
        self.weight = weight


class _Expert(nn.Module):
    def __init__(self, w13_view: torch.Tensor, w2_view: torch.Tensor, w13_name: str, w2_name: str) -> None:
        super().__init__()
        self.add_module(w13_name, _ExpertWeight(w13_view, num_shards=2))
        self.add_module(w2_name, _ExpertWeight(w2_view, num_shards=None))


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 expert ids)
    """softmax (float32) -> top-k -> optional renormalisation, in transformers' order."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """``out = sum_k weight_k * expert_{id_k}(x)`` with ``expert_e(x) = (silu(x @ W1_e.T) * (x @ W3_e.T)) @ W2_e.T``.

    ``w13_name`` / ``w2_name``: the checkpoint's per-expert module names after the model's
    ``packed_modules_mapping`` (Mixtral ``w13``/``w2`` from ``w1, w3``/``w2``; Qwen3-MoE ``gate_up_proj`` /
    ``down_proj``). ``cast_weights_to_input_dtype``: Qwen3-MoE casts the float32 router weights to the
    activations' dtype before scaling the expert outputs; Mixtral keeps them float32 (both as transformers)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        w13_name: str = "w13",
        w2_name: str = "w2",
        cast_weights_to_input_dtype: bool = False,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported MoE hidden_act {hidden_act!r}; supported: 'silu'")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.cast_weights_to_input_dtype = cast_weights_to_input_dtype
        self.gate = Linear(hidden_size, num_experts, bias=False)  # router: [E, hidden]
        w13 = torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        w2 = torch.empty(num_experts, hidden_size, intermediate_size)
        self.register_buffer("w13", w13, persistent=False)  # [E, 2 * inter, hidden]
        self.register_buffer("w2", w2, persistent=False)  # [E, hidden, inter]
        self.experts = nn.ModuleList(_Expert(w13[e], w2[e], w13_name, w2_name) for e in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.cast_weights_to_input_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.route(x)
        if use_fused_kernels(x):
            return fused_experts(x, self.w13, self.w2, weights, ids)
        return fused_experts_ref(x, self.w13, self.w2, weights, ids)  # sorted by expert, one GEMM pair each
