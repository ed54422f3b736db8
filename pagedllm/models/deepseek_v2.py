"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and a mixture of experts with shared experts.

Attention (per layer; H heads, P = ``qk_nope_head_dim``, R = ``qk_rope_head_dim``, V = ``v_head_dim``,
L = ``kv_lora_rank``), as transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention``::

    q            = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))   (q_lora_rank None: V2-Lite)
                   -> [T, H, P + R] = [q_nope | q_pe]
    [latent|k_pe] = kv_a_proj_with_mqa(x)                                  [T, L + R]
    latent       = kv_a_layernorm(latent)                                  what the cache keeps, with k_pe
    q_pe, k_pe   rotated (one k_pe shared by all heads)
    keys/values  = kv_b_proj(latent) -> per head [k_nope (P) | v (V)]       (see pagedllm/attention/mla.py)

The cache holds only ``[latent | k_pe]`` per token (:class:`~pagedllm.attention.mla.MLAAttention`); the model
tells the runner so through :meth:`DeepseekV2ForCausalLM.kv_cache_shapes`.

Rotary embedding on the R-wide part, as transformers: DeepSeek rotates *interleaved pairs* ``(x0, x1), (x2, x3),
...`` (V2 always, through complex multiplication; V3 when ``rope_interleave``, its default; otherwise the usual
rotate-half). We write the rotated pairs de-interleaved (``[even | odd]``) for queries and keys alike, which
leaves every dot product, and so the attention, as transformers computes it. YaRN scaling (``rope_type: yarn``)
changes the frequencies and multiplies cos/sin by ``attention_factor``; its ``mscale_all_dim`` also multiplies
the softmax scale ``(P + R) ** -0.5`` by ``yarn_mscale(factor, mscale_all_dim) ** 2``.

MLP: the first ``first_k_dense_replace`` layers are dense (``intermediate_size``); the others (every
``moe_layer_freq``-th, 1 in every released checkpoint and ignored by transformers) a routed MoE
(``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, over
pagedllm/layers/fused_moe.py) plus ``n_shared_experts`` always-on experts run as one dense MLP of
``n_shared_experts * moe_intermediate_size`` and added. Routing: V2 softmax, optionally group-limited
(``topk_method: group_limited_greedy``), weights times ``routed_scaling_factor``; V3 sigmoid with
``e_score_correction_bias`` for selection only ("noaux_tc"), groups by the sum of their best two, weights
renormalised (``norm_topk_prob``) and scaled. See ``group_limited_topk`` / ``noaux_tc_topk``.

Tensor parallelism (T ranks), as vLLM splits MLA: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` column-parallel over
the heads (rank r: heads ``[r * H / T, (r + 1) * H / T)``), ``o_proj`` row-parallel; ``q_a_proj`` and
``kv_a_proj_with_mqa`` (and their norms) are replicated, since the latent and the rope key are per token, not per
head: every rank caches all of them, and attends with its own heads (both MLA paths read ``num_heads`` and the
per-head ``W_UK`` / ``W_UV`` from this rank's ``kv_b_proj``). The routed experts split as the other MoE families'
(intermediate slices, or whole experts with ``enable_expert_parallel``); the shared experts and the dense layers
as a dense TP MLP; the routed and shared partial sums share one all-reduce.

Pipeline parallelism: ``MoEModel``'s stage layout; each layer picks dense or MoE by its global index.

V3's multi-token-prediction layers (``model.layers.{num_hidden_layers}.*`` and after, as DeepSeek-V3 ships them) are
not part of the target: its loader skips them, and speculative decoding with ``method="mtp"`` loads the first as a
draft head (pagedllm/models/deepseek_mtp.py).

Not supported yet: a quantized ``kv_b_proj`` and an FP8 KV cache.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.mla import MLAAttention
from pagedllm.distributed.parallel_state import TPGroup, divide
from pagedllm.distributed.pipeline import is_missing
from pagedllm.layers.fused_moe import FusedMoE, group_limited_topk, noaux_tc_topk
from pagedllm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import rope_config, yarn_factor, yarn_inv_freq, yarn_mscale
from pagedllm.models.deepseek_mtp import is_mtp_tensor
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.mixtral import MoEModel, expert_parallel

_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


# ---------------------------------------------------------------------------------------------- rotary


def deepseek_softmax_scale(config: Any) -> float:
    """``(P + R) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` for scaled rope with
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_config(config)
    if scaling is not None and scaling.get("mscale_all_dim"):
        m = yarn_mscale(yarn_factor(scaling, config.max_position_embeddings), scaling["mscale_all_dim"])
        scale *= m * m
    return scale


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates the ``rotary_dim``-wide rope parts of q (``[T, H, R]``) and of the shared k (``[T, R]``).

    ``interleaved``: pairs ``(x[2i], x[2i+1])`` rotate by frequency i, and come out as ``[rotated evens |
    rotated odds]`` (q and k alike); else pairs ``(x[i], x[i + R/2])`` (rotate-half). The table is float32
    ``[max_position, R]`` = ``[cos | sin] * attention_factor``; rotation runs in float32.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        interleaved: bool,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "default":
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            inv_freq, attention_factor = 1.0 / (base**exponents), 1.0
        elif rope_type == "yarn":
            inv_freq, attention_factor = yarn_inv_freq(rotary_dim, base, rope_scaling, max_position)
        else:
            raise ValueError(f"unsupported rope type {rope_type!r} for DeepSeek; supported: default, yarn")
        freqs = torch.outer(
            torch.arange(max_position, dtype=torch.float32), inv_freq
        )  # [max_position, R / 2]
        cos_sin = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_position, R]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, ..., R]; cos, sin: broadcastable to [T, ..., R / 2]
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if self.interleaved else xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q_pe: torch.Tensor,  # [T, H, R]
        k_pe: torch.Tensor,  # [T, R]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated ([T, H, R], [T, R])
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R / 2] each
        return self._rotate(q_pe, cos[:, None], sin[:, None]), self._rotate(k_pe, cos, sin)


