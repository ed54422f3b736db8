"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

What one layer caches per token is one row of ``kv_lora_rank + qk_rope_head_dim`` (L + R) values::

    kv_cache: [num_blocks, block_size, L + R]     row = [ c: kv_a_layernorm(latent), L | k_pe: rotated, R ]

instead of per-head keys and values (``2 * num_heads * head_dim``): 576 values instead of 2 * 16 * 192 = 6144 for
DeepSeek-V2-Lite. The model declares this shape (:meth:`MLAAttention.kv_cache_shape`) and the model runner
allocates it; block accounting is unchanged (a block is ``block_size`` such rows per layer).

Per head h, with ``kv_b_proj.weight`` viewed as ``[H, P + V, L]`` = ``[W_UK[h] (P rows) ; W_UV[h] (V rows)]``
(P = ``qk_nope_head_dim``, V = ``v_head_dim``), the attention transformers computes is::

    k[h, s] = [W_UK[h] @ c[s] | k_pe[s]]        v[h, s] = W_UV[h] @ c[s]        q[h] = [q_nope[h] | q_pe[h]]
    out[h]  = sum_s softmax_s(scale * q[h] . k[h, s]) v[h, s]

Two equal ways to compute it, picked per request by its query length:

* **expanded** (prefill chunks, query length > 1): up-project the request's cached latents to per-head
  ``k_nope`` and ``v`` (``kv_b_proj``) and run causal attention with keys ``[k_nope | k_pe]`` (the new tokens sit
  at the end of the context);
* **absorbed** (decodes, query length 1): ``q[h] . k[h, s] = (W_UK[h].T @ q_nope[h]) . c[s] + q_pe[h] . k_pe[s]``
  and ``out[h] = W_UV[h] @ sum_s p[h, s] c[s]``: attention runs in latent space over the cache rows as they are
  (:mod:`pagedllm.kernels.mla_decode`: Triton on CUDA with the Triton backend, its PyTorch twin elsewhere).

A pure-decode step (every request one token: the CUDA-graph case) reads no host-side lengths. Other steps split
decodes from prefill chunks on the host (``query_start_loc_cpu`` / ``seq_lens_cpu``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import FP8_KV_DTYPE, AttentionBackend, AttentionMetadata
from pagedllm.platform import use_fused_kernels


def write_latent_cache(
    latent: torch.Tensor,  # [T, L], after kv_a_layernorm
    k_pe: torch.Tensor,  # [T, R], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], contiguous
    slot_mapping: torch.Tensor,  # [>= T] int64; slot = block_id * block_size + offset, -1 = skip
) -> None:
    """Write token t's ``[latent | k_pe]`` row into flat slot ``slot_mapping[t]``; slots of -1 are skipped.

    Without a host sync (so it can be captured in a CUDA graph): a skipped token writes the row of the first
    token that has a slot, to that token's slot (duplicate writes of identical rows, so the result does not depend
    on their order); when no token has a slot, slot 0 gets its own content back.
    """
    num_tokens = latent.shape[0]
    if num_tokens == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
    rows = torch.cat([latent, k_pe], dim=-1).to(flat.dtype)  # [T, L + R]
    slots = slot_mapping[:num_tokens]  # [T]
    valid = slots >= 0  # [T]
    # the first token with a slot (0 when none has one), as a [1] index: indexing with a 0-d device tensor would
    # read it on the host
    first = valid.to(torch.int32).argmax().view(1)
    target = torch.where(valid, slots, slots.index_select(0, first)).clamp(min=0)  # [T]
    fallback = torch.where(valid.index_select(0, first)[:, None], rows.index_select(0, first), flat[:1])  # [1, L+R]
    flat.index_copy_(0, target, torch.where(valid[:, None], rows, fallback))


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, P]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], this step's rows already written
    kv_b_proj: nn.Module,  # [..., L] -> [..., H * (P + V)]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int
    seq_lens: list[int],  # [num_reqs] context length after this step
    query_start_loc: list[int],  # [num_reqs + 1]
    reqs: list[int],  # the requests to compute (their query rows of ``out`` are written)
    scale: float,
    out: torch.Tensor,  # [T, H, V]
) -> None:
    """The expanded form, request by request: each request's cached latents up-projected to per-head keys and
    values, then causal attention (query i of a request with query length n and context S sits at position
    ``S - n + i`` and sees keys ``0..S - n + i``). Computed in float32 (float64 for float64) on CPU, in the
    input dtype on CUDA (SDPA accumulates in float32 there)."""
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    kv_lora_rank = kv_cache.shape[-1] - q_pe.shape[-1]
    block_size = kv_cache.shape[1]
    dtype = q_nope.dtype if q_nope.is_cuda else torch.promote_types(q_nope.dtype, torch.float32)
    for r in reqs:
        q_start, q_end = query_start_loc[r], query_start_loc[r + 1]
        query_len, seq_len = q_end - q_start, seq_lens[r]
        if query_len == 0:
            continue
        if query_len > seq_len:
            raise ValueError(f"request {r}: query_len {query_len} > seq_len {seq_len}")
        num_blocks = (seq_len + block_size - 1) // block_size
        ctx = kv_cache[block_table[r, :num_blocks].long()].flatten(0, 1)[:seq_len]  # [S, L + R]
        kv = kv_b_proj(ctx[:, :kv_lora_rank]).view(seq_len, num_heads, -1)  # [S, H, P + V]
        k_pe = ctx[:, None, kv_lora_rank:].expand(seq_len, num_heads, -1)  # [S, H, R]
        k = torch.cat([kv[..., :nope_dim], k_pe], dim=-1).to(dtype).transpose(0, 1)  # [H, S, P + R]
        v = kv[..., nope_dim:].to(dtype).transpose(0, 1)  # [H, S, V]
        q = torch.cat([q_nope[q_start:q_end], q_pe[q_start:q_end]], dim=-1).to(dtype).transpose(0, 1)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [n]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, S], True = attend
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[
            0
        ]  # [H, n, V]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)


