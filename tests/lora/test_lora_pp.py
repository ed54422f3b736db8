"""Multi-LoRA under pipeline parallelism (CPU, gloo): ``LLM(enable_lora=True, pipeline_parallel_size=2)`` gives
peft's tokens for a batch mixing base rows and four adapters. Each stage's LoRA manager wraps its own layers and
loads the part of every adapter they hold; the other stage's modules are skipped (``LoRAManager.absent``)."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.lora.test_lora_engine import assert_no_leaks, expected, generate, lora_requests, random_prompts


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # phi3: adapters on its fused qkv / gate_up
def test_pp2_mixed_batch_matches_peft(arch, tiny_model_dirs, lora_adapters) -> None:
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    llm = LLM(
        base, enable_lora=True, max_loras=4, pipeline_parallel_size=2, dtype="float32", device="cpu", block_size=4,
        max_model_len=128,
    )  # fmt: skip
    try:
        runner = llm.llm_engine.engine_core.runner.runner  # rank 0: stage 0, layer 0 of the two
        assert runner.lora_manager.absent and all(".layers.1" in n or "norm" in n or "lm_head" in n
                                                 for n in runner.lora_manager.absent)  # fmt: skip
        reqs = lora_requests(adapters)
        names = [None, "attn", "all", "rs", "pattern", None, "rs", "all"]
        prompts = random_prompts(len(names), llm.llm_engine.config.model_config.vocab_size, seed=11)
        got = generate(llm, prompts, [None if n is None else reqs[n] for n in names])
        assert got == expected(base, adapters, names, prompts)
        assert len({tuple(g) for g in got}) >= 5  # the adapters do change the output
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
