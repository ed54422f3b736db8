"""FP8 KV cache (``kv_cache_dtype="fp8"``): the PyTorch path against attention over dequantized values (exact),
the engine against the float32 cache (greedy agreement, logprob drift), capacity, checkpoint scales, bad input.

Agreement is measured teacher-forced: the FP8 engine scores the float32 engine's greedy continuations as prompts,
and a token agrees when it is the FP8 engine's argmax at that position too (same context on both sides, so one
early flip does not count every later token). The free-running rate (position by position) is printed as well.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import fields, replace

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.base import FP8_KV_DTYPE
from pagedllm.attention.torch_ref import TorchAttentionBackend, paged_attention_ref, quantize_kv_fp8
from pagedllm.config import CacheConfig, make_engine_config
from pagedllm.layers.attention import Attention
from tests.attention.test_torch_ref import REQUESTS, build_step

MAX_NEW = 12
FP8_ARCHS = ("llama", "qwen3", "mistral", "gemma2")  # plain, q/k norms, sliding window, soft-cap + window


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize("bad", ["fp16", "float8", "int8", "", None])
def test_bad_kv_cache_dtype_is_rejected(bad) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype=bad)


def test_bad_kv_cache_dtype_from_llm(tiny_llama) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine_config(tiny_llama, device="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_llama, device="cpu", kv_cache_dtype="bf16")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_cache_torch_dtype(name: str) -> None:
    assert CacheConfig(cache_dtype=name).kv_cache_torch_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert CacheConfig().kv_cache_torch_dtype(torch.bfloat16) == torch.bfloat16


def test_kv_cache_dtype_flag() -> None:
    import argparse

    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    assert engine_kwargs_from_args(parser.parse_args(["m"]))["kv_cache_dtype"] == "auto"
    assert (
        engine_kwargs_from_args(parser.parse_args(["m", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"]
        == "fp8"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "int8"])


# ---------------------------------------------------------------------- torch_ref


def test_quantize_clamps_and_rounds() -> None:
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, 1040.0, -1e6, 448.0 * 2.5])
    q = quantize_kv_fp8(x, 2.5)
    assert q.dtype == FP8_KV_DTYPE
    # steps of 32 in [256, 448]: 400 is a tie (to even: 384), 416 exact; beyond 448 clamped, not inf/NaN
    assert q.float().tolist()[3:] == [384.0, 416.0, -448.0, 448.0]
    assert torch.equal(q, (x / 2.5).clamp(-448, 448).to(FP8_KV_DTYPE))
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"logits_soft_cap": 2.0}])
def test_torch_ref_fp8_equals_attention_on_dequantized(k_scale, v_scale, block_size, options) -> None:
    """Writing into an FP8 cache then attending == attending over a float32 cache of ``fp8 * scale``, bit for bit
    (prefill chunks, a lone decode and batched decodes all in one step)."""
    query, key, value, kv32, metadata, _ = build_step(REQUESTS, block_size, 4, 2, num_pad=2, seed=3)
    kv32 = kv32 * 4  # keys/values up to ~16: scale 0.05 pushes some past 448 (clamped)
    key, value = key * 4, value * 4
    kv8 = torch.stack([quantize_kv_fp8(kv32[0], k_scale), quantize_kv_fp8(kv32[1], v_scale)])
    scale = 8**-0.5
    out = TorchAttentionBackend().forward(
        query, key, value, kv8, metadata, scale, k_scale=k_scale, v_scale=v_scale, **options
    )
    # this step's tokens were quantized on the way in; padding (slot -1) was not written
    slots = metadata.slot_mapping[: metadata.num_tokens]
    flat = kv8.view(2, -1, *kv8.shape[-2:])  # [2, num_slots, num_kv_heads, head_dim]
    n = metadata.num_tokens
    assert torch.equal(flat[0, slots].view(torch.uint8), quantize_kv_fp8(key[:n], k_scale).view(torch.uint8))
    assert torch.equal(
        flat[1, slots].view(torch.uint8), quantize_kv_fp8(value[:n], v_scale).view(torch.uint8)
    )
    deq = torch.stack([kv8[0].float() * k_scale, kv8[1].float() * v_scale])  # [2, blocks, bs, kv_heads, hd]
    expected = paged_attention_ref(
        query,
        deq[0],
        deq[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale,
        **options,
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # and close to the unquantized attention (e4m3 keeps 3 mantissa bits; clamping only with the small scale)
    kv32_written = kv32.clone()
    TorchAttentionBackend().forward(query, key, value, kv32_written, metadata, scale, **options)
    exact = paged_attention_ref(
        query, kv32_written[0], kv32_written[1], metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, scale, **options,
    )  # fmt: skip
    rel = ((out - exact).norm() / exact.norm()).item()
    assert rel < (0.5 if k_scale < 1 else 0.1), rel


def test_scales_ignored_for_a_model_dtype_cache() -> None:
    query, key, value, kv, metadata, _ = build_step(REQUESTS, 4, 4, 2, seed=4)
    kv2 = kv.clone()
    a = TorchAttentionBackend().forward(query, key, value, kv, metadata, 0.3)
    b = TorchAttentionBackend().forward(query, key, value, kv2, metadata, 0.3, k_scale=0.1, v_scale=7.0)
    assert torch.equal(a, b) and torch.equal(kv, kv2)


# ---------------------------------------------------------------------- engine


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    return LLM(path, **kw)


def _prompts(vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 17, 9, 30, 1, 45)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _scored(llm: LLM, prompts: list[list[int]], outs: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Teacher-forced: (logprob, rank) of each given continuation token, with the context before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    res = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, outs)], params, use_tqdm=False)
    scored = []
    for p, o, r in zip(prompts, outs, res):
        entries = r.prompt_logprobs[len(p) :]  # one dict per continuation token
        scored.append([(e[t].logprob, e[t].rank) for e, t in zip(entries, o)])
    return scored


def _fp8_vs_fp32(path: str, device: str = "cpu", **fp8_kw) -> tuple[int, int, int, float]:
    """(agreeing teacher-forced tokens, free-running equal tokens, total, max |dlogprob|) for one model."""
    on_gpu = {} if device == "cpu" else {"device": device, "kv_cache_memory_bytes": 64 << 20}
    fp8_kw = {**on_gpu, **fp8_kw}
    ref_llm = _llm(path, **on_gpu)
    prompts = _prompts(ref_llm.llm_engine.engine_core.vocab_size)
    ref = _greedy(ref_llm, prompts)
    ref_scored = _scored(ref_llm, prompts, ref)
    del ref_llm
    llm = _llm(path, kv_cache_dtype="fp8", **fp8_kw)
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.llm_engine.engine_core.runner.kv_caches)
    free = _greedy(llm, prompts)
    scored = _scored(llm, prompts, ref)
    agree = sum(rank == 1 for row in scored for _, rank in row)
    # sampling-aware tolerance (vLLM's check_logprobs_close): a disagreement is a near tie, the float32 token
    # still among the FP8 side's top 3
    assert max(rank for row in scored for _, rank in row) <= 3, scored
    same = sum(a == b for x, y in zip(ref, free) for a, b in zip(x, y))
    drift = max(abs(a[0] - b[0]) for x, y in zip(ref_scored, scored) for a, b in zip(x, y))
    assert all(rank == 1 for row in ref_scored for _, rank in row)  # the float32 side scores its own argmax
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    return agree, same, sum(map(len, ref)), drift


def test_fp8_cache_greedy_agreement_and_logprob_drift(tiny_model_dirs) -> None:
    agree = same = total = 0
    worst = 0.0
    for arch in FP8_ARCHS:
        a, s, n, drift = _fp8_vs_fp32(tiny_model_dirs[arch])
        print(f"{arch}: teacher-forced agreement {a}/{n}, free-running {s}/{n}, max |dlogprob| {drift:.4f}")
        agree, same, total, worst = agree + a, same + s, total + n, max(worst, drift)
    rate = agree / total
    print(
        f"FP8 KV cache vs float32: greedy agreement {rate:.1%} teacher-forced ({agree}/{total}), "
        f"{same / total:.1%} free-running; max |dlogprob| of the chosen tokens {worst:.4f}"
    )
    assert rate >= 0.9, rate
    assert worst < 1.0, worst  # loose: e4m3 keys/values move logprobs by a few hundredths here


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_capacity(tiny_llama, name: str) -> None:
    """With ``kv_cache_memory_bytes`` fixed, an FP8 cache holds twice the blocks of bf16, four times float32."""
    budget = 1 << 20

    def num_blocks(**kw) -> int:
        llm = _llm(tiny_llama, kv_cache_memory_bytes=budget, **kw)
        core = llm.llm_engine.engine_core
        mc = core.runner.config.model_config
        num = core.kv_cache_info["num_blocks"]
        assert core.runner.kv_caches[0].shape == (2, num, 4, mc.num_kv_heads, mc.head_dim)
        return num

    fp32 = num_blocks(dtype="float32")
    bf16 = num_blocks(dtype="bfloat16")
    fp8 = num_blocks(dtype="float32", kv_cache_dtype=name)
    fp8_bf16 = num_blocks(dtype="bfloat16", kv_cache_dtype=name)
    assert fp8 == fp8_bf16 == 2 * bf16 == 4 * fp32, (fp32, bf16, fp8, fp8_bf16)


def test_fp8_cache_shape_and_log(tiny_llama, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = _llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20)
    ref = _llm(tiny_llama, kv_cache_memory_bytes=1 << 20)
    c8 = llm.llm_engine.engine_core.runner.kv_caches
    c32 = ref.llm_engine.engine_core.runner.kv_caches
    assert len(c8) == len(c32) and c8[0].dtype == torch.float8_e4m3fn
    assert c8[0].shape[0] == 2 and c8[0].shape[2:] == c32[0].shape[2:]
    assert "KV cache dtype torch.float8_e4m3fn" in caplog.text
    assert "no k_scale/v_scale in the checkpoint: scales 1.0" in caplog.text


# ---------------------------------------------------------------------- checkpoint scales


def _with_kv_scales(src: str, dst, extra: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (path,) = list(dst.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(dst)


def _attn_layers(llm: LLM) -> list[Attention]:
    model = llm.llm_engine.engine_core.runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_checkpoint_kv_scales_are_loaded(tiny_llama, tmp_path, caplog) -> None:
    path = _with_kv_scales(
        tiny_llama,
        tmp_path / "scaled",
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # vLLM / llm-compressor
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),  # the older single scale
        },
    )
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = _llm(path, kv_cache_dtype="fp8")
    layers = _attn_layers(llm)
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.25), (2.0, 2.0)]
    assert "from the checkpoint for 2 of 2 attention layers" in caplog.text
    # the scales are used: the cache holds k / k_scale
    prompt = list(range(5, 25))
    out = _greedy(llm, [prompt])
    cache = llm.llm_engine.engine_core.runner.kv_caches[0]
    assert cache.float().abs().max() > 0
    # and greedy output stays close to the float32 cache
    ref = _greedy(_llm(tiny_llama), [prompt])
    assert sum(a == b for a, b in zip(out[0], ref[0])) >= MAX_NEW // 2, (out, ref)
    # a model-dtype cache accepts (and ignores) them
    auto = _llm(path)
    assert [(a.k_scale, a.v_scale) for a in _attn_layers(auto)] == [(0.5, 0.25), (2.0, 2.0)]
    assert _greedy(auto, [prompt]) == ref


def test_modelopt_and_compressed_tensors_scale_names(tiny_llama, tmp_path) -> None:
    path = _with_kv_scales(
        tiny_llama,
        tmp_path / "modelopt",
        {
            "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.75),  # ModelOpt
            "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(1.5),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([3.0]),  # compressed-tensors
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.125]),
        },
    )
    layers = _attn_layers(_llm(path, kv_cache_dtype="fp8"))
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.75, 1.5), (3.0, 0.125)]


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "per-tensor"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "v_scale"),
        ({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, "unexpected keys"),  # no such layer
    ],
)
def test_bad_checkpoint_kv_scales(tiny_llama, tmp_path, extra, match) -> None:
    path = _with_kv_scales(tiny_llama, tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=match):
        _llm(path, kv_cache_dtype="fp8")


# ---------------------------------------------------------------------- GPU (Triton write and read paths)

LONG_REQUESTS = [(1, 1), (3000, 1), (700, 1), (530, 37), (64, 64), (1, 1)]  # decodes (split-K), chunk, prefill


def _to(metadata, device: str):
    moved = {
        f.name: getattr(metadata, f.name).to(device)
        for f in fields(metadata)
        if isinstance(getattr(metadata, f.name), torch.Tensor) and not f.name.endswith("_cpu")
    }
    return replace(metadata, **moved)


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [REQUESTS, LONG_REQUESTS], ids=["short", "long"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 100}, {"logits_soft_cap": 2.0}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_cache_matches_torch_ref_gpu(requests, k_scale, v_scale, options, dtype, monkeypatch) -> None:
    """The Triton backend on an FP8 cache (its reshape_and_cache quantizes on the way in, the kernel dequantizes
    on the way out) writes the same bytes as the PyTorch path and attends to within bf16 rounding of it."""
    import tests.attention.test_torch_ref as ref_tests
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(ref_tests, "HEAD_DIM", 64)  # the Triton kernel needs a power of two >= 16
    query, key, value, kv, metadata, _ = build_step(requests, 16, 8, 2, num_pad=3, dtype=dtype, seed=5)
    kv = kv.float() * 4  # keys/values up to ~16: scale 0.05 pushes some past 448 (clamped)
    key, value = key * 4, value * 4
    kv8 = torch.stack([quantize_kv_fp8(kv[0], k_scale), quantize_kv_fp8(kv[1], v_scale)]).cuda()
    q, k, v, md = query.cuda(), key.cuda(), value.cuda(), _to(metadata, "cuda")
    scale = 64**-0.5
    cache_t, cache_r = kv8.clone(), kv8.clone()
    kw = dict(k_scale=k_scale, v_scale=v_scale, **options)
    out_t = TritonAttentionBackend().forward(q, k, v, cache_t, md, scale, **kw)
    TorchAttentionBackend().forward(q, k, v, cache_r, md, scale, **kw)
    # The writes: the same e4m3 codes, or (a tie rounded the other way) the neighbouring code.
    codes_t, codes_r = cache_t.view(torch.uint8).int(), cache_r.view(torch.uint8).int()
    differ = codes_t != codes_r
    assert ((codes_t - codes_r).abs()[differ] == 1).all()
    assert differ.float().mean().item() < 0.01
    # The reads: the PyTorch path attending over the cache the Triton path wrote (writing nothing itself).
    read_only = replace(md, slot_mapping=torch.full_like(md.slot_mapping, -1))
    out_r = TorchAttentionBackend().forward(q, k, v, cache_t.clone(), read_only, scale, **kw)
    torch.cuda.synchronize()
    n = md.num_tokens
    assert (out_t[n:] == 0).all()  # padding rows
    err = ((out_t[:n].float() - out_r[:n].float()).norm() / out_r[:n].float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
def test_fp8_cache_engine_gpu(tiny_model_dirs) -> None:
    """On the GPU (Triton attention, CUDA graphs): the FP8 cache holds twice the blocks of bf16 in the same bytes,
    and its greedy tokens agree with the float32 cache's teacher-forced on >= 90% of positions (the CPU test's
    rule, over the same architectures)."""
    path = tiny_model_dirs["llama"]
    blocks = {}
    for name in ("auto", "fp8"):
        llm = _llm(path, dtype="bfloat16", device="cuda", kv_cache_dtype=name, kv_cache_memory_bytes=64 << 20)
        blocks[name] = llm.llm_engine.engine_core.kv_cache_info["num_blocks"]
        if name == "fp8":
            core = llm.llm_engine.engine_core
            assert core.runner.kv_caches[0].dtype == FP8_KV_DTYPE and core.runner.graph_runner is not None
        del llm
    assert blocks["fp8"] == 2 * blocks["auto"], blocks
    agree = total = 0
    for arch in FP8_ARCHS:
        a, _, n, drift = _fp8_vs_fp32(tiny_model_dirs[arch], device="cuda")
        print(f"{arch}: teacher-forced agreement {a}/{n} on the GPU, max |dlogprob| {drift:.4f}")
        agree, total = agree + a, total + n
    assert agree / total >= 0.9, (agree, total)
