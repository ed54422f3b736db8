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

GPT-OSS options (``checkpoint_layout="stacked_interleaved"``, ``expert_bias``, ``hidden_act="swigluoai"``): its
checkpoints hold each projection of all experts as one 3-D tensor, transposed and with gate/up interleaved, as
transformers' ``GptOssExperts`` keeps them: ``experts.<w13_name>: [E, hidden, 2 * inter]`` (column ``2j`` is gate
unit j, ``2j + 1`` up unit j), ``experts.<w13_name>_bias: [E, 2 * inter]`` (interleaved likewise),
``experts.<w2_name>: [E, inter, hidden]`` and ``experts.<w2_name>_bias: [E, hidden]``. Those are parameters of
one ``experts`` module, again sharing storage with the stacked tensors; their loaders transpose and de-interleave
into the usual ``[gate rows | up rows]`` order, so the kernels see one layout whatever the checkpoint's. Expert
biases (``w13_bias: [E, 2 * inter]``, ``w2_bias: [E, hidden]``) are added before the activation and before the
router weight; the activation choices are in ``pagedllm.kernels.fused_moe``.

Routing follows transformers: softmax over the float32 router logits, top-k, then (``renormalize``, always for
Mixtral, ``norm_topk_prob`` for Qwen3-MoE) the k weights divided by their sum. DeepSeek's grouped rules
(:func:`group_limited_topk` for V2, :func:`noaux_tc_topk` for V3) are functions a model's ``FusedMoE`` subclass
calls from its own ``route``.

