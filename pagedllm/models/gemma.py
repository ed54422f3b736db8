"""Gemma (1): the Llama layout with GeGLU (tanh GELU), RMSNorm scaling by ``1 + weight``, embeddings scaled by
``sqrt(hidden_size)`` and the LM head tied to the embedding."""

from __future__ import annotations

import torch

from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llama import LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32, cast back at the end (as HF Gemma computes it). The
    checkpoint's ``weight`` is kept as stored; no fused kernel (it assumes the plain scale)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaModel(LlamaModel):
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden_size) rounded to the activation dtype first.
        return hidden * torch.tensor(hidden.shape[-1] ** 0.5, dtype=hidden.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
