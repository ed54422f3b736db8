"""Multi-LoRA serving: requests name PEFT adapters; each token of a batch runs through its own adapter.

``LoRARequest`` (request.py) names an adapter; ``LoRAManager`` (manager.py) caches adapters on the host and
copies them into ``max_loras`` device slots; ``LoRALinearMethod`` (layers.py) wraps a layer's linear method and
adds each token's ``x @ A.T @ B.T`` by the slot the per-step ``LoRAMapping`` gives it.
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