On CUDA the forward (routing included) reads nothing on the host and its shapes follow the token count alone, so
decode steps run inside CUDA graphs; routing rules added here must keep that (no ``.item()``, ``.tolist()``,
``nonzero``, boolean-mask indexing; tests/models/test_moe.py checks every family's block).
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


def _deinterleave(t: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] (g0, u0, g1, u1, ...) -> [gate | up]
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleaved_transposed_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Checkpoint ``[E, hidden, 2 * inter]`` (gate/up interleaved columns) -> ``param: [E, 2 * inter, hidden]``."""
    default_weight_loader(param, _deinterleave(loaded_weight).transpose(1, 2))


def _interleaved_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Checkpoint bias ``[E, 2 * inter]`` (interleaved) -> ``param: [E, 2 * inter]`` (gate | up)."""
    default_weight_loader(param, _deinterleave(loaded_weight))


def _transposed_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Checkpoint ``[E, inter, hidden]`` -> ``param: [E, hidden, inter]``."""
    default_weight_loader(param, loaded_weight.transpose(1, 2))


def _tagged(tensor: torch.Tensor, weight_loader) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)  # shares storage with the stacked tensor
    param.weight_loader = weight_loader
    return param


class _StackedExperts(nn.Module):
    """All experts' weights as transformers' GPT-OSS checkpoints name and lay them out (see the module
    docstring): ``<w13_name>``, ``<w2_name>`` and, with biases, ``<w13_name>_bias`` and ``<w2_name>_bias``."""

    def __init__(
        self,
        w13: torch.Tensor,  # [E, 2 * inter, hidden]
        w2: torch.Tensor,  # [E, hidden, inter]
        w13_bias: torch.Tensor | None,  # [E, 2 * inter]
        w2_bias: torch.Tensor | None,  # [E, hidden]
        w13_name: str,
        w2_name: str,
    ) -> None:
        super().__init__()
        self.register_parameter(w13_name, _tagged(w13, _interleaved_transposed_loader))
        self.register_parameter(w2_name, _tagged(w2, _transposed_loader))
        if w13_bias is not None:
            self.register_parameter(f"{w13_name}_bias", _tagged(w13_bias, _interleaved_loader))
        if w2_bias is not None:
            self.register_parameter(f"{w2_name}_bias", _tagged(w2_bias, default_weight_loader))


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


def group_limited_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    num_groups: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 expert ids)
    """DeepSeek-V2 routing, as transformers' ``DeepseekV2TopkRouter``: softmax (float32) over the E experts; with
    ``num_groups`` > 1 ("group_limited_greedy") the experts form ``num_groups`` equal groups, each scored by its
    best expert, and only the best ``topk_group`` groups stay eligible (the others' scores become 0); then top-k
    ("greedy" when ungrouped). The weights are the chosen softmax scores times ``routed_scaling_factor``, not
    renormalised (transformers' V2 ignores ``norm_topk_prob``)."""
    scores = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if num_groups is not None and num_groups > 1:
        grouped = scores.view(scores.shape[0], num_groups, -1)  # [T, G, E / G]
        best_groups = torch.topk(grouped.amax(dim=-1), topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)  # [T, G]
        scores = grouped.masked_fill(~keep[:, :, None], 0.0).view_as(scores)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights * routed_scaling_factor, ids


def noaux_tc_topk(
    router_logits: torch.Tensor,  # [T, E]
    correction_bias: torch.Tensor,  # [E]
    top_k: int,
    num_groups: int | None,
    topk_group: int | None,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 expert ids)
    """DeepSeek-V3 routing ("noaux_tc"), as transformers' ``DeepseekV3TopkRouter``: sigmoid scores (float32); the
    selection reads ``scores + correction_bias``: groups scored by the sum of their two best experts, the best
    ``topk_group`` groups eligible, then top-k among their experts. The weights are the chosen experts' *unbiased*
    scores, divided by their sum (plus 1e-20) when ``renormalize`` (``norm_topk_prob``), times
    ``routed_scaling_factor``."""
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    choice = scores + correction_bias.float()  # [T, E], for selection only
    if num_groups is not None and num_groups > 1:
        grouped = choice.view(choice.shape[0], num_groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best_groups = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)  # [T, G]
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, top_k]
    weights = scores.gather(1, ids)  # [T, top_k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class FusedMoE(nn.Module):
    """``out = sum_k weight_k * expert_{id_k}(x)`` with ``expert_e(x) = (silu(x @ W1_e.T) * (x @ W3_e.T)) @ W2_e.T``.

    ``w13_name`` / ``w2_name``: the checkpoint's per-expert module names after the model's
    ``packed_modules_mapping`` (Mixtral ``w13``/``w2`` from ``w1, w3``/``w2``; Qwen3-MoE ``gate_up_proj`` /
    ``down_proj``), or with ``checkpoint_layout="stacked_interleaved"`` the names of the 3-D tensors under
    ``experts`` (GPT-OSS ``gate_up_proj`` / ``down_proj``). ``cast_weights_to_input_dtype``: Qwen3-MoE casts the
    float32 router weights to the activations' dtype before scaling the expert outputs; Mixtral keeps them
    float32 (both as transformers). ``expert_bias``: each expert's two projections have biases (stacked layout
    only). ``hidden_act``: ``"silu"`` or ``"swigluoai"`` (GPT-OSS, with ``swiglu_alpha`` and ``swiglu_limit``)."""

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
        expert_bias: bool = False,
        checkpoint_layout: str = "per_expert",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish", "swigluoai"):
            raise ValueError(f"unsupported MoE hidden_act {hidden_act!r}; supported: 'silu', 'swigluoai'")
        if checkpoint_layout not in ("per_expert", "stacked_interleaved"):
            raise ValueError(f"unknown MoE checkpoint_layout {checkpoint_layout!r}")
        if expert_bias and checkpoint_layout != "stacked_interleaved":
            raise ValueError("expert biases are supported with checkpoint_layout='stacked_interleaved' only")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.cast_weights_to_input_dtype = cast_weights_to_input_dtype
        self.activation = "swigluoai" if hidden_act == "swigluoai" else "silu"
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.gate = Linear(hidden_size, num_experts, bias=False)  # router: [E, hidden]
        w13 = torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        w2 = torch.empty(num_experts, hidden_size, intermediate_size)
        self.register_buffer("w13", w13, persistent=False)  # [E, 2 * inter, hidden]
        self.register_buffer("w2", w2, persistent=False)  # [E, hidden, inter]
        w13_bias = torch.empty(num_experts, 2 * intermediate_size) if expert_bias else None
        w2_bias = torch.empty(num_experts, hidden_size) if expert_bias else None
        self.register_buffer("w13_bias", w13_bias, persistent=False)  # [E, 2 * inter] (gate | up) or None
        self.register_buffer("w2_bias", w2_bias, persistent=False)  # [E, hidden] or None
        if checkpoint_layout == "stacked_interleaved":
            self.experts = _StackedExperts(w13, w2, w13_bias, w2_bias, w13_name, w2_name)
        else:
            self.experts = nn.ModuleList(
                _Expert(w13[e], w2[e], w13_name, w2_name) for e in range(num_experts)
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.cast_weights_to_input_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.route(x)
        options = dict(
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=self.activation,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )
        if use_fused_kernels(x):
            return fused_experts(x, self.w13, self.w2, weights, ids, **options)
        return fused_experts_ref(x, self.w13, self.w2, weights, ids, **options)  # sorted by expert
