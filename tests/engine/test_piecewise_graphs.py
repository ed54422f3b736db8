"""Piecewise CUDA graphs (worker/piecewise_graphs.py): the capture's bookkeeping on CPU with a stand-in graph
type, and on the GPU the engine's greedy outputs with them against eager mode."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import Attention
from pagedllm.worker.piecewise_graphs import PiecewiseGraphRunner, piecewise_sizes


def test_sizes_cover_every_step_up_to_the_cap():
    sizes = piecewise_sizes(16384)
    assert sizes[0] == 16 and sizes[-1] == 16384
    assert sizes == sorted(set(sizes)) and all(s % 16 == 0 for s in sizes)
    assert 1024 in sizes and 4096 in sizes and 5120 in sizes
    assert piecewise_sizes(8192)[-1] == 8192
    assert piecewise_sizes(100) == [16, 32, 64, 100]  # the budget itself is the last size
    assert piecewise_sizes(65536)[-1] == 16384  # larger steps stay eager


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple] = []


def _graph_cls(log: _Log):
    class FakeGraph:
        """Stands in for torch.cuda.CUDAGraph: records when pieces begin, end and replay."""

        count = 0

        def __init__(self) -> None:
            self.id = FakeGraph.count
            FakeGraph.count += 1

        def capture_begin(self, pool=None) -> None:
            log.events.append(("begin", self.id))

        def capture_end(self) -> None:
            log.events.append(("end", self.id))

        def replay(self) -> None:
            log.events.append(("replay", self.id))

    return FakeGraph


@pytest.fixture
def cpu_runner(tiny_llama):
    with LLM(
        tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=16, block_size=4, max_model_len=64
    ) as llm:  # held until the test ends: a dropped LLM releases its runner's model
        yield llm.llm_engine.engine_core.runner


def _attention_layers(model) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_capture_splits_the_forward_at_each_attention(cpu_runner):
    log = _Log()
    layers = _attention_layers(cpu_runner.model)
    pw = PiecewiseGraphRunner(
        cpu_runner.model, cpu_runner.kv_caches, [16, 32], torch.device("cpu"), graph_cls=_graph_cls(log)
    )
    assert pw.capture(len(layers))
    assert pw.padded_size(1) == 16 and pw.padded_size(17) == 32 and pw.padded_size(32) == 32
    assert pw.padded_size(33) is None
    for size in (16, 32):
        pieces = pw.pieces[size]
        assert len(pieces.graphs) == len(layers) + 1
        assert [c.layer for c in pieces.calls] == layers  # in layer order, each once
        for c in pieces.calls:
            assert c.query.shape[0] == c.key.shape[0] == c.value.shape[0] == size
            assert c.out.shape == c.query.shape
        # One static output buffer for every layer and size.
        assert len({c.out.data_ptr() for c in pieces.calls}) == 1
        assert pieces.output.shape[0] == size
    # Each piece is captured whole before the next begins; largest size first.
    begins_ends = [e for e in log.events if e[0] in ("begin", "end")]
    assert [kind for kind, _ in begins_ends] == ["begin", "end"] * (2 * (len(layers) + 1))
    assert pw.pieces[32].graphs[0].id < pw.pieces[16].graphs[0].id


def test_replay_alternates_pieces_and_eager_attention(cpu_runner, monkeypatch):
    log = _Log()
    layers = _attention_layers(cpu_runner.model)
    pw = PiecewiseGraphRunner(
        cpu_runner.model, cpu_runner.kv_caches, [16], torch.device("cpu"), graph_cls=_graph_cls(log)
    )
    assert pw.capture(len(layers))
    seen = []

    def fake_forward(self, query, key, value, kv_cache, metadata, kv_written=False, out=None):
        seen.append((self.layer_idx, metadata, out.data_ptr(), kv_written))
        return out

    monkeypatch.setattr(Attention, "forward", fake_forward)
    log.events.clear()
    meta = object()
    hidden = pw.replay(16, meta)
    graph_ids = [g.id for g in pw.pieces[16].graphs]
    assert [e for e in log.events] == [("replay", i) for i in graph_ids]
    assert [s[0] for s in seen] == [layer.layer_idx for layer in layers]
    assert all(s[1] is meta for s in seen)  # the step's real metadata, not the capture's
    # Each layer writes the static buffer the next piece reads.
    assert [s[2] for s in seen] == [c.out.data_ptr() for c in pw.pieces[16].calls]
    assert hidden.shape[0] == 16 and pw.num_replays == {16: 1}


def test_capture_refuses_a_model_whose_attention_bypasses_the_layer(cpu_runner):
    """A forward with fewer Attention calls than attention layers (attention baked into a piece with the
    capture's metadata) leaves the runner without graphs."""
    layers = _attention_layers(cpu_runner.model)
    pw = PiecewiseGraphRunner(
        cpu_runner.model, cpu_runner.kv_caches, [16], torch.device("cpu"), graph_cls=_graph_cls(_Log())
    )
    assert not pw.capture(len(layers) + 1)
    assert pw.pieces == {} and pw.padded_size(16) is None


def test_capture_failure_leaves_steps_eager(cpu_runner):
    """A piece that cannot be captured (here: the third capture_end raises) ends the open capture, keeps no
    graph, and the runner reports no size: the engine runs those steps eagerly instead of failing to start."""
    log = _Log()
    base = _graph_cls(log)
    ends = []

    class FailingGraph(base):
        def capture_end(self) -> None:
            ends.append(self.id)
            if len(ends) == 3:
                raise RuntimeError("operation not permitted when stream is capturing")
            super().capture_end()

    layers = _attention_layers(cpu_runner.model)
    pw = PiecewiseGraphRunner(
        cpu_runner.model, cpu_runner.kv_caches, [16], torch.device("cpu"), graph_cls=FailingGraph
    )
    assert not pw.capture(len(layers))
    assert pw.pieces == {} and pw.padded_size(16) is None
    assert not pw.capture(0)  # no attention layer: nothing to split at


def test_stage_pads_the_static_inputs(cpu_runner):
    pw = PiecewiseGraphRunner(cpu_runner.model, cpu_runner.kv_caches, [16, 32], torch.device("cpu"), 2)
    ids, pos, slots = pw.stage(
        np.arange(1, 6, dtype=np.int64), np.arange(10, 15, dtype=np.int64), np.full((2, 5), 7, np.int64), 16
    )
    assert ids.shape == (16,) and pos.shape == (16,) and slots.shape == (2, 16)
    assert ids.tolist() == [1, 2, 3, 4, 5] + [0] * 11
    assert pos.tolist() == [10, 11, 12, 13, 14] + [0] * 11
    assert slots.tolist() == [[7] * 5 + [-1] * 11] * 2  # padding rows write no keys
    # A later, shorter step over the same buffers leaves no stale rows inside its size.
    ids, _, slots = pw.stage(
        np.array([9], np.int64), np.array([3], np.int64), np.array([[4], [4]], np.int64), 16
    )
    assert ids.tolist() == [9] + [0] * 15 and slots[0].tolist() == [4] + [-1] * 15


def test_attention_writes_into_a_given_output(cpu_runner):
    """``out=``: the torch backend (and the Triton one, on the GPU) writes the result where the piecewise graphs
    read it."""
    layer = _attention_layers(cpu_runner.model)[0]
    kv_cache = cpu_runner.kv_caches[0]
    from pagedllm.attention.base import AttentionMetadata

    n, h, kvh, d = 3, layer.num_heads, layer.num_kv_heads, layer.head_dim
    meta = AttentionMetadata(
        num_reqs=1,
        num_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6]),
        query_start_loc_cpu=torch.tensor([0, n], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([n], dtype=torch.int32),
    )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, x, d, generator=g) for x in (h, kvh, kvh))
    expected = layer(q, k, v, kv_cache, meta)
    out = torch.full((n, h, d), float("nan"))
    result = layer(q, k, v, kv_cache, meta, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_piecewise_is_wanted_only_where_validated(cpu_runner, monkeypatch):
    """On a (pretend) CUDA device with the Triton backend: on by default; off with PAGEDLLM_PIECEWISE=0, eager
    mode, LoRA, a draft model's runner or an MLA model; under tensor parallelism unless PAGEDLLM_TP_PIECEWISE=0;
    with an EAGLE / Medusa draft reading the target's hidden states as well."""
    from types import SimpleNamespace

    monkeypatch.delenv("PAGEDLLM_PIECEWISE", raising=False)
    monkeypatch.delenv("PAGEDLLM_TP_PIECEWISE", raising=False)
    assert not cpu_runner._piecewise_wanted()  # CPU
    monkeypatch.setattr(cpu_runner, "device", torch.device("cuda"))
    monkeypatch.setattr(cpu_runner, "attn_backend", SimpleNamespace(name="triton"))
    assert cpu_runner._piecewise_wanted()
    monkeypatch.setenv("PAGEDLLM_PIECEWISE", "0")
    assert not cpu_runner._piecewise_wanted()
    monkeypatch.delenv("PAGEDLLM_PIECEWISE")
    with monkeypatch.context() as m:  # hidden states for a draft head: from the graphs' static outputs
        m.setattr(cpu_runner, "keep_hidden", True)
        assert cpu_runner._piecewise_wanted()
    for attr, value in (
        ("lora_manager", object()),
        ("allow_piecewise", False),
    ):
        with monkeypatch.context() as m:
            m.setattr(cpu_runner, attr, value)
            assert not cpu_runner._piecewise_wanted(), attr
    with monkeypatch.context() as m:  # tensor parallelism: on, unless switched off
        m.setattr(cpu_runner, "tp_size", 2)
        assert cpu_runner._piecewise_wanted()
        m.setenv("PAGEDLLM_TP_PIECEWISE", "0")
        assert not cpu_runner._piecewise_wanted()
    with monkeypatch.context() as m:
        m.setattr(cpu_runner.config, "enforce_eager", True)
        assert not cpu_runner._piecewise_wanted()
    with monkeypatch.context() as m:
        m.setattr(cpu_runner.config.model_config.hf_config, "kv_lora_rank", 64, raising=False)
        assert not cpu_runner._piecewise_wanted()
    assert cpu_runner._piecewise_wanted()


def test_compilation_config_picks_the_cuda_graph_mode():
    """vLLM's ``compilation_config`` and ``optimization_level``: ``cudagraph_mode`` (any case, vLLM's enum by name,
    or a config object's attribute) wins; otherwise the level: 0 NONE, 1 PIECEWISE, 2-3 (and none) FULL_AND_PIECEWISE;
    FULL falls back to FULL_AND_PIECEWISE; torch.compile keys are ignored; anything else is a ValueError naming the
    field."""
    from types import SimpleNamespace

    from pagedllm.config import parse_compilation_config as parse

    assert parse() == parse(None, 2) == parse(None, 3) == "FULL_AND_PIECEWISE"
    assert parse(None, 0) == parse(0) == parse("0") == "NONE"
    assert parse(None, 1) == parse(1) == "PIECEWISE"
    assert parse({"cudagraph_mode": "piecewise"}, 0) == "PIECEWISE"  # the explicit mode wins over the level
    assert parse({"cudagraph_mode": None}, 1) == "PIECEWISE"  # unset: the level's
    assert parse({"cudagraph_mode": None}) == "FULL_AND_PIECEWISE"
    assert parse('{"cudagraph_mode": "FULL_DECODE_ONLY", "level": 3}') == "FULL_DECODE_ONLY"
    assert parse({"cudagraph_mode": SimpleNamespace(name="NONE")}) == "NONE"
    assert parse(SimpleNamespace(cudagraph_mode="FULL_DECODE_ONLY")) == "FULL_DECODE_ONLY"
    assert parse({"cudagraph_mode": "FULL"}) == "FULL_AND_PIECEWISE"
    assert parse({"use_inductor": False}) == "FULL_AND_PIECEWISE"
    with pytest.raises(ValueError, match="cudagraph_mode"):
        parse({"cudagraph_mode": "SOMETIMES"})
    with pytest.raises(ValueError, match="optimization_level"):
        parse(None, 4)
    with pytest.raises(ValueError, match="compilation_config"):
        parse("{not json")
    with pytest.raises(ValueError, match="compilation_config"):
        parse([1, 2])


def test_engine_flags_reach_the_config(tiny_llama):
    """--compilation-config / -cc (JSON) and --optimization-level / -O (``-O3`` too) reach make_engine_config; a
    bad value stops argparse with the flag's name."""
    import argparse

    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    kw = engine_kwargs_from_args(parser.parse_args([tiny_llama, "-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY"}']))
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"} and kw["optimization_level"] is None
    assert engine_kwargs_from_args(parser.parse_args([tiny_llama, "-O3"]))["optimization_level"] == 3
    assert engine_kwargs_from_args(parser.parse_args([tiny_llama, "-O", "0"]))["optimization_level"] == 0
    for bad in (["-O", "7"], ["--compilation-config", "{nope"]):
        with pytest.raises(SystemExit):
            parser.parse_args([tiny_llama, *bad])


@pytest.mark.parametrize(
    "mode, piecewise_ok, captured",
    [
        ("FULL_AND_PIECEWISE", True, ["decode", "piecewise"]),
        ("FULL_DECODE_ONLY", True, ["decode"]),
        ("PIECEWISE", True, ["piecewise"]),
        ("PIECEWISE", False, ["piecewise-failed", "decode"]),  # pieces unavailable: decode graphs, not none
        ("NONE", True, []),
    ],
)
def test_the_mode_decides_what_is_captured(tiny_llama, monkeypatch, mode, piecewise_ok, captured):
    """On a (pretend) CUDA device with the Triton backend, maybe_capture_cuda_graphs captures what the mode names;
    PIECEWISE falls back to the decode graphs where the pieces cannot be had."""
    from types import SimpleNamespace

    monkeypatch.delenv("PAGEDLLM_PIECEWISE", raising=False)
    llm = LLM(
        tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=8, block_size=4, max_model_len=32,
        compilation_config={"cudagraph_mode": mode},
    )  # fmt: skip
    runner = llm.llm_engine.engine_core.runner
    assert runner.config.cudagraph_mode == mode
    calls = []
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "attn_backend", SimpleNamespace(name="triton"))
    monkeypatch.setattr(runner, "_capture_decode_graphs", lambda: calls.append("decode"))

    def capture_piecewise() -> bool:
        calls.append("piecewise" if piecewise_ok else "piecewise-failed")
        return piecewise_ok

    monkeypatch.setattr(runner, "_capture_piecewise", capture_piecewise)
    monkeypatch.setattr(runner, "_warm_up_eager_steps", lambda: calls.append("warm-up"))
    runner.maybe_capture_cuda_graphs()
    assert calls == (captured + ["warm-up"] if mode != "NONE" else [])
    monkeypatch.setattr(runner, "device", torch.device("cpu"))  # what it is: shutdown synchronizes a CUDA device
    llm.shutdown()
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(tiny_llama, device="cpu", compilation_config={"cudagraph_mode": "ALWAYS"})


def test_llm_takes_vllms_optimization_level(tiny_llama):
    """LLM(optimization_level=...) as in vLLM: 0 turns the graphs off, an explicit cudagraph_mode wins, and a
    level outside 0-3 is a ValueError naming the argument."""
    kw = dict(dtype="float32", device="cpu", num_gpu_blocks_override=8, block_size=4, max_model_len=32)
    for level, config, mode in [(0, None, "NONE"), (1, None, "PIECEWISE"), (0, {"cudagraph_mode": "FULL"}, None)]:
        llm = LLM(tiny_llama, optimization_level=level, compilation_config=config, **kw)
        assert llm.llm_engine.config.cudagraph_mode == (mode or "FULL_AND_PIECEWISE")
        llm.llm_engine.engine_core.shutdown()
    with pytest.raises(ValueError, match="optimization_level"):
        LLM(tiny_llama, optimization_level=5, **kw)


def test_profile_reserves_the_graph_pool(cpu_runner, monkeypatch):
    """The pool keeps the largest size's activations beside the allocator's logits peak: within a 16k budget the
    smaller of the two profiled peaks (the larger is in the profile already), above it the activations scaled to
    16k tokens; plus the static attention output rows."""
    layers = _attention_layers(cpu_runner.model)
    row = layers[0].num_heads * layers[0].head_dim * cpu_runner.dtype.itemsize
    monkeypatch.setattr(cpu_runner, "max_num_tokens", 8192)
    assert cpu_runner._piecewise_reserve(3000, 5000) == 3000 + 8192 * row
    assert cpu_runner._piecewise_reserve(7000, 5000) == 5000 + 8192 * row
    monkeypatch.setattr(cpu_runner, "max_num_tokens", 32768)
    assert cpu_runner._piecewise_reserve(8000, 100) == 4000 + 16384 * row


class _EagerPieces(PiecewiseGraphRunner):
    """The runner's protocol without graphs (CPU): ``replay`` runs the whole forward on the staged static buffers,
    padding rows included, with the step's metadata. What it checks is the model runner's side: staging, padding,
    the metadata over the static slot mapping, the padded rows' attention, the hidden rows handed back."""

    def replay(self, size, metadata):
        self.num_replays[size] = self.num_replays.get(size, 0) + 1
        return self.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_with_padded_piecewise_steps_matches_eager_on_cpu(tiny_llama, async_scheduling):
    """Mixed and prefill-only steps (a 48-token budget), requests joining midway, prefix hits, and, with async
    scheduling, the previous step's sampled ids patched into the static input buffer: the same greedy tokens as
    the plain engine."""
    vocab = 64
    rng = random.Random(3)
    prefix = [rng.randrange(3, vocab) for _ in range(20)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 17, 60, 5)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(
        dtype="float32", device="cpu", block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    results = []
    for piecewise in (False, True):
        llm = LLM(tiny_llama, **kw)
        runner = llm.llm_engine.engine_core.runner
        if piecewise:
            pw = _EagerPieces(runner.model, runner.kv_caches, [16, 32, 48], runner.device, graph_cls=_graph_cls(_Log()))
            assert pw.capture(len(_attention_layers(runner.model)))
            runner.piecewise = pw
        outs = []
        for _ in range(2):  # the second pass hits the prefix cache
            gen = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs += [o.outputs[0].token_ids for o in gen]
        llm.llm_engine.check_integrity()
        if piecewise:
            assert {16, 32, 48} <= set(pw.num_replays)  # padded steps of every size ran
        results.append(outs)
    assert results[1] == results[0]


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_stage_waits_for_the_twins_last_copy():
    """A prefill-only step samples nothing, so nothing else holds the host back: a twin is refilled only once
    its previous copy has run. Stage A behind a long GPU sleep, then B and C (C reuses A's twin): the device
    buffer as the stream saw it right after A's copy holds A."""
    dev = torch.device("cuda")
    pw = PiecewiseGraphRunner(lambda *a: None, [], [16], dev)
    snapshot = torch.empty(16, dtype=torch.long, device=dev)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the copies below queue behind it
    slots = np.full((1, 16), -1, np.int64)
    zeros = np.zeros(16, np.int64)
    pw.stage(np.arange(16, dtype=np.int64), zeros, slots, 16)  # A
    snapshot.copy_(pw.input_ids[:16])
    pw.stage(np.full(16, 7, np.int64), zeros, slots, 16)  # B
    pw.stage(np.full(16, 9, np.int64), zeros, slots, 16)  # C: A's twin
    torch.cuda.synchronize()
    assert snapshot.tolist() == list(range(16))
    assert pw.input_ids[:16].tolist() == [9] * 16


def _prompts(vocab: int) -> list[list[int]]:
    """Lengths from 3 to 300 (chunked at a 256-token budget), four sharing a 96-token prefix (prefix hits)."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(96)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 300, 17, 129, 64, 250, 5, 90, 33)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 20, 70, 150)]
    return prompts


def _run(path: str, eager: bool, **kw) -> tuple[list[list[int]], dict[int, int], int]:
    llm = LLM(
        path,
        dtype="float32",
        device="cuda",
        max_model_len=512,
        enforce_eager=eager,
        max_num_seqs=8,  # requests join as others finish
        max_num_batched_tokens=256,  # chunked prefill: mixed steps
        **{"kv_cache_memory_bytes": 64 * 2**20, **kw},
    )
    runner = llm.llm_engine.engine_core.runner
    assert (runner.piecewise is None) == eager
    prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for _ in range(2):  # the second pass hits the prefix cache
        gen = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs += [o.outputs[0].token_ids for o in gen]
    replays = {} if eager else dict(runner.piecewise.num_replays)
    preemptions = llm.llm_engine.get_stats().num_preemptions
    llm.llm_engine.check_integrity()
    del llm
    torch.cuda.empty_cache()
    return outs, replays, preemptions


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral", "qwen3-backend-writes-kv"])
def test_piecewise_graphs_match_eager(tiny_model_dirs, arch, monkeypatch):
    """Mixed steps (chunks and decodes), requests joining midway, prefix hits, sliding windows and a hybrid
    cache (gemma3), and the backend writing the cache instead of the RoPE kernel: token for token the eager
    engine's output."""
    if arch == "qwen3-backend-writes-kv":
        monkeypatch.setenv("PAGEDLLM_ROPE_WRITES_KV", "0")
        arch = "qwen3"
    eager, _, _ = _run(tiny_model_dirs[arch], eager=True)
    graphs, replays, _ = _run(tiny_model_dirs[arch], eager=False)
    assert sum(replays.values()) > 0 and max(replays) > 16
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_DECODE_ONLY"])
def test_cudagraph_modes_match_eager(tiny_model_dirs, mode):
    """PIECEWISE (pieces for every step, pure decodes included, no whole-forward graphs) and FULL_DECODE_ONLY
    (whole graphs for decodes, mixed steps eager): the eager engine's tokens."""
    path = tiny_model_dirs["qwen3"]
    eager, _, _ = _run(path, eager=True)
    llm = LLM(
        path, dtype="float32", device="cuda", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
        kv_cache_memory_bytes=64 * 2**20, compilation_config={"cudagraph_mode": mode},
    )  # fmt: skip
    runner = llm.llm_engine.engine_core.runner
    assert (runner.graph_runner is None) == (mode == "PIECEWISE")
    assert (runner.piecewise is None) == (mode == "FULL_DECODE_ONLY")
    prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for _ in range(2):
        gen = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs += [o.outputs[0].token_ids for o in gen]
    llm.llm_engine.check_integrity()
    if mode == "PIECEWISE":
        # Pure decodes of up to 8 requests pad to 16: at least the 23 decode steps of each pass's last request.
        assert runner.piecewise.num_replays.get(16, 0) >= 46
    del llm
    torch.cuda.empty_cache()
    assert outs == eager


@pytest.mark.gpu
def test_piecewise_graphs_match_eager_under_preemption(tiny_model_dirs, admit_while_blocks_last):
    kw = {"kv_cache_memory_bytes": None, "num_gpu_blocks_override": 40, "block_size": 16}  # 640 tokens
    eager, _, _ = _run(tiny_model_dirs["llama"], eager=True, **kw)
    graphs, replays, preemptions = _run(tiny_model_dirs["llama"], eager=False, **kw)
    assert sum(replays.values()) > 0 and preemptions > 0
    assert graphs == eager