class MLAAttention(nn.Module):
    """Paged multi-head latent attention over already-projected, already-rotated inputs; holds no weights.

    ``forward`` writes this step's ``[latent | k_pe]`` rows into ``kv_cache`` at ``metadata.slot_mapping`` and
    returns per-head outputs ``[T, H, V]`` (before ``o_proj``). ``kv_b_proj`` (the layer's up-projection, a float
    ``[H * (P + V), L]`` weight) is passed in each call: the expanded form calls it, the absorbed form reads its
    weight. ``scale`` is the softmax scale (DeepSeek: ``(P + R) ** -0.5``, times yarn's mscale squared).
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        attn_backend: AttentionBackend,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.attn_backend = attn_backend
        self.layer_idx = layer_idx

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def _absorbed_weights(self, kv_b_proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK, W_UV)``: views ``[H, P, L]`` and ``[H, V, L]`` of ``kv_b_proj.weight``."""
        weight = kv_b_proj._parameters.get("weight")
        if weight is None or weight.dim() != 2 or not weight.is_floating_point() or weight.element_size() < 2:
            raise NotImplementedError(
                "MLA decode needs kv_b_proj as a float weight (quantized kv_b_proj: not yet)"
            )
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _decode(
        self,
        q_nope: torch.Tensor,  # [B, H, P]
        q_pe: torch.Tensor,  # [B, H, R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        block_table: torch.Tensor,  # [>= B, max_blocks] int32
        seq_lens: torch.Tensor,  # [>= B] int32, on device
        max_seq_len: int,
        kv_b_proj: nn.Module,
    ) -> torch.Tensor:  # [B, H, V]
        """The absorbed form for one query per row."""
        w_uk, w_uv = self._absorbed_weights(kv_b_proj)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, L]
        q_pe = q_pe.to(q_latent.dtype)
        if self.attn_backend.name == "triton" and use_fused_kernels(q_latent):
            from pagedllm.kernels.mla_decode import mla_decode

            o_latent = mla_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, self.scale, max_seq_len)
        else:
            from pagedllm.kernels.mla_decode import mla_decode_ref

            o_latent = mla_decode_ref(
                q_latent, q_pe, kv_cache, block_table, seq_lens, self.scale, max_seq_len
            )
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, V]

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, P]
        q_pe: torch.Tensor,  # [T, H, R], rotated
        latent: torch.Tensor,  # [T, L], after kv_a_layernorm
        k_pe: torch.Tensor,  # [T, R], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        attn_metadata: AttentionMetadata,
        kv_b_proj: nn.Module,
    ) -> torch.Tensor:  # [T, H, V]; rows of tokens past the step's real ones are zero
        if kv_cache.dtype == FP8_KV_DTYPE:
            raise ValueError(
                "kv_cache_dtype='fp8' is not supported for multi-head latent attention (MLA) yet"
            )
        meta = attn_metadata
        write_latent_cache(latent, k_pe, kv_cache, meta.slot_mapping)
        num_tokens = q_nope.shape[0]
        if meta.is_pure_decode:  # row r is request r's only token; nothing read on the host
            out = torch.zeros(
                num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device
            )
            n = meta.num_reqs
            out[:n] = self._decode(
                q_nope[:n], q_pe[:n], kv_cache, meta.block_table, meta.seq_lens, meta.max_seq_len, kv_b_proj
            )
            return out
        out = torch.zeros(
            num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device
        )
        query_start_loc = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        query_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(len(seq_lens))]
        decodes = [r for r, n in enumerate(query_lens) if n == 1]
        prefills = [r for r, n in enumerate(query_lens) if n > 1]
        if decodes:
            reqs = torch.tensor(decodes, device=q_nope.device)
            tokens = torch.tensor([query_start_loc[r] for r in decodes], device=q_nope.device)
            out[tokens] = self._decode(
                q_nope[tokens],
                q_pe[tokens],
                kv_cache,
                meta.block_table[reqs],
                meta.seq_lens[reqs],
                max(seq_lens[r] for r in decodes),
                kv_b_proj,
            )
        if prefills:
            mla_prefill_ref(
                q_nope, q_pe, kv_cache, kv_b_proj, meta.block_table, seq_lens, query_start_loc, prefills, self.scale,
                out,
            )  # fmt: skip
        return out

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"backend={self.attn_backend.name}"
        )
