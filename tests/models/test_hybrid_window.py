"""Hybrid models (sliding-window and full-attention layers: Gemma 2, Gemma 3, GPT-OSS) through the engine with the
windowed KV cache (core/kv_cache_manager.py): greedy tokens equal transformers' and logprobs agree within 1e-4 on
prompts longer than the window, with chunked prefill, prefix hits, preemption, n > 1, an abort and async scheduling;
the sliding groups hold only their window while the full group holds everything, and
``disable_hybrid_kv_cache_manager`` keeps every block."""

from __future__ import annotations

import logging
import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import NULL_BLOCK, cdiv
from tests.models import test_gpt_oss_qwen2moe as gpt_oss
from tests.utils import TINY_WINDOWS, hf_greedy, hf_logprobs

BS = 4
MAX_NEW = 10


@pytest.fixture(scope="module")
def hybrid_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, tuple[str, int]]:
    """name -> (checkpoint, window): Gemma 2 / 3 (layer 0 local, layer 1 global), GPT-OSS (the same with sinks) and
    GPT-OSS with layer_types full, sliding, sliding (three KV cache groups: full, and two sliding ones)."""
    root = tmp_path_factory.mktemp("hybrid")
    three = {
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    }
    return {
        "gemma2": (tiny_model_dirs["gemma2"], TINY_WINDOWS["gemma2"]),
        "gemma3": (tiny_model_dirs["gemma3"], TINY_WINDOWS["gemma3"]),
        "gpt_oss": (gpt_oss.make_tiny("gpt_oss", root / "gpt_oss", seed=31), gpt_oss.WINDOW),
        "gpt_oss-3": (gpt_oss.make_tiny("gpt_oss", root / "gpt_oss3", seed=32, **three), gpt_oss.WINDOW),
    }


def make_llm(path: str, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "block_size": BS, "max_model_len": 128, **kw}
    return LLM(path, **kw)


def record_holdings(llm: LLM) -> dict[str, list[tuple[int, int, int]]]:
    """After each step's ``cache_blocks`` (which frees what the windows left behind): per request, (list length,
    non-null blocks of the full group, most non-null blocks of any sliding group)."""
    kv = llm.llm_engine.engine_core.kv_cache_manager
    seen: dict[str, list[tuple[int, int, int]]] = {}
    cache_blocks = kv.cache_blocks

    def recording(request) -> None:
        cache_blocks(request)
        rid = request.request_id
        counts = [sum(b is not NULL_BLOCK for b in g.req_to_blocks.get(rid, [])) for g in kv.groups]
        sliding = [c for c, g in zip(counts, kv.groups) if g.sliding_window is not None]
        seen.setdefault(rid, []).append((kv.num_blocks_of(rid), counts[0], max(sliding, default=0)))

    kv.cache_blocks = recording
    return seen


def prompts(vocab: int, window: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(3 * window)]  # a prefix 3 windows long
    return [
        shared + [rng.randrange(3, vocab) for _ in range(9)],
        [rng.randrange(3, vocab) for _ in range(2 * window + 3)],
        shared + [rng.randrange(3, vocab) for _ in range(5)],
    ]


