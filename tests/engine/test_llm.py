"""The offline engine against transformers (float32, CPU): greedy tokens, logprobs, seeds, leaks, bad input.

Every test runs twice: with the synchronous step loop and with async scheduling (step N+1 planned before step N's
tokens are read), which must give the same tokens.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import TINY_ARCHS, hf_greedy, hf_logprobs

MAX_NEW = 10
_ASYNC = {"on": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    _ASYNC["on"] = request.param
    yield request.param
    _ASYNC["on"] = False


def make_prompts(vocab_size: int, seed: int = 0, lengths=(3, 17, 9, 30, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    kw.setdefault("async_scheduling", _ASYNC["on"])
    return LLM(path, **kw)


@functools.cache
def reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(path, [list(p) for p in prompts], MAX_NEW)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    llm = make_llm(path)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    assert greedy(llm, prompts) == reference(path, tuple(map(tuple, prompts)))
    assert_no_leaks(llm)


def test_greedy_matches_with_small_chunks(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=5)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    assert greedy(llm, prompts) == reference(tiny_llama, tuple(map(tuple, prompts)))
    assert_no_leaks(llm)


def test_greedy_matches_with_prefix_hits(tiny_llama):
    llm = make_llm(tiny_llama, enable_prefix_caching=True)
    vocab = llm.llm_engine.engine_core.vocab_size
    shared = make_prompts(vocab, seed=1, lengths=(21,))[0]
    prompts = [shared + tail for tail in make_prompts(vocab, seed=2, lengths=(1, 6, 13))] + [shared]
    want = reference(tiny_llama, tuple(map(tuple, prompts)))
    assert greedy(llm, prompts[:1]) == want[:1]
    assert greedy(llm, prompts[1:]) == want[1:]
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0
    # Same answers again, now entirely from cached prefixes.
    assert greedy(llm, prompts) == want
    assert_no_leaks(llm)


def test_greedy_matches_under_preemption(tiny_llama):
    # 12 blocks of 4 tokens: five requests of up to 40 tokens cannot all fit at once.
    llm = make_llm(tiny_llama, num_gpu_blocks_override=12, max_model_len=48)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    assert greedy(llm, prompts) == reference(tiny_llama, tuple(map(tuple, prompts)))
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_no_leaks(llm)


def test_greedy_matches_when_requests_join_midway(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=8)
    engine = llm.llm_engine
    prompts = make_prompts(engine.engine_core.vocab_size)
    want = reference(tiny_llama, tuple(map(tuple, prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step, while others decode
            i, p = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [got[str(i)] for i in range(len(prompts))] == want
    assert_no_leaks(llm)


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=7)  # prompt logprobs arrive over several chunks
    prompt = make_prompts(llm.llm_engine.engine_core.vocab_size, lengths=(15,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = hf_logprobs(tiny_llama, prompt + comp.token_ids[:-1])  # [len, vocab]
    # Sampled-token logprobs: position len(prompt)-1+j scores output token j.
    assert len(comp.logprobs) == 6
    total = 0.0
    for j, (tok, lp_dict) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert tok in lp_dict and len(lp_dict) <= 4
        assert abs(lp_dict[tok].logprob - row[tok].item()) < 1e-4
        assert lp_dict[tok].rank == 1  # greedy picks the top token
        top = torch.topk(row, 3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lp_dict[t].logprob - v) < 1e-4
        total += lp_dict[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # Prompt logprobs: None for the first token, then one dict per prompt token.
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        d = plp[i]
        assert prompt[i] in d and abs(d[prompt[i]].logprob - row[prompt[i]].item()) < 1e-4
        assert d[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
        top = torch.topk(row, 2)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[t].logprob - v) < 1e-4
    assert_no_leaks(llm)


def test_seeded_sampling_same_alone_or_batched(tiny_llama):
    llm = make_llm(tiny_llama)
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [others] * len(prompts)
    params[1] = seeded
    batched = llm.generate(batch, params, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched
    different = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    assert (
        llm.generate({"prompt_token_ids": prompts[1]}, different, use_tqdm=False)[0].outputs[0].token_ids
        != alone
    )
    assert_no_leaks(llm)


def test_n_and_text_prompts_and_stop_strings(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.generate(
        "hello world", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.prompt == "hello world" and out.prompt_token_ids
    greedy_out = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = greedy_out.text
    assert text
    stop = text[3:5] if len(text) >= 5 else text[-1]
    stopped = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    assert_no_leaks(llm)


def test_abort_returns_every_block(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i, p in enumerate(make_prompts(engine.engine_core.vocab_size)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()
    engine.abort_request([f"r{i}" for i in range(5)])
    engine.step()
    assert_no_leaks(llm)


def test_bad_input_raises_and_engine_keeps_serving(tiny_llama, tmp_path):
    llm = make_llm(tiny_llama, max_model_len=64)
    engine = llm.llm_engine
    vocab = engine.engine_core.vocab_size
    ok = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = make_prompts(vocab, lengths=(9,))[0]
    engine.add_request("running", {"prompt_token_ids": prompt}, ok)
    engine.step()
    bad_cases = [
        (lambda: engine.add_request("x1", {"prompt_token_ids": [5] * 64}, ok), "maximum model length"),
        (lambda: engine.add_request("x2", {"prompt_token_ids": [5, vocab]}, ok), "prompt_token_ids"),
        (lambda: engine.add_request("x3", {"prompt_token_ids": [-1]}, ok), "prompt_token_ids"),
        (lambda: engine.add_request("x4", "", ok), "prompt"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(n=0), "n"),
        (lambda: SamplingParams(top_k=-2), "top_k"),
        (
            lambda: engine.add_request("x5", "hi", SamplingParams(stop_token_ids=[vocab + 5])),
            "stop_token_ids",
        ),
        (lambda: LLM(str(tmp_path / "missing"), device="cpu"), "missing"),
    ]
    for fn, needle in bad_cases:
        with pytest.raises(ValueError, match=needle):
            fn()
    bad_arch = tmp_path / "bad_arch"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(bad_arch), device="cpu")
    # A bad prompt among good ones queues nothing.
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": [vocab + 1]}], ok, use_tqdm=False)
    # The request that was running before all this finishes with the right tokens.
    got = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got = out
    assert got.request_id == "running"
    assert got.outputs[0].token_ids == reference(tiny_llama, (tuple(prompt),))[0]
    assert_no_leaks(llm)


def test_chat_applies_template(tiny_llama):
    llm = make_llm(tiny_llama)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    # A list of conversations gives one output each, in order.
    outs = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "wizard", "content": "x"}], params, use_tqdm=False)
    assert_no_leaks(llm)


def test_seeded_sampling_unchanged_by_preemption(tiny_llama):
    prompts = make_prompts(400)
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    roomy = make_llm(tiny_llama, max_model_len=48)
    want = [o.outputs[0].token_ids for o in roomy.generate(batch, seeded, use_tqdm=False)]
    tight = make_llm(tiny_llama, num_gpu_blocks_override=12, max_model_len=48)
    got = [o.outputs[0].token_ids for o in tight.generate(batch, seeded, use_tqdm=False)]
    assert tight.llm_engine.get_stats().num_preemptions > 0
    assert got == want
    assert_no_leaks(tight)
    assert not tight.llm_engine.engine_core.runner.input_batch.preempted_generators


@pytest.mark.usefixtures("admit_while_blocks_last")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_onednn_packed_layers_under_chunks_prefix_hits_and_preemption(tiny_llama, monkeypatch, async_scheduling):
    """Every linear layer packed for oneDNN (the tiny model is under the size cut, so the cut is lowered): greedy
    tokens still equal transformers' with chunked prefill, prefix hits and preemption, in both loops."""
    from pagedllm.layers import cpu_gemm
    from pagedllm.layers.linear import Linear

    if not cpu_gemm.onednn_enabled():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(cpu_gemm, "PACK_MIN_ELEMENTS", 0)
    llm = make_llm(
        tiny_llama,
        async_scheduling=async_scheduling,
        num_gpu_blocks_override=12,
        max_model_len=48,
        max_num_batched_tokens=8,
    )
    model = llm.llm_engine.engine_core.runner.model
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, Linear))
    prompts = make_prompts(llm.llm_engine.engine_core.vocab_size)
    want = reference(tiny_llama, tuple(map(tuple, prompts)))
    assert greedy(llm, prompts) == want
    assert greedy(llm, prompts) == want  # again, from cached prefixes
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_no_leaks(llm)
