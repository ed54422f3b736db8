"""The RoPE kernel writing this step's keys and values into the paged cache (``Attention.kv_write``, one launch per
layer fewer than the backend's own ``reshape_and_cache``): only on the fused kernels with a backend that accepts it,
and then a Llama / Qwen3 attention block gives bit for bit what it gives with the backend writing the cache."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.layers.attention import Attention
from tests.attention.test_torch_ref import REQUESTS, build_step


class _WritesOwnCache:
    """A backend that does not take written keys (no ``accepts_written_kv``)."""

    name = "stub"


class _AcceptsWrittenKV:
    name = "stub"
    accepts_written_kv = True


def test_kv_write_only_on_the_fused_kernels_with_a_backend_that_accepts_it() -> None:
    query, key, value, kv_cache, metadata, _ = build_step(REQUESTS, 4, 4, 2)
    for backend in (TorchAttentionBackend(), _WritesOwnCache(), _AcceptsWrittenKV()):
        layer = Attention(4, 8, 8**-0.5, 2, backend, layer_idx=0)
        assert layer.kv_write(value, kv_cache, metadata) is None  # CPU tensors: the backend writes


def test_rope_cache_write_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDLLM_ROPE_WRITES_KV=0 hands the cache write back to the backend even on the fused kernels."""
    import pagedllm.layers.attention as attention_mod

    _, _, value, kv_cache, metadata, _ = build_step(REQUESTS, 4, 4, 2)
    layer = Attention(4, 8, 8**-0.5, 2, _AcceptsWrittenKV(), layer_idx=0)
    monkeypatch.setattr(attention_mod, "use_fused_kernels", lambda x: True)  # as on a GPU
    monkeypatch.setenv("PAGEDLLM_ROPE_WRITES_KV", "0")
    assert layer.kv_write(value, kv_cache, metadata) is None
    monkeypatch.delenv("PAGEDLLM_ROPE_WRITES_KV")
    if importlib.util.find_spec("triton") is None:
        return  # the write spec lives with the Triton kernels
    write = layer.kv_write(value, kv_cache, metadata)
    assert write is not None and write.value is value and write.kv_cache is kv_cache
    assert write.slot_mapping is metadata.slot_mapping and (write.k_scale, write.v_scale) == (1.0, 1.0)


def test_torch_rotary_refuses_a_cache_write() -> None:
    from pagedllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="fused kernels"):
        rope(torch.arange(3), q, k, cache=object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_block_with_rope_writing_the_cache_gpu(arch: str) -> None:
    pytest.importorskip("triton")
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.layers.rotary import RotaryEmbedding
    from pagedllm.models.llama import LlamaAttention
    from pagedllm.models.qwen3 import Qwen3Attention

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    config = SimpleNamespace(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6
    )
    cls = Qwen3Attention if arch == "qwen3" else LlamaAttention
    layer = cls(config, 0, TritonAttentionBackend(), RotaryEmbedding(64, 4096)).to(dev, dt)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    assert layer.rope_writes_cache and layer.norm_rope_fusable == (arch == "qwen3")
    _, _, _, kv_cache, meta, _ = build_step(REQUESTS, 16, 4, 2, num_pad=3, dtype=dt)
    on_gpu = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(dev) for f in on_gpu})
    kv_cache = torch.randn(2, kv_cache.shape[1], 16, 2, 64, dtype=dt, device=dev)
    hidden = torch.randn(meta.num_tokens + 3, 256, device=dev, dtype=dt)
    positions = (torch.arange(meta.num_tokens + 3, device=dev) * 7) % 60
    outs = []
    with torch.inference_mode():
        for fused in (True, False):
            layer.rope_writes_cache = fused
            cache = kv_cache.clone()
            outs.append((layer(positions, hidden, cache, meta), cache))
    (got, got_cache), (want, want_cache) = outs
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got[: meta.num_tokens], want[: meta.num_tokens])
