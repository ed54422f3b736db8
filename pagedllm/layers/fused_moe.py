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

Tensor parallelism (``tp`` of ``T`` ranks, both layouts), as vLLM does it by default: every rank holds every
expert's slice ``r`` of the intermediate dim (``w13[e]``: the gate rows and the up rows of that slice, ``w2[e]``:
the same columns), computes its partial outputs for all tokens, and the block's output is summed over the ranks
(one all-reduce, as a row-parallel layer). ``expert_parallel=True`` (vLLM's ``--enable-expert-parallel``) instead
gives rank ``r`` experts ``[r * E / T, (r + 1) * E / T)`` whole; routing stays global (the router is replicated),
assignments to other ranks' experts are mapped to the invalid local id ``E / T`` and skipped by both expert paths,
and the block's output is all-reduced likewise. The loaders take whole checkpoint tensors and copy this rank's
slice; other ranks' per-expert modules are ``RemoteExpert`` placeholders, whose checkpoint tensors the loader
skips (the stacked layout's loaders cut the expert dim instead). Expert biases split with their weights:
``w13_bias`` with the intermediate units (or experts), ``w2_bias`` is added once, so under the intermediate split
rank 0 holds it and the other ranks zeros (as ``RowParallelLinear``'s bias); under expert parallelism each expert,
and so its bias, lives on one rank. ``forward_partial`` returns this rank's part before the all-reduce (a
subclass adding a shared expert sums its own partial in first).

On CUDA the forward (routing included) reads nothing on the host and its shapes follow the token count alone, so
decode steps run inside CUDA graphs; routing rules added here must keep that (no ``.item()``, ``.tolist()``,
``nonzero``, boolean-mask indexing; tests/models/test_moe.py checks every family's block).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.communicator import all_reduce
from pagedllm.distributed.parallel_state import TPGroup, divide
from pagedllm.distributed.pipeline import PPMissingLayer
from pagedllm.kernels.fused_moe import fused_experts, fused_experts_ref
from pagedllm.layers.linear import Linear, default_weight_loader
from pagedllm.platform import use_fused_kernels

# The attribute of the model's HF config that carries ``ParallelConfig.enable_expert_parallel`` to the MoE layers
# (set by ``make_engine_config``; absent means False).
EXPERT_PARALLEL_ATTR = "enable_expert_parallel"

# MoE architectures (all run under tensor and expert parallelism) -> their config fields for the number of routed
# experts and each expert's intermediate size, which must split over the ranks.
MOE_TP_FIELDS = {
    "MixtralForCausalLM": ("num_local_experts", "intermediate_size"),
    "GptOssForCausalLM": ("num_local_experts", "intermediate_size"),
    "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "DeepseekV2ForCausalLM": ("n_routed_experts", "moe_intermediate_size"),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "moe_intermediate_size"),
}
MOE_TP_ARCHITECTURES = tuple(MOE_TP_FIELDS)


def _check_shape(loaded_weight: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded_weight.shape)}")


class _SliceLoaders:
    """Loaders for one expert's slots when this rank holds intermediate units ``[start, start + size)`` of
    ``full`` (``start = 0, size = full`` without tensor parallelism): checkpoint ``gate``/``up`` ``[full, hidden]``
    (shards 0/1), fused ``gate_up`` ``[2 * full, hidden]``, ``down`` ``[hidden, full]``."""

    def __init__(self, start: int, size: int, full: int) -> None:
        self.start, self.size, self.full = start, size, full

    def w13_shard(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
        """Gate (``shard_id`` 0) or up (1) rows of the ``[2 * size, hidden]`` slot."""
        if shard_id not in (0, 1):
            raise ValueError(f"shard_id {shard_id} out of range for 2 shards")
        _check_shape(loaded_weight, (self.full, param.shape[1]))
        rows = param.data[shard_id * self.size : (shard_id + 1) * self.size]
        default_weight_loader(rows, loaded_weight.narrow(0, self.start, self.size))

    def w13_fused(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """A checkpoint already holding ``[gate; up]`` (``[2 * full, hidden]``)."""
        _check_shape(loaded_weight, (2 * self.full, param.shape[1]))
        for shard_id in (0, 1):
            self.w13_shard(param, loaded_weight.narrow(0, shard_id * self.full, self.full), shard_id)

    def w2(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Columns ``[start, start + size)`` of the checkpoint's ``[hidden, full]``."""
        _check_shape(loaded_weight, (param.shape[0], self.full))
        default_weight_loader(param, loaded_weight.narrow(1, self.start, self.size))


def _deinterleave(t: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] (g0, u0, g1, u1, ...) -> [gate | up]
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


class _StackedLoaders:
    """Loaders for transformers' 3-D GPT-OSS expert tensors (see the module docstring) when this rank holds experts
    ``[expert_start, expert_start + num_experts)`` of ``full_experts`` and, of each, intermediate units
    ``[inter_start, inter_start + inter)`` of ``full_inter`` (everything without tensor parallelism).
    ``owns_down_bias``: this rank adds the down projection's bias (else it holds zeros: the all-reduce adds it
    once)."""

    def __init__(
        self,
        expert_start: int,
        num_experts: int,
        full_experts: int,
        inter_start: int,
        inter: int,
        full_inter: int,
        owns_down_bias: bool,
    ) -> None:
        self.expert_start, self.num_experts, self.full_experts = expert_start, num_experts, full_experts
        self.inter_start, self.inter, self.full_inter = inter_start, inter, full_inter
        self.owns_down_bias = owns_down_bias

    def _gate_up(self, t: torch.Tensor) -> torch.Tensor:
        """``[E, ..., 2 * full]`` (gate/up interleaved) -> this rank's ``[E_r, ..., 2 * inter]`` (gate | up)."""
        t = t.narrow(0, self.expert_start, self.num_experts)
        gate = t[..., 0::2].narrow(-1, self.inter_start, self.inter)
        up = t[..., 1::2].narrow(-1, self.inter_start, self.inter)
        return torch.cat([gate, up], dim=-1)

    def w13(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Checkpoint ``[E, hidden, 2 * full]`` (gate/up interleaved columns) -> ``param: [E_r, 2 * inter, hidden]``."""
        _check_shape(loaded_weight, (self.full_experts, param.shape[2], 2 * self.full_inter))
        default_weight_loader(param, self._gate_up(loaded_weight).transpose(1, 2))

    def w13_bias(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Checkpoint ``[E, 2 * full]`` (interleaved) -> ``param: [E_r, 2 * inter]`` (gate | up)."""
        _check_shape(loaded_weight, (self.full_experts, 2 * self.full_inter))
        default_weight_loader(param, self._gate_up(loaded_weight))

    def w2(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Checkpoint ``[E, full, hidden]`` -> ``param: [E_r, hidden, inter]``."""
        _check_shape(loaded_weight, (self.full_experts, self.full_inter, param.shape[1]))
        rows = loaded_weight.narrow(0, self.expert_start, self.num_experts)  # [E_r, full, hidden]
        default_weight_loader(param, rows.narrow(1, self.inter_start, self.inter).transpose(1, 2))

    def w2_bias(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Checkpoint ``[E, hidden]`` -> ``param: [E_r, hidden]``, or zeros on a rank that does not add it."""
        _check_shape(loaded_weight, (self.full_experts, param.shape[1]))
        if self.owns_down_bias:
            default_weight_loader(param, loaded_weight.narrow(0, self.expert_start, self.num_experts))
        else:
            param.data.zero_()


def _tagged(tensor: torch.Tensor, weight_loader) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)  # shares storage with the stacked tensor
    param.weight_loader = weight_loader
    return param


class _StackedExperts(nn.Module):
    """All experts' weights as transformers' GPT-OSS checkpoints name and lay them out (see the module
    docstring): ``<w13_name>``, ``<w2_name>`` and, with biases, ``<w13_name>_bias`` and ``<w2_name>_bias``."""

    def __init__(
        self,
        w13: torch.Tensor,  # [E_r, 2 * inter_r, hidden]
        w2: torch.Tensor,  # [E_r, hidden, inter_r]
        w13_bias: torch.Tensor | None,  # [E_r, 2 * inter_r]
        w2_bias: torch.Tensor | None,  # [E_r, hidden]
        w13_name: str,
        w2_name: str,
        loaders: _StackedLoaders,
    ) -> None:
        super().__init__()
        self.register_parameter(w13_name, _tagged(w13, loaders.w13))
        self.register_parameter(w2_name, _tagged(w2, loaders.w2))
        if w13_bias is not None:
            self.register_parameter(f"{w13_name}_bias", _tagged(w13_bias, loaders.w13_bias))
        if w2_bias is not None:
            self.register_parameter(f"{w2_name}_bias", _tagged(w2_bias, loaders.w2_bias))


class _ExpertWeight(nn.Module):
    """Holds one expert's view of a stacked tensor as ``weight`` (what the checkpoint name ends with)."""

    def __init__(self, view: torch.Tensor, weight_loader, fused_weight_loader=None) -> None:
        super().__init__()
        weight = nn.Parameter(view, requires_grad=False)  # shares storage with the stacked tensor
        weight.weight_loader = weight_loader
        if fused_weight_loader is not None:
            weight.fused_weight_loader = fused_weight_loader
            weight.num_shards = 2
        self.weight = weight


class _Expert(nn.Module):
    def __init__(
        self,
        w13_view: torch.Tensor,  # [2 * inter_r, hidden]
        w2_view: torch.Tensor,  # [hidden, inter_r]
        w13_name: str,
        w2_name: str,
        loaders: _SliceLoaders,
    ) -> None:
        super().__init__()
        self.add_module(w13_name, _ExpertWeight(w13_view, loaders.w13_shard, loaders.w13_fused))
        self.add_module(w2_name, _ExpertWeight(w2_view, loaders.w2))


class RemoteExpert(PPMissingLayer):
    """An expert another expert-parallel rank holds: no parameters here, and the loader skips its checkpoint
    tensors (as it does those of modules another pipeline stage owns)."""


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
    only). ``hidden_act``: ``"silu"`` or ``"swigluoai"`` (GPT-OSS, with ``swiglu_alpha`` and ``swiglu_limit``).

    ``tp``: the tensor-parallel group (one rank when None); ``expert_parallel``: split the experts over its ranks
    instead of the intermediate dim (see the module docstring). ``num_experts_field`` /
    ``intermediate_size_field``: the config fields named when they do not divide by ``tensor_parallel_size``.
    This rank holds ``w13: [num_local_experts, 2 * local_intermediate_size, hidden]`` and ``w2: [num_local_experts,
    hidden, local_intermediate_size]``."""

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
        tp: TPGroup | None = None,
        expert_parallel: bool = False,
        num_experts_field: str = "num_experts",
        intermediate_size_field: str = "intermediate_size",
    ) -> None:
        super().__init__()
        tp = tp if tp is not None else TPGroup.single()
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
        self.tp = tp
        self.expert_parallel = bool(expert_parallel) and tp.size > 1  # the flag without TP > 1 does nothing
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, tp.size, num_experts_field)
            self.local_intermediate_size = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.local_intermediate_size = divide(intermediate_size, tp.size, intermediate_size_field)
        self.expert_start = tp.rank * self.num_local_experts if self.expert_parallel else 0  # first local expert
        inter_start = 0 if self.expert_parallel else tp.rank * self.local_intermediate_size
        num_local, inter = self.num_local_experts, self.local_intermediate_size
        self.renormalize = renormalize
        self.cast_weights_to_input_dtype = cast_weights_to_input_dtype
        self.activation = "swigluoai" if hidden_act == "swigluoai" else "silu"
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.gate = Linear(hidden_size, num_experts, bias=False)  # router: [E, hidden], replicated
        w13 = torch.empty(num_local, 2 * inter, hidden_size)
        w2 = torch.empty(num_local, hidden_size, inter)
        self.register_buffer("w13", w13, persistent=False)  # [E_r, 2 * inter_r, hidden]
        self.register_buffer("w2", w2, persistent=False)  # [E_r, hidden, inter_r]
        w13_bias = torch.empty(num_local, 2 * inter) if expert_bias else None
        w2_bias = torch.empty(num_local, hidden_size) if expert_bias else None
        self.register_buffer("w13_bias", w13_bias, persistent=False)  # [E_r, 2 * inter_r] (gate | up) or None
        self.register_buffer("w2_bias", w2_bias, persistent=False)  # [E_r, hidden] or None
        if checkpoint_layout == "stacked_interleaved":
            owns_down_bias = self.expert_parallel or tp.is_first_rank
            loaders = _StackedLoaders(
                self.expert_start, num_local, num_experts, inter_start, inter, intermediate_size, owns_down_bias,
            )  # fmt: skip
            self.experts = _StackedExperts(w13, w2, w13_bias, w2_bias, w13_name, w2_name, loaders)
        else:
            loaders = _SliceLoaders(inter_start, inter, intermediate_size)
            start = self.expert_start
            self.experts = nn.ModuleList(
                _Expert(w13[e - start], w2[e - start], w13_name, w2_name, loaders)
                if start <= e < start + num_local
                else RemoteExpert()
                for e in range(num_experts)
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.cast_weights_to_input_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def local_expert_ids(self, ids: torch.Tensor) -> torch.Tensor:  # [T, k] global -> [T, k] local
        """Expert parallelism: global expert ids -> this rank's (``id - expert_start``); experts held elsewhere
        -> ``num_local_experts``, the id both expert paths skip. Identity without expert parallelism. No host
        read (CUDA-graph safe)."""
        if not self.expert_parallel:
            return ids
        local = ids - self.expert_start
        remote = (local < 0) | (local >= self.num_local_experts)
        return local.masked_fill(remote, self.num_local_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return all_reduce(self.forward_partial(x), self.tp)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """This rank's part of the routed experts' output (the whole output with one rank): its intermediate
        slice of every expert (tensor parallelism) or its experts' whole outputs (expert parallelism)."""
        weights, ids = self.route(x)
        ids = self.local_expert_ids(ids)
        options = dict(
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=self.activation,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )
        if use_fused_kernels(x):
            return fused_experts(
                x, self.w13, self.w2, weights, ids, remote_experts=self.expert_parallel, **options
            )
        return fused_experts_ref(x, self.w13, self.w2, weights, ids, **options)  # sorted by expert


def verify_moe_tp_config(hf_config: Any, tp_size: int, enable_expert_parallel: bool) -> None:
    """Start-up check that an MoE model's experts split over ``tp_size`` ranks; ``ValueError`` naming the field.
    Dense models pass untouched. Shared experts (Qwen2-MoE's, DeepSeek's) split like a dense MLP, expert
    parallelism or not."""
    if tp_size <= 1:
        return
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in MOE_TP_FIELDS:
        return
    num_field, inter_field = MOE_TP_FIELDS[arch]
    if enable_expert_parallel:
        num_experts = int(getattr(hf_config, num_field))
        if num_experts % tp_size:
            raise ValueError(
                f"enable_expert_parallel: {num_field} ({num_experts}) must be divisible by "
                f"tensor_parallel_size ({tp_size})"
            )
    else:
        divide(int(getattr(hf_config, inter_field)), tp_size, inter_field)
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)
    if arch == "Qwen2MoeForCausalLM" and shared:
        divide(int(shared), tp_size, "shared_expert_intermediate_size")
    num_shared = getattr(hf_config, "n_shared_experts", None)
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM") and num_shared:
        width = int(num_shared) * int(hf_config.moe_intermediate_size)
        divide(width, tp_size, "n_shared_experts * moe_intermediate_size")
