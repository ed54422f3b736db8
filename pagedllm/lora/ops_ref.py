"""PyTorch multi-LoRA shrink/expand: the CPU path of the LoRA layers and the oracle of the Triton kernels
(``pagedllm.kernels.lora_shrink_expand``, whose docstring draws the layouts). No Triton needed here.

Each loops over the adapter slots (a handful) and multiplies the tokens of one slot together; tokens with
slot -1 are skipped.
"""

from __future__ import annotations

import torch


def lora_shrink_ref(
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [max_loras, N, in]
    token_slots: torch.Tensor,  # [num_tokens] int64; -1: no adapter
) -> torch.Tensor:  # [num_tokens, N] float32; zero rows for tokens without a slot
    """PyTorch twin of ``kernels.lora_shrink_expand.lora_shrink`` (fp32 products of the inputs as stored)."""
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = (token_slots == slot).nonzero().squeeze(1)  # [n]
        if rows.numel():
            h[rows] = x[rows].float() @ lora_a[slot].float().T
    return h


def lora_expand_ref(
    h: torch.Tensor,  # [num_tokens, S * R] float32
    lora_b: torch.Tensor,  # [max_loras, out, R]
    y: torch.Tensor,  # [num_tokens, out], updated in place
    token_slots: torch.Tensor,  # [num_tokens] int64
    slice_offsets: list[int],  # [S + 1]
) -> None:
    """PyTorch twin of ``kernels.lora_shrink_expand.lora_expand`` (``h`` rounded to ``lora_b``'s dtype, fp32 sums, one rounding)."""
    r = lora_b.shape[2]
    for slot in range(lora_b.shape[0]):
        rows = (token_slots == slot).nonzero().squeeze(1)  # [n]
        if not rows.numel():
            continue
        for s in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            hs = h[rows, s * r : (s + 1) * r].to(lora_b.dtype).float()  # [n, R]
            delta = hs @ lora_b[slot, lo:hi].float().T  # [n, hi - lo]
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