def assert_matches_transformers(path: str, prompt_ids: list[list[int]], outs, logprobs: bool = True) -> None:
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompt_ids, MAX_NEW)
    if not logprobs:
        return
    for prompt, out in zip(prompt_ids, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(path, prompt + comp.token_ids[:-1])  # [len, vocab]
        for j, lps in enumerate(comp.logprobs):
            row = ref[len(prompt) - 1 + j]
            for t, lp in lps.items():
                assert abs(lp.logprob - row[t].item()) < 1e-4, (j, t)


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "gpt_oss-3"])
def test_chunks_prefix_hits_and_window_holdings(hybrid_dirs, name) -> None:
    path, window = hybrid_dirs[name]
    llm = make_llm(path, max_num_batched_tokens=8)  # prompts arrive in chunks of 8 tokens
    core = llm.llm_engine.engine_core
    windows = [g.sliding_window for g in core.kv_cache_manager.groups]
    assert windows == ([None, window, window] if name == "gpt_oss-3" else [None, window])
    held = record_holdings(llm)
    ps = prompts(core.vocab_size, window)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    first = llm.generate([{"prompt_token_ids": ps[0]}], params, use_tqdm=False)  # fills the prefix cache
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert_matches_transformers(path, [ps[0]], first)
    assert_matches_transformers(path, ps, outs)
    # The shared prefix (3 windows) is served from the cache, sliding groups included.
    assert outs[0].num_cached_tokens >= len(ps[0]) - BS and outs[2].num_cached_tokens >= 3 * window - BS
    # After every step the sliding groups hold their window (a block of margin, a partial block), the full group
    # every block of the request.
    for rid, steps in held.items():
        for length, full, sliding in steps:
            assert full == length and sliding <= cdiv(window, BS) + 2, (rid, steps)
    assert max(length for steps in held.values() for length, _, _ in steps) > 2 * (cdiv(window, BS) + 2)
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss-3"])
def test_preemption_n_abort_and_async(hybrid_dirs, name) -> None:
    """A pool too small for the batch (preemption), n=2 (the second sequence hits the first's blocks), a request
    aborted mid-decode, with async scheduling (step N+1 planned before step N's tokens are read)."""
    path, window = hybrid_dirs[name]
    # A 57-token sequence needs 15 full blocks and at most 8 per sliding group (of one or two layers' pages).
    llm = make_llm(path, max_num_batched_tokens=8, num_gpu_blocks_override=44, async_scheduling=True)
    engine = llm.llm_engine
    ps = prompts(engine.engine_core.vocab_size, window)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("doomed", {"prompt_token_ids": ps[1]}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("pair", {"prompt_token_ids": ps[0]}, SamplingParams(n=2, **_greedy()))
    for i, p in enumerate(ps[1:]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
        if steps == 12:
            engine.abort_request("doomed")
    assert "doomed" not in outs or outs["doomed"].outputs[0].finish_reason == "abort"
    pair = outs["pair"]
    assert len(pair.outputs) == 2 and pair.outputs[0].token_ids == pair.outputs[1].token_ids
    want = hf_greedy(path, [ps[0], *ps[1:]], MAX_NEW)
    assert [
        pair.outputs[0].token_ids,
        outs["r0"].outputs[0].token_ids,
        outs["r1"].outputs[0].token_ids,
    ] == want
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the test meant to preempt"
    assert stats.prefix_cache_hits > 0, "the test meant to hit the prefix cache"
    assert_no_leaks(llm)


def _greedy() -> dict:
    return {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}


def test_disable_hybrid_keeps_every_block(hybrid_dirs) -> None:
    path, window = hybrid_dirs["gemma2"]
    llm = make_llm(path, max_num_batched_tokens=8, disable_hybrid_kv_cache_manager=True)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert [g.sliding_window for g in kv.groups] == [None]
    held = record_holdings(llm)
    ps = prompts(llm.llm_engine.engine_core.vocab_size, window)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**_greedy()), use_tqdm=False)
    assert_matches_transformers(path, ps, outs, logprobs=False)
    for steps in held.values():
        assert all(full == length for length, full, _ in steps)  # no block freed behind any window
    assert_no_leaks(llm)


def test_kv_cache_log_reports_memory_per_sequence(hybrid_dirs, caplog) -> None:
    path, window = hybrid_dirs["gemma3"]  # 2 layers of 2 KV heads x 32 x float32: 2 KiB a layer and block
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.engine_core"):
        on = make_llm(path, num_gpu_blocks_override=64).llm_engine.engine_core.kv_cache_info
        off = make_llm(path, num_gpu_blocks_override=64, disable_hybrid_kv_cache_manager=True)
    off = off.llm_engine.engine_core.kv_cache_info
    # 128 tokens: 32 blocks in the full group, 6 in the sliding one (window 16, a block of margin, a partial one).
    layer_block = 2 * BS * 2 * 32 * 4
    for info in (on, off):
        assert info["seq_kv_bytes_full"] == 32 * 2 * layer_block
        assert info["seq_kv_bytes_windowed"] == (32 + 6) * layer_block
    assert on["group_windows"] == [None, window] and off["group_windows"] == [None]
    assert on["kv_cache_bytes"] == 64 * layer_block and off["kv_cache_bytes"] == 64 * 2 * layer_block
    lines = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert any("in 2 groups: full attention x1, sliding window 16 x1" in m for m in lines), lines
    per_seq = [m for m in lines if "KV cache per 128-token sequence: 76.0 KiB with the windowed cache" in m]
    assert len(per_seq) == 2 and all(
        "(blocks per group 32/6), 128.0 KiB without it (1.68x" in m for m in per_seq
    )
    assert per_seq[0].endswith("windowed cache on") and "windowed cache off" in per_seq[1], lines


