"""Medusa heads in both published layouts (random weights): greedy output equals transformers' whatever the heads
propose, across chunked prefill, prefix hits and preemption; the drafts are exactly the heads applied to
transformers' final hidden state; bad heads fail at start-up."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from tests.utils import hf_greedy

MAX_NEW = 24
PROMPTS = ((5, 9, 31, 7, 100), tuple(range(40, 57)), (7, 8, 9, 10) * 5, (11, 12, 13, 14, 15, 16, 17, 18, 3, 4))


def make_medusa_heads(
    target: str, path: Path, num_heads: int = 3, num_layers: int = 1, layout: str = "vllm", shared: bool = False
) -> tuple[str, dict[str, torch.Tensor]]:
    """Random heads for ``target``'s shape, saved in vLLM's or FasterDecoding's layout (``shared``: vLLM's
    ``original_lm_head`` without a copy, the target's LM head serving every head); also returns the weights in
    vLLM's names."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(11)
    weights = {}
    for i in range(num_heads):
        for j in range(num_layers):
            weights[f"blocks.{i}.layers.{j}.weight"] = torch.randn(h, h, generator=gen) * 0.2
            weights[f"blocks.{i}.layers.{j}.bias"] = torch.randn(h, generator=gen) * 0.1
        if not shared:
            weights[f"lm_heads.{i}.weight"] = torch.randn(vocab, h, generator=gen) * 0.2
    if layout == "vllm":
        config = {"hidden_size": h, "vocab_size": vocab, "num_heads": num_heads, "num_hidden_layers": num_layers}
        config["original_lm_head"] = shared
        saved = weights
    else:  # FasterDecoding's Medusa-1 layout
        config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": target}
        saved = {}
        for name, tensor in weights.items():
            parts = name.split(".")
            if parts[0] == "blocks":
                saved[f"medusa_head.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = tensor
            else:
                saved[f"medusa_head.{parts[1]}.{num_layers}.weight"] = tensor
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in saved.items()}, str(path / "model.safetensors"))
    return str(path), weights


@functools.cache
def reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(path, [list(p) for p in prompts], MAX_NEW)


def _llm(target: str, heads: str, k: int = 3, **kw) -> LLM:
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": k}
    return LLM(target, dtype="float32", device="cpu", block_size=4, max_model_len=128, speculative_config=spec, **kw)


@pytest.mark.parametrize("layout", ["vllm", "fasterdecoding"])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 33}])
def test_medusa_greedy_matches_transformers(tiny_llama, tmp_path, layout, engine_kw):
    heads, _ = make_medusa_heads(tiny_llama, tmp_path / layout, num_layers=2, layout=layout)
    llm = _llm(tiny_llama, heads, max_num_seqs=8, **engine_kw)
    prompts = list(PROMPTS) + [PROMPTS[3] + (21, 22)]  # the last one hits the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(tiny_llama, tuple(prompts))
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > 0
    if engine_kw:
        assert stats.num_preemptions > 0
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


@pytest.mark.parametrize("shared", [False, True], ids=["own-lm-heads", "target-lm-head"])
def test_drafts_are_the_heads_over_the_targets_final_hidden_state(tiny_llama, tmp_path, shared):
    """Each draft list equals argmax(lm_head_i(blocks_i(h))) for h = transformers' final (normed) hidden state at
    the position that produced the request's newest token: the row bookkeeping after accepted and rejected drafts
    and prefill chunks, which exactness cannot see. With ``original_lm_head`` every head uses the target's."""
    heads, weights = make_medusa_heads(tiny_llama, tmp_path / "h", num_layers=1, shared=shared)
    llm = _llm(tiny_llama, heads, max_num_batched_tokens=6)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(PROMPTS[1:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(p)}, sp)
    log = []
    while engine.has_unfinished_requests():
        engine.step()
        log += [(list(r.all_token_ids), list(r.spec_token_ids)) for r in core.scheduler.requests.values() if r.spec_token_ids]
    assert len(log) > 8
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    if shared:
        weights |= {f"lm_heads.{i}.weight": hf.lm_head.weight.detach() for i in range(3)}
    for tokens, drafts in log:
        with torch.no_grad():
            h = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = []
        for i in range(len(drafts)):
            x = h + torch.nn.functional.silu(h @ weights[f"blocks.{i}.layers.0.weight"].T + weights[f"blocks.{i}.layers.0.bias"])
            expected.append(int((x @ weights[f"lm_heads.{i}.weight"].T).argmax()))
        assert drafts == expected, tokens


def test_medusa_startup_errors(tiny_llama, tmp_path):
    heads, _ = make_medusa_heads(tiny_llama, tmp_path / "h", num_heads=2)
    with pytest.raises(ValueError, match="exceeds the Medusa heads' number"):
        _llm(tiny_llama, heads, k=3)
    cfg = json.loads((Path(heads) / "config.json").read_text())
    (Path(heads) / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] + 8}))
    with pytest.raises(ValueError, match="hidden_size"):
        _llm(tiny_llama, heads, k=2)
    (Path(heads) / "config.json").write_text(json.dumps({"hidden_size": cfg["hidden_size"]}))
    with pytest.raises(ValueError, match="num_heads"):
        _llm(tiny_llama, heads, k=1)
    shared, _ = make_medusa_heads(tiny_llama, tmp_path / "shared", num_heads=2, shared=True)
    with pytest.raises(ValueError, match=r"copy of it \(lm_head.weight\) under pipeline_parallel_size"):
        LLM(tiny_llama, device="cpu", pipeline_parallel_size=2, distributed_executor_backend="mp",
            speculative_config={"method": "medusa", "model": shared, "num_speculative_tokens": 1})  # fmt: skip
