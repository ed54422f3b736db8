"""MTP proposer (vLLM's ``method="mtp"`` / ``"deepseek_mtp"``): the target's own multi-token-prediction layer as
the draft head (pagedllm/models/deepseek_mtp.py), loaded from the target checkpoint.

It runs exactly as the EAGLE proposer (pagedllm/spec_decode/eagle.py), whose machinery it reuses: after every
target step the layer catches up over the positions the target computed and kept (prefill chunks included,
rejected drafts excluded), reading for position p the token at p + 1 and the target's final hidden state at p,
and writes its own one-layer latent (MLA) KV cache in the target's blocks and slots; the scheduler's ``k``
lookahead slots hold the drafts'. Draft 1 is the argmax of the layer's logits at the request's last position;
drafts 2..k feed the layer its own output hidden and the previous draft. The drafts are deterministic, so the
rejection sampler keeps the output exact. The target's pure decodes replay CUDA graphs (its hidden states are the
graphs' static outputs); its verification steps run eagerly (MLA plans multi-token steps on the host). Drafts
2..k run as the EAGLE proposer's draft steps, in CUDA graphs where the target has them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.spec_decode.eagle import EagleProposer


def checkpoint_has_mtp_layer(model_path: str, num_hidden_layers: int) -> bool:
    """Whether the safetensors checkpoint at ``model_path`` holds tensors of its first MTP layer
    (``model.layers.{num_hidden_layers}.*``); reads only the index or the files' headers."""
    from safetensors import safe_open

    from pagedllm.model_loader import safetensors_files

    prefix = f"model.layers.{num_hidden_layers}."
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return any(name.startswith(prefix) for name in json.load(f)["weight_map"])
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            if any(name.startswith(prefix) for name in f.keys()):  # noqa: SIM118 - safe_open is not a dict
                return True
    return False


class MTPProposer(EagleProposer):
    def __init__(self, config: EngineConfig, runner: Any) -> None:
        from pagedllm.model_loader import (
            _default_dtype,
            init_dummy_weights,
            iter_safetensors,
            load_weights,
            process_weights_after_loading,
        )
        from pagedllm.models.deepseek_mtp import DeepseekMTP, mtp_weight_names
        from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM

        spec = config.speculative_config
        mc = config.model_config
        self.k = spec.num_speculative_tokens
        self.method = spec.method
        self.runner = runner  # the target's: its embedding (and LM head if the layer has none), device
        self.device = runner.device
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        target = runner.model
        if not isinstance(target, DeepseekV2ForCausalLM):
            raise ValueError(
                f"speculative_config.method {spec.method!r} needs a DeepSeek-V3 target with MTP layers, got "
                f"{type(target).__name__}"
            )
        hf = mc.hf_config
        dummy = mc.load_format == "dummy"
        tensors = {} if dummy else dict(mtp_weight_names(iter_safetensors(spec.model), hf.num_hidden_layers))
        if not dummy and not tensors:
            raise ValueError(
                f"speculative_config.method {spec.method!r}: {spec.model!r} holds no MTP layer weights "
                f"(model.layers.{hf.num_hidden_layers}.*)"
            )
        own_lm_head = dummy or "layers.0.shared_head.head.weight" in tensors
        if not own_lm_head and getattr(runner, "pp", None) is not None:  # (rank 0's stage has no LM head)
            raise ValueError(
                f"speculative_config.method {spec.method!r} with pipeline_parallel_size > 1 needs an MTP layer "
                f"with its own LM head (model.layers.{hf.num_hidden_layers}.shared_head.head.weight)"
            )
        with _default_dtype(mc.dtype), torch.device(self.device):
            head = DeepseekMTP(hf, runner.attn_backend, target, own_lm_head=own_lm_head)
        if dummy:
            init_dummy_weights(head, mc.seed)
        else:
            load_weights(head, iter(tensors.items()))
        process_weights_after_loading(head)
        if not own_lm_head:
            head.target_lm_head = target.compute_logits
        self.head = head.eval()
        # The target's embedding: whole on rank 0 (tensor parallelism is refused at start-up; under pipeline
        # parallelism rank 0 holds the first stage, the embedding's).
        self.embed = None
        self.lm_head = None
        self.aux_layers = ()
        self.kv_cache: list[torch.Tensor] = []
        self.kv: KVCacheManager | None = None
        self.step_graphs = None
        self.catch_up_graphs = None

    def kv_block_bytes(self) -> int:
        shape = self.head.attn.kv_cache_shape(1, self.block_size)  # [1, block_size, kv_lora_rank + rope dim]
        return torch.Size(shape).numel() * torch.empty((), dtype=self.runner.dtype).element_size()

    def init_kv_cache(self, num_blocks: int, kv: KVCacheManager) -> None:
        shape = self.head.attn.kv_cache_shape(num_blocks, self.block_size)
        self.kv_cache = [torch.zeros(shape, dtype=self.runner.dtype, device=self.device)]
        self.kv = kv
        self.capture_head_graphs()
