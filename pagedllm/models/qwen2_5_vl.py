"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2-VL (``pagedllm/models/qwen2_vl.py``: the same image
processor, patch merger layout, M-RoPE text model and checkpoint prefixes) with another vision tower: RMSNorm
instead of LayerNorm, a gated SiLU MLP, and window attention.

Window attention: the tower reorders each image's patches window by window (a window is ``window_size`` pixels
square, ``window_size / patch / merge`` merged units a side; windows at the right and bottom edges are smaller), so
that each window's patches are consecutive; the blocks in ``fullatt_block_indexes`` attend over the whole image (an
image's patches stay consecutive under the reordering), the others within each window. The merger runs in window
order and its output is put back in the processor's order. For an image 5 x 4 merged units with windows 2 units a
side (``o``: a merged unit, each 2 x 2 patches)::

    o o | o o | o        windows, in order: rows 0-1 x cols 0-1, 0-1 x 2-3, 0-1 x 4,
    o o | o o | o                           2-3 x 0-1, 2-3 x 2-3, 2-3 x 4
    ----+-----+--
    o o | o o | o
    o o | o o | o
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llava import vision_activation
from pagedllm.models.qwen2_vl import Qwen2VisionTransformer, Qwen2VLForConditionalGeneration


class GatedVisionMlp(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases (named ``gate`` / ``up`` / ``down``: the loader's fused gate/up
    mapping is the text model's)."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden_dim)
        self.up = nn.Linear(dim, hidden_dim)
        self.down = nn.Linear(hidden_dim, dim)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


def window_order(
    grids: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Qwen2.5-VL's window reordering, as transformers' ``get_vision_window_index``: (the merged units of all images
    in window order [sum t * h * w / merge**2] (indices into processor order), patches per window, patches per
    frame). ``window``: merged units a window side."""
    order = []
    window_lengths = []
    frame_lengths = []
    base = 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for f in range(t):
            frame_lengths.append(h * w)
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = index[f, r : r + window, c : c + window].flatten()
                    order.append(cell)
                    window_lengths.append(cell.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), window_lengths, frame_lengths


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.window = int(config.window_size) // self.merge // int(config.patch_size)  # merged units a side
        self.full_attention_blocks = {int(i) for i in config.fullatt_block_indexes}

    @staticmethod
    def dims_of(config: Any) -> tuple[int, int]:
        return int(config.hidden_size), int(config.out_hidden_size)

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        return RMSNorm(dim, eps=1e-6)

    @staticmethod
    def make_mlp(config: Any, width: int) -> nn.Module:
        return GatedVisionMlp(width, int(config.intermediate_size), getattr(config, "hidden_act", "silu"))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[S, C * T * P * P] patches of the images in ``grids`` order -> [S / merge**2, out_dim] (processor order)."""
        order, window_lengths, frame_lengths = window_order(grids, self.merge, self.window)
        order = order.to(pixels.device)
        unit = self.merge * self.merge
        s = pixels.shape[0]

        def windowed(t: torch.Tensor) -> torch.Tensor:  # [S, d] processor order -> window order
            return t.view(s // unit, unit, -1)[order].view(s, -1)

        x = windowed(self.patch_embed(pixels))  # [S, width]
        cos, sin = (windowed(c) for c in self._rotary(grids))  # [S, head_dim] each
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths if i in self.full_attention_blocks else window_lengths)
        merged = self.merger(x)  # [S / unit, out_dim] in window order
        return merged[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls = Qwen2_5VisionTransformer

    def checkpoint_name(self, name: str) -> str | None:
        """Qwen2-VL's renaming, and the tower's MLP ``gate_proj`` / ``up_proj`` / ``down_proj`` -> ``gate`` / ``up`` /
        ``down``."""
        name = super().checkpoint_name(name)
        if name is not None and name.startswith("visual.blocks."):
            for old, new in ((".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up."),
                             (".mlp.down_proj.", ".mlp.down.")):  # fmt: skip
                name = name.replace(old, new)
        return name
