"""Speculative decoding with LoRA adapters (CPU, float32, tiny random llama): requests of two adapters and of the
base model in one batch, every proposer, synchronously or async. The target verifies drafts through each
request's adapter, so greedy output equals the same LoRA engine without speculation (tests/lora checks that one
against transformers + peft) whatever the drafts; no KV block leaks. Async EAGLE on stand-in graphs also launches
verification ahead of the host (the graphs replay with the step's adapter mapping)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.lora.lora_utils import adapter_kwargs, make_peft_adapter
from tests.spec_decode.test_spec_engine import assert_no_leaks, make_prompts, spec_config, stats
from tests.spec_decode.test_spec_graphs import install_stand_in_graphs

KW = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, enable_lora=True, max_loras=2)


def _run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=24 - 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory) -> list[LoRARequest | None]:
    """Two PEFT adapters of the tiny llama (tests/lora's), and the base model."""
    root = tmp_path_factory.mktemp("spec_lora")
    kinds = list(adapter_kwargs("llama").items())[:2]
    dirs = [make_peft_adapter(tiny_llama, root / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(kinds)]
    return [LoRARequest(name, i + 1, d) for i, ((name, _), d) in enumerate(zip(kinds, dirs))] + [None]


@pytest.mark.parametrize(
    "method,async_scheduling",
    [("ngram", False), ("draft_other", True), ("eagle", False), ("medusa", True)],  # (async EAGLE: below)
)
def test_speculation_with_lora_equals_lora_without(tiny_model_dirs, tiny_llama, loras, method, async_scheduling):
    prompts = make_prompts()
    per_request = [loras[i % 3] for i in range(len(prompts))]
    want = _run(LLM(tiny_llama, **KW), prompts, per_request)
    spec = spec_config(method, tiny_llama, tiny_model_dirs)
    llm = LLM(tiny_llama, speculative_config=spec, async_scheduling=async_scheduling, **KW)
    assert _run(llm, prompts, per_request) == want
    assert stats(llm).spec_num_drafts > 0
    assert_no_leaks(llm)


def test_async_eagle_with_lora_launches_ahead(tiny_model_dirs, tiny_llama, loras):
    prompts = make_prompts()
    per_request = [loras[i % 3] for i in range(len(prompts))]
    base = LLM(tiny_llama, **KW)
    want = _run(base, prompts, per_request)
    assert _run(base, prompts, [None] * len(prompts)) != want  # (the adapters change the tokens)
    spec = spec_config("eagle", tiny_llama, tiny_model_dirs)
    llm = LLM(tiny_llama, speculative_config=spec, async_scheduling=True, max_num_seqs=8, **KW)
    install_stand_in_graphs(llm, piecewise=False)
    assert _run(llm, prompts, per_request) == want
    assert llm.llm_engine.engine_core.num_spec_launches_ahead > 0
    assert_no_leaks(llm)
