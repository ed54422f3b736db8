"""EAGLE and EAGLE-3 heads in the published checkpoint layouts (random weights): greedy output equals
transformers' whatever the head proposes, across chunked prefill, prefix hits and preemption; bad heads fail at
start-up."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from tests.utils import hf_greedy, make_tiny_model

MAX_NEW = 30


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> str:
    """EAGLE-3 reads target layers 2, L/2 and L-3: the target needs at least 7 layers."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("deep") / "llama8", num_hidden_layers=8)


def _rand(*shape: int, gen: torch.Generator, scale: float = 0.15) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def make_eagle_head(target: str, path: Path, method: str) -> str:
    """A random head in the published layout: EAGLE-1 (``fc``, ``layers.0.*`` without input_layernorm, a copy of
    ``embed_tokens``) or EAGLE-3 (``fc`` over 3 hidden states, ``midlayer.*`` with 2H-wide q/k/v, ``norm``,
    ``lm_head`` over a smaller draft vocabulary and its ``d2t`` offsets)."""
    config = json.loads((Path(target) / "config.json").read_text())
    h, nh, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter, vocab = config.get("head_dim") or h // nh, config["intermediate_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(7 if method == "eagle" else 8)
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)  # the target's per-layer list; a one-layer head has its own
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")  # as published EAGLE-1 heads
    if method == "eagle":
        prefix, attn_in = "layers.0.", h
        tensors = {
            "fc.weight": _rand(h, 2 * h, gen=gen),
            "fc.bias": _rand(h, gen=gen),
            "embed_tokens.weight": _rand(vocab, h, gen=gen),
        }
    else:
        prefix, attn_in = "midlayer.", 2 * h
        draft_vocab = vocab - 40
        # Draft id i -> target id: the first 200 ids map to themselves, the rest skip 40 target ids.
        d2t = torch.tensor([0] * 200 + [40] * (draft_vocab - 200), dtype=torch.long)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + d2t] = True
        config.update(
            architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab, target_hidden_size=h
        )
        tensors = {
            "fc.weight": _rand(h, 3 * h, gen=gen),
            "midlayer.input_layernorm.weight": 1 + _rand(h, gen=gen, scale=0.1),
            "midlayer.hidden_norm.weight": 1 + _rand(h, gen=gen, scale=0.1),
            "norm.weight": 1 + _rand(h, gen=gen, scale=0.1),
            "lm_head.weight": _rand(draft_vocab, h, gen=gen),
            "d2t": d2t,
            "t2d": t2d,
        }
    tensors |= {
        prefix + "self_attn.q_proj.weight": _rand(nh * hd, attn_in, gen=gen),
        prefix + "self_attn.k_proj.weight": _rand(nkv * hd, attn_in, gen=gen),
        prefix + "self_attn.v_proj.weight": _rand(nkv * hd, attn_in, gen=gen),
        prefix + "self_attn.o_proj.weight": _rand(h, nh * hd, gen=gen),
        prefix + "mlp.gate_proj.weight": _rand(inter, h, gen=gen),
        prefix + "mlp.up_proj.weight": _rand(inter, h, gen=gen),
        prefix + "mlp.down_proj.weight": _rand(h, inter, gen=gen),
        prefix + "post_attention_layernorm.weight": 1 + _rand(h, gen=gen, scale=0.1),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


@functools.cache
def reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(path, [list(p) for p in prompts], MAX_NEW)


PROMPTS = (
    (5, 9, 31, 7, 100),
    tuple(range(40, 57)),
    (7, 8, 9, 10) * 5,
    (11, 12, 13, 14, 15, 16, 17, 18, 3, 4),
)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 33}])
def test_eagle_greedy_matches_transformers(deep_llama, tmp_path, method, engine_kw):
    head = make_eagle_head(deep_llama, tmp_path / method, method)
    llm = LLM(
        deep_llama,
        dtype="float32",
        device="cpu",
        block_size=4,
        max_model_len=128,
        max_num_seqs=8,
        speculative_config={"method": method, "model": head, "num_speculative_tokens": 3},
        **engine_kw,
    )
    prompts = list(PROMPTS) + [PROMPTS[3] + (21, 22)]  # the last one hits the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(deep_llama, tuple(prompts))
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > 0
    if engine_kw:
        assert stats.num_preemptions > 0
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_eagle3_maps_draft_ids_to_target_ids(deep_llama, tmp_path):
    """Draft-vocabulary logits land on target ids via d2t; ids outside the draft vocabulary are never drafted."""
    head = make_eagle_head(deep_llama, tmp_path / "e3", "eagle3")
    llm = LLM(
        deep_llama,
        dtype="float32",
        device="cpu",
        speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2},
    )
    proposer = llm.llm_engine.engine_core.proposer
    logits = proposer.head.compute_logits(torch.randn(3, 64))
    vocab = logits.shape[1]
    assert vocab == llm.llm_engine.engine_core.vocab_size
    assert torch.isinf(logits[:, 200:240]).all() and torch.isfinite(logits[:, :200]).all()
    assert torch.isfinite(logits[:, 240:]).all()


