"""Programmatic dependent launches (pagedllm/kernels/pdl.py): a decode layer's chain of Triton kernels, captured in a
CUDA graph under ``launch_with_pdl`` (as the decode graphs are), gives exactly what the same kernels give launched
one by one without PDL, replay after replay. GPU only (compute capability 9.0+ for PDL itself; older GPUs run
the chain without it, which must match too)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.kernels.gemv import gemv  # noqa: E402
from pagedllm.kernels.paged_attention import paged_attention  # noqa: E402
from pagedllm.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from pagedllm.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from pagedllm.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from pagedllm.kernels.rotary import rotary_embedding  # noqa: E402
from pagedllm.platform import launch_with_pdl, use_pdl  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_chain_in_a_pdl_graph_matches_plain_launches_gpu(batch):
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks = 512, 8, 2, 64, 16, 512, 96
    qkv_size = (heads + 2 * kv_heads) * head_dim
    w_qkv = torch.randn(qkv_size, hidden, device=dev, dtype=dt) * 0.05
    w_o = torch.randn(hidden, heads * head_dim, device=dev, dtype=dt) * 0.05
    norm_w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    qk_w = torch.rand(head_dim, device=dev, dtype=dt) + 0.5
    cos = torch.rand(4096, head_dim // 2, device=dev, dtype=dt)
    sin = torch.rand(4096, head_dim // 2, device=dev, dtype=dt)
    x = torch.randn(batch, hidden, device=dev, dtype=dt)
    residual = torch.randn(batch, hidden, device=dev, dtype=dt)
    positions = torch.tensor([700, 5, 1500][:batch], device=dev)
    seq_lens = (positions + 1).to(torch.int32)
    # Disjoint blocks: no two requests write one slot.
    block_table = (
        torch.randperm(num_blocks, device=dev)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    )
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    slots = (
        block_table[torch.arange(batch), positions // block_size] * block_size + positions % block_size
    ).long()

    def layer(kv_cache: torch.Tensor) -> torch.Tensor:
        h, res = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        rows = [gemv(h[i : i + 1], w_qkv, pdl=use_pdl(h)) for i in range(batch)]
        qkv = torch.cat(rows) if batch > 1 else rows[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(batch, -1, head_dim) for t in (q, k, v))
        qk_norm_rope(positions, q, k, qk_w, qk_w, 1e-6, cos, sin)
        rotary_embedding(positions, q, k, cos, sin)
        reshape_and_cache(k, v, kv_cache, slots)
        o = paged_attention(q, kv_cache, block_table, seq_lens, qsl, head_dim**-0.5, batch, 1, 2048)
        out = gemv(o.reshape(batch, -1)[:1], w_o, pdl=use_pdl(o))
        return rms_norm(out + res[:1], norm_w, 1e-6)

    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=dev, dtype=dt)
    plain_cache = cache.clone()
    want = layer(plain_cache)  # plain launches (also compiles the non-PDL variants)

    graph_cache = cache.clone()
    with launch_with_pdl():
        assert use_pdl(x) is (torch.cuda.get_device_capability()[0] >= 9)
        layer(graph_cache.clone())  # compile the PDL variants outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = layer(graph_cache)
    for _ in range(3):
        graph_cache.copy_(cache)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert torch.equal(graph_cache, plain_cache)
