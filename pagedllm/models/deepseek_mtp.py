"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a speculative-decoding draft head (vLLM's
``speculative_config`` method ``"mtp"`` / ``"deepseek_mtp"``; the proposer is pagedllm/spec_decode/mtp.py).

The target checkpoint stores its ``num_nextn_predict_layers`` MTP layers after the decoder layers, as
``model.layers.{N}.*`` (N = ``num_hidden_layers``; DeepSeek-V3 ships one), which the target itself does not load::

    enorm, hnorm                  RMSNorms of the token's embedding and of the target's hidden state
    eh_proj                       [H, 2H], no bias
    input_layernorm, self_attn,   one decoder layer like the target's: MLA attention, and the MLP the target's
    post_attention_layernorm, mlp layer N would have (routed experts for DeepSeek-V3)
    shared_head.norm              RMSNorm
    shared_head.head              [vocab, H] LM head (absent: the target's lm_head is used)
    embed_tokens                  a copy of the target's embedding: not loaded, the target's is used

At position p the layer reads the embedding of the token at p + 1 and the target's final (normed) hidden state
at p, and predicts the token at p + 2::

    h'     = block(eh_proj(cat(enorm(embed(x[p + 1])), hnorm(h[p]))))     the block's output plus its residual
    logits = shared_head.head(shared_head.norm(h'))

For more than one draft the same layer runs again on its own ``h'`` and the draft just made (as vLLM uses one MTP
layer for ``num_speculative_tokens`` > 1); only the first MTP layer is used. As in vLLM, the embedding at
position 0 is zeroed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.mixtral import MoEDecoderLayer


def num_mtp_layers(config: Any) -> int:
    """How many MTP layers the checkpoint declares: ``num_nextn_predict_layers`` (DeepSeek's config name), or
    ``num_mtp_layers`` (transformers' name for it); 0 when absent."""
    for name in ("num_nextn_predict_layers", "num_mtp_layers"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return 0


class SharedHead(nn.Module):
    def __init__(self, config: Any, own_lm_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size) if own_lm_head else None


class DeepseekMTPLayer(MoEDecoderLayer):
    """The decoder layer (checkpoint names as the target's layer N) plus the MTP parts around it."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: nn.Module,
        attention_cls: type[nn.Module],
        make_mlp: Any,
        own_lm_head: bool,
    ) -> None:
        super().__init__(config, layer_idx, attn_backend, rotary_emb, attention_cls, make_mlp)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config, own_lm_head)


class DeepseekMTP(nn.Module):
    """One MTP layer as a draft head. ``forward`` returns the pre-norm hidden ``[T, H]`` (the next draft step's
    hidden input); ``compute_logits`` gives float32 logits over the target's vocabulary.

    ``target_model``: the target (a ``DeepseekV2ForCausalLM``), whose body supplies the rotary embedding, the
    attention class and the MLP factory, so the layer is built exactly as the target's layer N would be."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(
        self, config: Any, attn_backend: AttentionBackend, target_model: nn.Module, own_lm_head: bool = True
    ) -> None:
        super().__init__()
        body = type(target_model.model)
        rotary = body.make_rotary(config)
        layer = DeepseekMTPLayer(
            config,
            config.num_hidden_layers,  # the MLP (dense or routed) is chosen by this global index
            attn_backend,
            rotary,
            type(target_model).attention_cls,
            body.make_mlp,
            own_lm_head,
        )
        self.layers = nn.ModuleList([layer])
        self.target_lm_head: Any = None  # set by the proposer when the checkpoint has no shared_head.head

    @property
    def attn(self) -> nn.Module:
        """The layer's MLA attention (its cache shape)."""
        return self.layers[0].self_attn.attn

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embedding of the token at p + 1
        hidden: torch.Tensor,  # [T, H] the target's final hidden state at p, or the previous draft step's output
        positions: torch.Tensor,  # [T] p
        kv_caches: list[torch.Tensor],  # one layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H] pre-norm hidden
        layer = self.layers[0]
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)  # as vLLM's DeepSeek MTP
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))  # [T, H]
        out, residual = layer(positions, x, None, kv_caches[0], meta)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, vocab] float32
        shared = self.layers[0].shared_head
        head = shared.head if shared.head is not None else self.target_lm_head
        return head(shared.norm(hidden))


def mtp_weight_names(
    weights: Iterator[tuple[str, torch.Tensor]], num_hidden_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The first MTP layer's checkpoint tensors (``model.layers.{num_hidden_layers}.*``) under ``DeepseekMTP``'s
    names (``layers.0.*``); its copy of the embedding and every other tensor are left out."""
    prefix = f"model.layers.{num_hidden_layers}."
    for name, tensor in weights:
        if name.startswith(prefix) and not name.startswith(prefix + "embed_tokens."):
            yield "layers.0." + name[len(prefix) :], tensor


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, num_hidden_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to an MTP layer (``model.layers.{i}.*`` with i >=
    ``num_hidden_layers``)."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= num_hidden_layers