def test_eagle_startup_errors(tiny_llama, deep_llama, tmp_path):
    head = make_eagle_head(deep_llama, tmp_path / "e3", "eagle3")
    with pytest.raises(ValueError, match="at least 7 layers"):
        LLM(
            tiny_llama,
            device="cpu",
            speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(
            tiny_llama,
            device="cpu",
            speculative_config={
                "method": "eagle",
                "model": str(tmp_path / "none"),
                "num_speculative_tokens": 2,
            },
        )


def test_eagle3_n_stop_strings_and_logprobs(deep_llama, tmp_path):
    """n > 1, a stop string and logprobs with EAGLE-3 drafts: the same as without speculation."""
    head = make_eagle_head(deep_llama, tmp_path / "e3", "eagle3")
    kw = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128)
    plain = LLM(deep_llama, **kw)
    spec = LLM(
        deep_llama, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3}, **kw
    )
    prompts = ["the cat counted the stars", "hello hello hello hello"]
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    want, got = plain.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp, use_tqdm=False)
    for w, g in zip(want, got):
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids and gc.text == wc.text
            for wl, gl in zip(wc.logprobs, gc.logprobs):
                assert wl.keys() == gl.keys()  # the step shapes differ: equal within float32 rounding
                assert all(abs(wl[t].logprob - gl[t].logprob) < 1e-4 for t in wl)
    text = want[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    w, g = plain.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].text for o in g] == [o.outputs[0].text for o in w]
    assert w[0].outputs[0].finish_reason == "stop"
    assert spec.llm_engine.get_stats().spec_num_drafts > 0


def _drafts_log(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(request's tokens, drafts proposed for it) after every step, for every request."""
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    log = []
    while engine.has_unfinished_requests():
        engine.step()
        for request in core.scheduler.requests.values():
            if request.spec_token_ids:
                log.append((list(request.all_token_ids), list(request.spec_token_ids)))
    return log


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_incremental_head_cache_gives_the_drafts_of_a_fresh_pass(deep_llama, tmp_path, method):
    """The head's KV cache, kept step by step (prefill chunks, rejected drafts rolled back, two requests
    sharing steps), must propose what a fresh engine proposes after prefilling the same tokens in one pass:
    this checks the head's token/position/hidden bookkeeping, which exactness tests cannot see."""
    head = make_eagle_head(deep_llama, tmp_path / method, method)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    kw = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, speculative_config=spec)
    chunked = LLM(deep_llama, max_num_batched_tokens=5, **kw)
    log = _drafts_log(chunked, [list(PROMPTS[1]), list(PROMPTS[3])], max_tokens=24)
    assert len(log) > 10
    fresh = LLM(deep_llama, enable_prefix_caching=False, **kw)
    for tokens, drafts in log[1::4]:
        # The fresh engine prefills all but the last token in one pass; that step emits the last one (greedy).
        fresh_log = _drafts_log(fresh, [tokens[:-1]], max_tokens=5)
        assert fresh_log[0][0] == tokens
        assert fresh_log[0][1] == drafts