def deepseek_rope(config: Any, interleaved: bool) -> DeepseekRotaryEmbedding:
    theta, scaling = rope_config(config)
    return DeepseekRotaryEmbedding(
        config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling, interleaved
    )


# ---------------------------------------------------------------------------------------------- attention


class DeepseekV2Attention(nn.Module):
    """MLA projections (checkpoint names as transformers'); the paged attention itself is ``self.attn``.

    Under tensor parallelism (``tp``) this rank runs ``num_heads`` = H / T heads: the per-head projections
    (``q_proj`` or ``q_b_proj``, ``kv_b_proj``) column-parallel, ``o_proj`` row-parallel, the rest replicated."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: DeepseekRotaryEmbedding,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp if tp is not None else TPGroup.single()
        hidden = config.hidden_size
        total_num_heads = config.num_attention_heads
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")  # this rank's
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # Per-head weights are [H * width, in] with head h's rows contiguous: a column-parallel split is a split
        # over heads.
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_num_heads * qk_head_dim, bias=False, tp=tp)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)  # replicated
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_num_heads * qk_head_dim, tp=tp)
        # replicated: the latent and the rope key are per token, every rank caches them whole
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        kv_b_width = total_num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, kv_b_width, tp=tp)  # [H_r * (P + V), L]
        self.o_proj = RowParallelLinear(total_num_heads * self.v_head_dim, hidden, bias=bias, tp=tp)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = MLAAttention(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            deepseek_softmax_scale(config),
            attn_backend,
            layer_idx,
        )

    @staticmethod
    def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
        """No layer attends over a window (what the model runner asks a pipeline stage's attention class)."""
        return None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden_size]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, -1)  # [T, H, P + R]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)  # [T, L]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)  # [T, H, R], [T, R]
        o = self.attn(q_nope, q_pe, latent, k_pe, kv_cache, attn_metadata, self.kv_b_proj)  # [T, H, V]
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.v_head_dim))


# ---------------------------------------------------------------------------------------------- MoE


