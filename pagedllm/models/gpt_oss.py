"""GPT-OSS (openai/gpt-oss-20b, -120b), as transformers' ``GptOssForCausalLM``.

Attention: q/k/v/o projections with biases (``attention_bias``), ``head_dim`` from the config, layers alternating
sliding-window and full attention per ``layer_types`` (transformers' default: even layers slide), and attention
sinks: one learned logit per query head (``self_attn.sinks``) in the softmax denominator, handed to the attention
backend as its ``sinks`` option. RoPE with YaRN scaling (``rope_type: yarn``; cos/sin times its
``attention_factor``; ``get_rope`` builds it).

MLP: a mixture of experts in every layer. The router (``mlp.router``, a linear layer with bias) picks the top-k
experts by logit, then a softmax over those k logits gives their weights. Each expert is a clamped SwiGLU with
biases (``swiglu_alpha``, ``swiglu_limit``; see ``pagedllm.kernels.fused_moe``), its weights stored as 3-D tensors
with gate/up interleaved (``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * inter]``, ``gate_up_proj_bias``,
``down_proj`` ``[E, inter, hidden]``, ``down_proj_bias``): ``FusedMoE``'s ``stacked_interleaved`` layout.

Tensor parallelism: the attention splits its heads as Llama's, each rank keeping its query heads' sinks; the experts
split as the other MoE families' (every expert's intermediate slice, or with ``enable_expert_parallel`` whole
experts), their biases with them (``pagedllm.layers.fused_moe``); the router is replicated.

Only unquantized checkpoints (what transformers' ``save_pretrained`` writes); the released MXFP4 weights are
refused by the quantization check (``quant_method: mxfp4`` is not supported).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.attention import Attention
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear, default_weight_loader
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, layer_types_sliding_window
from pagedllm.models.mixtral import MoEModel, expert_parallel

# --- attention -------------------------------------------------------------------------------------------


def gpt_oss_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Per ``layer_types``; transformers' default when a config has none: sliding on even layers (0, 2, ...)."""
    return layer_types_sliding_window(config, layer_idx, default_sliding=layer_idx % 2 == 0)


class GptOssAttention(LlamaAttention):
    """Llama attention with biases on q/k/v/o, this layer's window from ``layer_types``, and ``sinks``
    (``[num_heads]``, this rank's query heads' entries of the checkpoint weight) passed to the backend."""

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
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # [num_heads] (this rank's)
        self.sinks.weight_loader = self.sinks_loader
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

    def sinks_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Checkpoint ``[total_num_heads]`` -> this rank's query heads ``[num_heads]`` (rank r: heads
        ``[r * H / T, (r + 1) * H / T)``, as ``qkv_proj`` splits them)."""
        total = self.qkv_proj.total_num_heads
        if tuple(loaded_weight.shape) != (total,):
            raise ValueError(f"shape mismatch: parameter ({total},) vs checkpoint {tuple(loaded_weight.shape)}")
        start = self.qkv_proj.tp.rank * self.num_heads
        default_weight_loader(param, loaded_weight.narrow(0, start, self.num_heads))


# --- MoE -------------------------------------------------------------------------------------------------


class GptOssMoE(FusedMoE):
    """``FusedMoE`` with biased clamped-SwiGLU experts in the stacked checkpoint layout, and GPT-OSS routing:
    ``mlp.router`` (``[E, hidden]`` + bias) logits, top-k of them, softmax over those k (in the logits' dtype, as
    transformers). The router is replicated under tensor parallelism."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
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
            tp=tp,
            expert_parallel=expert_parallel(config),
            num_experts_field="num_local_experts",
            intermediate_size_field="intermediate_size",
        )
        del self.gate  # the router is named and shaped differently here
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)  # [E, hidden] + [E]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> ([T, k], [T, k])
        top_logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k] each
        return torch.softmax(top_logits, dim=-1), ids


def gpt_oss_mlp(config: Any, layer_idx: int, tp: TPGroup | None = None) -> tuple[str, nn.Module]:
    return "mlp", GptOssMoE(config, tp=tp)


class GptOssModel(MoEModel):
    """``MoEModel`` with GPT-OSS's experts (its YaRN rotary comes from ``get_rope``)."""

    make_mlp = staticmethod(gpt_oss_mlp)
    supports_tp = True


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    model_cls = GptOssModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # experts come stacked already