def test_cuda_graph_inputs_per_group(monkeypatch) -> None:
    """The graph runner's static inputs hold one block table and slot mapping per group (checked on the host:
    pinned buffers become plain ones, and a replay does nothing)."""
    import numpy as np
    import torch

    from pagedllm.worker import cuda_graphs

    zeros = torch.zeros
    monkeypatch.setattr(cuda_graphs.torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    groups, max_blocks = 3, 10
    runner = cuda_graphs.CudaGraphRunner(None, [], 8, max_blocks, 40, torch.device("cpu"), groups)
    for bs in runner.sizes:
        runner.graphs[(bs, 1)] = type("Graph", (), {"replay": lambda self: None})()
        runner.outputs[(bs, 1)] = torch.zeros(bs, 4)
    rng = np.random.default_rng(0)
    n, nb = 3, 5
    table = rng.integers(0, 100, size=(groups, n, nb)).astype(np.int32)  # [groups, n, nb]
    slots = rng.integers(0, 1000, size=(groups, n))  # [groups, n]
    runner.run(np.arange(n), np.arange(n) + 7, slots, np.array([5, 6, 7], dtype=np.int32), table)
    bs = runner.padded_size(n)
    meta = runner._metadata(bs)
    for g in range(groups):
        view = meta.for_kv_group(g)
        assert torch.equal(view.block_table[:n, :nb], torch.from_numpy(table[g]))
        assert torch.equal(view.slot_mapping[:n], torch.from_numpy(slots[g]))
        assert (view.slot_mapping[n:bs] == -1).all() and (view.block_table[n:bs, :nb] == 0).all()  # padding
        assert view.block_table.shape == (bs, max_blocks) and view.block_table.stride(1) == 1
        assert view.slot_mapping.is_contiguous()
    assert torch.equal(runner.seq_lens[:bs], torch.tensor([5, 6, 7, 1], dtype=torch.int32))


def test_multi_token_graph_inputs(monkeypatch) -> None:
    """Speculative decoding's graphs (up to q = k + 1 tokens a request): the step's tokens come first in their
    flattened order with the real query_start_loc; padding requests get no tokens and no context; padding rows
    write no keys. Checked on the host as above (a replay does nothing)."""
    import numpy as np
    import torch

    from pagedllm.worker import cuda_graphs

    zeros = torch.zeros
    monkeypatch.setattr(cuda_graphs.torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    groups, max_blocks, q = 2, 10, 4
    runner = cuda_graphs.CudaGraphRunner(
        None, [], 8, max_blocks, 40, torch.device("cpu"), groups, max_query_len=q, max_num_tokens=16
    )
    assert runner.spec_sizes == [1, 2, 4] and runner.max_tokens == 16  # bs * q within the token budget
    for key in [(bs, 1) for bs in runner.sizes] + [(bs, q) for bs in runner.spec_sizes]:
        runner.graphs[key] = type("Graph", (), {"replay": lambda self: None})()
        runner.outputs[key] = torch.arange(key[0] * key[1] * 2, dtype=torch.float32).view(-1, 2)
    assert runner.can_run(3, 7, 4) and not runner.can_run(3, 7, 5) and not runner.can_run(5, 9, 2)
    assert runner.can_run(8, 8, 1)  # pure decodes keep their own graphs, up to max_num_seqs
    counts = np.array([1, 4, 2])  # a decode without drafts, one with 3 drafts, one with 1
    cu = np.concatenate([[0], np.cumsum(counts)])
    num_tokens = int(cu[-1])
    rng = np.random.default_rng(1)
    table = rng.integers(0, 100, size=(groups, 3, 5)).astype(np.int32)
    slots = rng.integers(0, 1000, size=(groups, num_tokens))
    seq_lens = np.array([9, 12, 20], dtype=np.int32)
    ids = np.arange(100, 100 + num_tokens)
    hidden = runner.run(ids, np.arange(num_tokens), slots, seq_lens, table, None, cu)
    bs, rows = 4, 16
    assert runner.num_replays == {(bs, q): 1}
    assert torch.equal(hidden, runner.outputs[(bs, q)][:num_tokens])  # the step's rows, in order
    assert torch.equal(runner.spec_query_start_loc[: bs + 1], torch.tensor([0, 1, 5, 7, 7], dtype=torch.int32))
    assert torch.equal(runner.seq_lens[:bs], torch.tensor([9, 12, 20, 0], dtype=torch.int32))
    assert torch.equal(runner.input_ids[:num_tokens], torch.from_numpy(ids))
    assert (runner.input_ids[num_tokens:rows] == 0).all() and (runner.positions[num_tokens:rows] == 0).all()
    meta = runner._metadata(bs, q)
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.is_pure_decode) == (bs, rows, q, False)
    for g in range(groups):
        view = meta.for_kv_group(g)
        assert torch.equal(view.slot_mapping[:num_tokens], torch.from_numpy(slots[g]))
        assert (view.slot_mapping[num_tokens:rows] == -1).all()  # padding rows write no keys
        assert torch.equal(view.block_table[:3, :5], torch.from_numpy(table[g]))
        assert (view.block_table[3:bs, :5] == 0).all()
    # A pure-decode step after it goes back to the one-token graphs and their fixed query_start_loc.
    runner.run(ids[:3], np.arange(3), slots[:, :3], seq_lens, table)
    assert runner.num_replays[(4, 1)] == 1 and torch.equal(runner.seq_lens[:4], torch.tensor([9, 12, 20, 1]).int())


def test_every_groups_metadata_is_contiguous(hybrid_dirs, monkeypatch):
    """Each group's slot mapping and block-table rows reach the backend contiguous: the Triton cache write reads
    slot t at offset t (a column-major slot array once sent group 1 another group's slots, seen on the GPU)."""
    from pagedllm.attention.torch_ref import TorchAttentionBackend

    seen = []
    forward = TorchAttentionBackend.forward

    def checking(self, query, key, value, kv_cache, metadata, *args, **kw):
        seen.append((metadata.slot_mapping.stride(0), metadata.block_table.stride(1)))
        return forward(self, query, key, value, kv_cache, metadata, *args, **kw)

    monkeypatch.setattr(TorchAttentionBackend, "forward", checking)
    llm = make_llm(hybrid_dirs["gpt_oss-3"][0])
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30, 17)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert seen and set(seen) == {(1, 1)}


def test_the_cli_flag_reaches_the_kv_cache(hybrid_dirs):
    """``--disable-hybrid-kv-cache-manager`` (vLLM's flag) through the CLI's engine arguments: one full-attention
    group instead of Gemma 3's full + sliding groups."""
    import argparse

    from pagedllm.config import make_engine_config
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
    from pagedllm.engine.engine_core import EngineCore

    path = hybrid_dirs["gemma3"][0]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, windows in (([], [None, TINY_WINDOWS["gemma3"]]), (["--disable-hybrid-kv-cache-manager"], [None])):
        args = parser.parse_args(["--model", path, "--device", "cpu", "--dtype", "float32", *flags])
        config = make_engine_config(path, **engine_kwargs_from_args(args))
        assert config.cache_config.disable_hybrid_kv_cache_manager == bool(flags)
        core = EngineCore(config)
        assert core.kv_cache_info["group_windows"] == windows
        core.shutdown()
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager must be a bool"):
        LLM(path, device="cpu", disable_hybrid_kv_cache_manager="yes")