class DeepseekMoE(FusedMoE):
    """``FusedMoE`` with DeepSeek routing (V2: ``group_limited_topk``; V3, ``noaux_tc``: ``noaux_tc_topk`` with
    ``gate.e_score_correction_bias``, float32 as in transformers) and the shared experts added to its output.

    Checkpoint names: ``mlp.gate.weight`` (+ ``mlp.gate.e_score_correction_bias``), ``mlp.experts.{e}.gate_proj/
    up_proj/down_proj``, ``mlp.shared_experts.gate_proj/up_proj/down_proj``.

    Tensor parallelism: the router is replicated, the routed experts split as ``FusedMoE``'s, the shared experts as
    a dense MLP whose unreduced partial output joins the routed one before the block's single all-reduce."""

    def __init__(self, config: Any, noaux_tc: bool, tp: TPGroup | None = None) -> None:
        num_experts = config.n_routed_experts
        super().__init__(
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)) and noaux_tc,
            w13_name="gate_up_proj",
            w2_name="down_proj",
            hidden_act=config.hidden_act,
            tp=tp,
            expert_parallel=expert_parallel(config),
            num_experts_field="n_routed_experts",
            intermediate_size_field="moe_intermediate_size",
        )
        self.noaux_tc = noaux_tc
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", None) or 1.0)
        topk_method = getattr(config, "topk_method", None) or "greedy"
        if not noaux_tc and topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"unsupported DeepSeek-V2 topk_method {topk_method!r}; supported: greedy, group_limited_greedy"
            )
        grouped = noaux_tc or topk_method == "group_limited_greedy"
        self.num_groups = (getattr(config, "n_group", None) or 1) if grouped else 1
        self.topk_group = (getattr(config, "topk_group", None) or self.num_groups) if grouped else 1
        if num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise ValueError(
                f"n_group ({self.num_groups}) must divide n_routed_experts ({num_experts}) and topk_group "
                f"({self.topk_group}) be in 1..n_group"
            )
        if noaux_tc:  # a float32 parameter of the router, as transformers keeps it
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        num_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = None
        if num_shared:
            shared = SimpleNamespace(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * num_shared,
                hidden_act=config.hidden_act,
                mlp_bias=bool(getattr(config, "mlp_bias", False)),
            )
            self.shared_experts = LlamaMLP(shared, tp=tp)
            self.shared_experts.down_proj.reduce_results = False  # summed with the routed part, reduced once

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E], float32 as transformers' router
        if self.noaux_tc:
            return noaux_tc_topk(
                logits,
                self.gate.e_score_correction_bias,
                self.top_k,
                self.num_groups,
                self.topk_group,
                self.renormalize,
                self.routed_scaling_factor,
            )
        return group_limited_topk(
            logits, self.top_k, self.num_groups, self.topk_group, self.routed_scaling_factor
        )

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """This rank's part of the routed experts' output plus its part of the shared experts'."""
        out = super().forward_partial(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Routed experts from layer ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
    freq = getattr(config, "moe_layer_freq", None) or 1
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    return (
        bool(getattr(config, "n_routed_experts", None)) and layer_idx >= first_dense and layer_idx % freq == 0
    )


def deepseek_mlp(
    config: Any, layer_idx: int, noaux_tc: bool, tp: TPGroup | None = None
) -> tuple[str, nn.Module]:
    if is_moe_layer(config, layer_idx):  # by the global layer index, whatever the pipeline stage
        return "mlp", DeepseekMoE(config, noaux_tc, tp=tp)
    return "mlp", LlamaMLP(config, tp=tp)  # dense: intermediate_size, mlp_bias (V2)


def deepseek_v2_mlp(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    return deepseek_mlp(config, layer_idx, noaux_tc=False, tp=tp)


def deepseek_v3_mlp(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    return deepseek_mlp(config, layer_idx, noaux_tc=True, tp=tp)


# ---------------------------------------------------------------------------------------------- model


class DeepseekV2Model(MoEModel):
    """``MoEModel`` (Llama's body and forward: pre-norm layers with fused residual adds, pipeline stages) with MLA
    attention, DeepSeek's rotary embedding and DeepSeek MLPs."""

    make_mlp = staticmethod(deepseek_v2_mlp)
    supports_tp = True

    @staticmethod
    def rope_interleaved(config: Any) -> bool:
        return True  # V2 rotates adjacent pairs (complex multiplication in transformers)

    @classmethod
    def make_rotary(cls, config: Any) -> nn.Module:
        return deepseek_rope(config, cls.rope_interleaved(config))


class DeepseekV3Model(DeepseekV2Model):
    make_mlp = staticmethod(deepseek_v3_mlp)  # V3 routing ("noaux_tc")

    @staticmethod
    def rope_interleaved(config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    attention_cls = DeepseekV2Attention
    model_cls = DeepseekV2Model
    # experts.{e}.gate_proj / up_proj and the dense and shared MLPs' gate_proj / up_proj -> gate_up_proj shards
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Each layer's paged cache for ``num_blocks`` blocks: ``[num_blocks, block_size, kv_lora_rank +
        qk_rope_head_dim]`` (the latent and the rope key; see pagedllm/attention/mla.py), for this pipeline
        stage's layers. The model runner allocates these instead of per-head K/V and sizes blocks from them; every
        tensor-parallel rank holds the whole latent cache."""
        return [
            layer.self_attn.attn.kv_cache_shape(num_blocks, block_size)
            for layer in self.model.layers
            if not is_missing(layer)
        ]

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint names load as they are, except the multi-token-prediction layers stored after the decoder
        layers (None: skipped; the MTP proposer reads them)."""
        return None if is_mtp_tensor(name, self.config.num_hidden_layers) else name


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_cls = DeepseekV3Model
