"""Multi-LoRA through the engine: ``LLM(enable_lora=True)`` with the base model and several PEFT adapters in one
batch, against transformers + peft greedy decoding (float32, CPU), token for token. Also chunked prefill,
prefix caching across adapters, preemption, fewer slots (``max_loras``) than adapters in flight, the errors a bad
``lora_request`` raises, and no leaked KV blocks.
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.lora.lora_utils import LORA_ARCHS, hf_peft_greedy, make_peft_adapter

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_llm(base: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("enable_lora", True)
    kw.setdefault("max_loras", 4)
    return LLM(base, **kw)


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}


def random_prompts(n: int, vocab_size: int, seed: int, lengths=(5, 14)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def expected(base: str, adapters: dict[str, str], names: list[str | None], prompts: list[list[int]]):
    return [
        hf_peft_greedy(base, None if n is None else adapters[n], tuple(p), MAX_NEW)
        for n, p in zip(names, prompts)
    ]


def generate(llm: LLM, prompts, lora: list[LoRARequest | None], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    assert all(o.finished for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()
    assert core.num_integrity_failures == 0


def vocab(llm: LLM) -> int:
    return llm.llm_engine.config.model_config.vocab_size


# ----------------------------------------------------------------------------------------------- outputs


@pytest.mark.parametrize(
    "arch,async_scheduling",
    [(arch, False) for arch in LORA_ARCHS] + [("llama", True)],
    ids=[*LORA_ARCHS, "llama-async"],
)
def test_mixed_batch_matches_peft(arch, async_scheduling, tiny_model_dirs, lora_adapters) -> None:
    """One batch: base rows and three adapters (each twice), plus an n=2 request sharing one adapter."""
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    llm = make_llm(base, async_scheduling=async_scheduling)
    reqs = lora_requests(adapters)
    names = [None, "attn", "all", "rs", None, "rs", "all", "attn"]
    prompts = random_prompts(len(names), vocab(llm), seed=1)
    got = generate(llm, prompts, [None if n is None else reqs[n] for n in names])
    assert got == expected(base, adapters, names, prompts)
    assert len({tuple(g) for g in got}) == len(got)  # the adapters do change the output
    # n > 1: every child runs with the parent's adapter
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    out = llm.generate({"prompt_token_ids": prompts[2]}, params, lora_request=reqs["all"], use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [got[2], got[2]]
    assert_no_leaks(llm)


def test_chunked_prefill_prefix_cache_and_preemption(tiny_llama, lora_adapters) -> None:
    """Prompts sharing a long prefix across the base model and three adapters, in chunks of 12 tokens, with too
    few KV blocks for all of them (preemption): same tokens as peft, and no prefix-cache hit across adapters."""
    adapters = lora_adapters["llama"]
    llm = make_llm(
        tiny_llama, max_num_batched_tokens=12, num_gpu_blocks_override=16, max_model_len=64, max_num_seqs=8
    )
    reqs = lora_requests(adapters)
    engine = llm.llm_engine
    prefix = random_prompts(1, vocab(llm), seed=2, lengths=(16, 16))[0]
    tails = random_prompts(8, vocab(llm), seed=3, lengths=(2, 6))
    names = [None, "attn", "all", "rs", "attn", None, "rs", "all"]
    prompts = [prefix + t for t in tails]
    got = generate(llm, prompts, [None if n is None else reqs[n] for n in names])
    assert got == expected(tiny_llama, adapters, names, prompts)
    assert engine.get_stats().num_preemptions > 0
    assert_no_leaks(llm)

    # The prefix's blocks are cached for the base model and each adapter, each under its own hashes: a new
    # adapter finds nothing, the same adapter finds the whole prefix.
    pattern = adapters["pattern"]
    hits = engine.get_stats().prefix_cache_hits
    new = LoRARequest("pattern", 9, pattern)
    prompt = prefix + [7, 8, 9]
    assert generate(llm, [prompt], [new]) == [hf_peft_greedy(tiny_llama, pattern, tuple(prompt), MAX_NEW)]
    assert engine.get_stats().prefix_cache_hits == hits
    assert generate(llm, [prompt], [new]) == [hf_peft_greedy(tiny_llama, pattern, tuple(prompt), MAX_NEW)]
    assert engine.get_stats().prefix_cache_hits == hits + 16
    assert_no_leaks(llm)


def test_block_hashes_differ_by_adapter(tiny_llama, lora_adapters) -> None:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request

    kv = KVCacheManager(16, 4)
    a = LoRARequest("a", 1, lora_adapters["llama"]["attn"])
    b = LoRARequest("b", 2, lora_adapters["llama"]["all"])
    hashes = []
    for lora in (None, a, b, a):
        req = Request("r", list(range(3, 12)), GREEDY, None, 0.0, lora_request=lora)
        kv.get_computed_blocks(req)
        hashes.append(req.block_hashes)
    assert all(len(h) == 2 for h in hashes)
    assert hashes[1] == hashes[3]
    assert len({h[0] for h in hashes[:3]}) == 3 and len({h[1] for h in hashes[:3]}) == 3


def test_fewer_slots_than_adapters(tiny_llama, lora_adapters) -> None:
    """Four adapters and the base model in flight with max_loras=2 (and a host cache of 2): the scheduler never
    runs more than two adapters at once, skips (does not stop at) a request whose adapter would exceed it, and
    every output is still peft's."""
    adapters = lora_adapters["llama"]
    llm = make_llm(tiny_llama, max_loras=2, max_cpu_loras=2)
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    reqs = lora_requests(adapters)
    names = ["attn", "all", "rs", None, "pattern", "attn", "rs", None, "all"]
    prompts = random_prompts(len(names), vocab(llm), seed=4)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=reqs.get(name))
    done: dict[str, list[int]] = {}
    saw_base_with_two = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = {r.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(running) <= 2
        saw_base_with_two |= len(running) == 2 and any(r.lora_request is None for r in sched.running)
    assert saw_base_with_two  # the base request behind a skipped adapter request was not held back
    assert [done[str(i)] for i in range(len(names))] == expected(tiny_llama, adapters, names, prompts)
    assert_no_leaks(llm)


# ------------------------------------------------------------------------------------------------ errors


def test_lora_request_errors(tiny_llama, lora_adapters, tmp_path) -> None:
    adapters = lora_adapters["llama"]
    reqs = lora_requests(adapters)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    plain = make_llm(tiny_llama, enable_lora=False)
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
        plain.generate(prompt, GREEDY, lora_request=reqs["attn"], use_tqdm=False)
    assert_no_leaks(plain)

    llm = make_llm(tiny_llama, max_lora_rank=8, max_loras=2)
    engine = llm.llm_engine
    # a request already running is not disturbed by the failures below
    running_prompt = random_prompts(1, vocab(llm), seed=5)[0]
    engine.add_request("ok", {"prompt_token_ids": running_prompt}, GREEDY, lora_request=reqs["attn"])
    engine.step()
    embed = make_peft_adapter(
        tiny_llama, tmp_path / "embed", seed=9, r=4, lora_alpha=4, target_modules=["embed_tokens"]
    )
    bad = [
        (reqs["all"], "max_lora_rank"),  # r=16 > 8
        (LoRARequest("missing", 5, str(tmp_path / "nowhere")), "not a directory"),
        (LoRARequest("embed", 6, embed), "embedding LoRA is not supported"),
        (LoRARequest("other", reqs["attn"].lora_int_id, adapters["rs"]), "lora_int_id 2 already names"),
    ]
    for lora, message in bad:
        with pytest.raises(ValueError, match=f"lora_request: .*{message}"):
            engine.add_request("bad", prompt, GREEDY, lora_request=lora)
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt, prompt], GREEDY, lora_request=[None, lora], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 2 prompts"):
        llm.generate([prompt, prompt], GREEDY, lora_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(prompt, GREEDY, lora_request="attn", use_tqdm=False)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"]
    assert outs[0].outputs[0].token_ids == hf_peft_greedy(
        tiny_llama, adapters["attn"], tuple(running_prompt), MAX_NEW
    )
    assert_no_leaks(llm)


def test_add_remove_list_loras(tiny_llama, lora_adapters) -> None:
    adapters = lora_adapters["llama"]
    llm = make_llm(tiny_llama, max_loras=1, max_cpu_loras=3)
    engine = llm.llm_engine
    reqs = lora_requests(adapters)
    assert engine.add_lora(reqs["attn"]) is True
    assert engine.add_lora(reqs["attn"]) is False
    assert engine.add_lora(reqs["rs"]) is True
    assert engine.list_loras() == {reqs["attn"].lora_int_id, reqs["rs"].lora_int_id}
    assert engine.remove_lora(reqs["rs"].lora_int_id) is True
    assert engine.remove_lora(reqs["rs"].lora_int_id) is False
    assert engine.list_loras() == {reqs["attn"].lora_int_id}
    prompts = random_prompts(2, vocab(llm), seed=6)
    names = ["attn", "rs"]  # rs loads again from its path when its request comes
    assert generate(llm, prompts, [reqs[n] for n in names]) == expected(tiny_llama, adapters, names, prompts)
    assert_no_leaks(llm)


def test_graph_capture_mapping_forces_lora_on() -> None:
    """What the runner does before capturing CUDA graphs: an empty step with the LoRA kernels forced on (every
    slot -1, so replays of steps without adapters add nothing)."""
    from pagedllm.lora.layers import LoRAMapping

    mapping = LoRAMapping(8, 2)
    mapping.update(LoRAMapping.token_slots_of([], []), force_apply=True)
    assert mapping.apply_lora and mapping.num_tokens == 0
    assert (mapping.token_slots == -1).all() and (mapping.slot_num_tokens == 0).all()
    mapping.update(LoRAMapping.token_slots_of([1, -1], [2, 1]))  # a step after capture: padding stays -1
    assert mapping.token_slots.tolist() == [1, 1, -1, -1, -1, -1, -1, -1] and mapping.apply_lora


@pytest.mark.gpu
def test_mixed_batch_matches_peft_cuda_graphs(tiny_llama, lora_adapters) -> None:
    """On CUDA (float32, Triton LoRA kernels, decode steps replaying CUDA graphs captured with LoRA on): three
    adapters over two slots and the base model give peft's greedy tokens."""
    adapters = lora_adapters["llama"]
    llm = make_llm(tiny_llama, device="cuda", max_loras=2, enforce_eager=False)
    assert llm.llm_engine.engine_core.runner.graph_runner is not None
    reqs = lora_requests(adapters)
    names = [None, "attn", "all", "rs", None, "rs", "all", "attn"]
    prompts = random_prompts(len(names), vocab(llm), seed=1)
    got = generate(llm, prompts, [None if n is None else reqs[n] for n in names])
    assert got == expected(tiny_llama, adapters, names, prompts)
    assert_no_leaks(llm)
