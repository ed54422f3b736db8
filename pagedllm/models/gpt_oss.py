"""GPT-OSS (openai/gpt-oss-20b, -120b), as transformers' ``GptOssForCausalLM``.

Attention: q/k/v/o projections with biases (``attention_bias``), ``head_dim`` from the config, layers alternating
sliding-window and full attention per ``layer_types`` (transformers' default: even layers slide), and attention
sinks: one learned logit per query head (``self_attn.sinks``) in the softmax denominator, handed to the attention
backend as its ``sinks`` option. RoPE with YaRN scaling (``rope_type: yarn``; cos/sin times its
``attention_factor``).

MLP: a mixture of experts in every layer. The router (``mlp.router``, a linear layer with bias) picks the top-k
experts by logit, then a softmax over those k logits gives their weights. Each expert is a clamped SwiGLU with
biases (``swiglu_alpha``, ``swiglu_limit``; see ``pagedllm.kernels.fused_moe``), its weights stored as 3-D tensors
with gate/up interleaved (``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * inter]``, ``gate_up_proj_bias``,
``down_proj`` ``[E, inter, hidden]``, ``down_proj_bias``): ``FusedMoE``'s ``stacked_interleaved`` layout.

Only unquantized checkpoints (what transformers' ``save_pretrained`` writes); the released MXFP4 weights are
refused by the quantization check (``quant_method: mxfp4`` is not supported).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_config
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of, layer_types_sliding_window
from pagedllm.models.mixtral import MoEDecoderLayer, MoEModel

# --- YaRN rotary embedding -------------------------------------------------------------------------------


def yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:  # ([dim // 2] float32, attention_factor)
    """YaRN's frequencies and cos/sin factor, as transformers' ``_compute_yarn_parameters``: the original
    frequency (extrapolation) for dimensions that rotate more than ``beta_fast`` times over the original context,
    the frequency divided by ``factor`` (interpolation) for those rotating fewer than ``beta_slow`` times, a linear
    ramp between (its ends rounded outwards unless ``truncate`` is false, as GPT-OSS sets it)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim // 2]
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class YarnRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` (rotate-half layout, same forward and fused kernel) whose ``[cos | sin]`` table holds
    YaRN frequencies, both halves multiplied by the attention factor (transformers scales cos and sin, so the
    rotated q and k each carry it)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any]) -> None:
        super().__init__(head_dim, max_position, base)  # the plain table, replaced below
        inv_freq, attention_factor = yarn_inv_freq(head_dim, base, rope_scaling, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)  # [max_position]
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor  # [max_position, head_dim]
        self.cos_sin_cache = cos_sin.to(self.cos_sin_cache.device)


def gpt_oss_rope(config: Any) -> RotaryEmbedding:
    theta, scaling = rope_config(config)
    head_dim, max_position = head_dim_of(config), config.max_position_embeddings
    if scaling is not None and scaling["rope_type"] == "yarn":
        return YarnRotaryEmbedding(head_dim, max_position, theta, scaling)
    return get_rope(head_dim, max_position, theta, scaling)


# --- attention -------------------------------------------------------------------------------------------


def gpt_oss_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Per ``layer_types``; transformers' default when a config has none: sliding on even layers (0, 2, ...)."""
    return layer_types_sliding_window(config, layer_idx, default_sliding=layer_idx % 2 == 0)


class GptOssAttention(LlamaAttention):
    """Llama attention with biases on q/k/v/o, this layer's window from ``layer_types``, and ``sinks``
    (``[num_heads]``, a checkpoint weight) passed to the backend."""

    layer_sliding_window = staticmethod(gpt_oss_layer_sliding_window)

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_idx, attn_backend, rotary_emb, tp=tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # [num_heads]
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            attn_backend,
            layer_idx,
            sliding_window=self.layer_sliding_window(config, layer_idx),
            sinks=self.sinks,
        )

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias


# --- MoE -------------------------------------------------------------------------------------------------


class GptOssMoE(FusedMoE):
    """``FusedMoE`` with biased clamped-SwiGLU experts in the stacked checkpoint layout, and GPT-OSS routing:
    ``mlp.router`` (``[E, hidden]`` + bias) logits, top-k of them, softmax over those k (in the logits' dtype, as
    transformers)."""

    def __init__(self, config: Any) -> None:
        super().__init__(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            renormalize=False,
            w13_name="gate_up_proj",
            w2_name="down_proj",
            hidden_act="swigluoai",
            expert_bias=True,
            checkpoint_layout="stacked_interleaved",
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
        )
        del self.gate  # the router is named and shaped differently here
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)  # [E, hidden] + [E]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        top_logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k] each
        return torch.softmax(top_logits, dim=-1), ids


def gpt_oss_mlp(config: Any, layer_idx: int) -> tuple[str, nn.Module]:
    return "mlp", GptOssMoE(config)


class GptOssModel(MoEModel):
    """``MoEModel``'s layers and forward, with the YaRN rotary embedding (``MoEModel`` builds plain ones)."""

    make_mlp = staticmethod(gpt_oss_mlp)

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        tp: TPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if tp is not None and tp.size > 1:
            raise ValueError(f"{type(self).__name__} does not support tensor_parallel_size > 1 yet")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = gpt_oss_rope(config)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, i, attn_backend, rotary_emb, attention_cls, self.make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    model_cls = GptOssModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # experts come stacked already
