"""Images in, text out: input parsing and preprocessing (front-end), the encoder cache (scheduler side), the
multimodal block-hash keys (KV cache manager) and the runner's encoder outputs (worker side)."""

from pagedllm.multimodal.inputs import MultiModalFeature

__all__ = ["MultiModalFeature"]
