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

Not supported yet: tensor parallelism, a quantized ``kv_b_proj``, an FP8 KV cache, and V3's multi-token-prediction
layers (checkpoints that ship ``model.layers.{num_hidden_layers}.*`` fail the strict loader).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.mla import MLAAttention
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.fused_moe import FusedMoE, group_limited_topk, noaux_tc_topk
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import rope_config, yarn_factor, yarn_inv_freq, yarn_mscale
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedllm.models.mixtral import MoEDecoderLayer

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
    """MLA projections (checkpoint names as transformers'); the paged attention itself is ``self.attn``."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: DeepseekRotaryEmbedding,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
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
    up_proj/down_proj``, ``mlp.shared_experts.gate_proj/up_proj/down_proj``."""

    def __init__(self, config: Any, noaux_tc: bool) -> None:
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
            self.shared_experts = LlamaMLP(shared)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = super().forward(x)
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


def deepseek_mlp(config: Any, layer_idx: int, noaux_tc: bool) -> tuple[str, nn.Module]:
    if is_moe_layer(config, layer_idx):
        return "mlp", DeepseekMoE(config, noaux_tc)
    return "mlp", LlamaMLP(config)  # dense: intermediate_size, mlp_bias (V2)


# ---------------------------------------------------------------------------------------------- model


class DeepseekV2Model(LlamaModel):
    """Llama's body and forward (pre-norm layers with fused residual adds) with MLA attention and DeepSeek MLPs."""

    noaux_tc = False  # V3 routing

    @staticmethod
    def rope_interleaved(config: Any) -> bool:
        return True  # V2 rotates adjacent pairs (complex multiplication in transformers)

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        attention_cls: type[DeepseekV2Attention],
        tp: TPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        if tp is not None and tp.size > 1:
            raise ValueError(f"{type(self).__name__} does not support tensor_parallel_size > 1 yet")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = deepseek_rope(config, self.rope_interleaved(config))
        make_mlp = functools.partial(deepseek_mlp, noaux_tc=self.noaux_tc)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, i, attn_backend, rotary_emb, attention_cls, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Model(DeepseekV2Model):
    noaux_tc = True

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
        qk_rope_head_dim]`` (the latent and the rope key; see pagedllm/attention/mla.py). The model runner
        allocates these instead of per-head K/V and sizes blocks from them."""
        return [layer.self_attn.attn.kv_cache_shape(num_blocks, block_size) for layer in self.model.layers]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_cls = DeepseekV3Model
