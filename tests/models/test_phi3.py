"""Phi-3's rope variants against transformers (float32, CPU): LongRoPE (Phi-3-mini-128k, Phi-3.5-mini), whose
frequencies switch from a short to a long set past ``original_max_position_embeddings`` (O), and partial rotary
(Phi-4-mini: the first 3/4 of each head rotated, the rest passed through; LongRoPE too, tied embeddings).

transformers picks LongRoPE's set per forward pass, and Phi-3's ``generate`` drops its KV cache the first time the
sequence grows past O: a sequence of at most O tokens is rotated with the short set, a longer one with the long
set everywhere. The engine tests compare greedy tokens and every token's logprob with transformers' greedy
decoding by full forward passes (``hf_generate``; equal to ``generate``'s, checked below): prompts on both sides of
the switch and prompts that decode across it, mixed in a batch, in small chunks, with async scheduling, after
preemption, and sharing prefixes across the two regimes with prefix caching on."""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary import (
    RotaryEmbedding,
    longrope_original_max,
    longrope_positions,
    rope_config,
    rotary_dim_of,
)
from tests.utils import make_tiny_model

ORIGINAL_MAX = 32  # the switch: original_max_position_embeddings
MAX_POSITION = 128
BLOCK_SIZE = 4
LOGPROB_ATOL = 1e-4


def longrope_params(half: int, partial: float = 1.0) -> dict:
    """Tiny LongRoPE parameters: short factors near 1, long ones growing to ~40 (as the real lists do), the
    first long factor 1.5 so that even the fastest frequency differs between the sets."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.5 * 1.4**i for i in range(half)],
        "partial_rotary_factor": partial,
    }


def _rope_overrides(params: dict) -> dict:
    """Config keyword arguments for ``params`` in this transformers' spelling."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": params}
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling = None if rest.get("rope_type") == "default" else rest
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


# name -> make_tiny_model("phi3", ...) overrides
VARIANTS = {
    # Phi-3.5-mini's shape: LongRoPE over whole heads (head_dim 16: 8 factors per set)
    "phi35-longrope": dict(
        sliding_window=None,
        max_position_embeddings=MAX_POSITION,
        original_max_position_embeddings=ORIGINAL_MAX,
        **_rope_overrides(longrope_params(8)),
    ),
    # Phi-4-mini's ratios: 3 query heads per KV head, partial_rotary_factor 0.75 (head_dim 32: rotary_dim 24, 12
    # factors per set), LongRoPE, tied embeddings
    "phi4mini": dict(
        sliding_window=None,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        max_position_embeddings=MAX_POSITION,
        original_max_position_embeddings=ORIGINAL_MAX,
        **_rope_overrides(longrope_params(12, partial=0.75)),
    ),
    # Phi-3.5-mini's head size, 96 (not a power of two: the padded attention kernels on a GPU)
    "phi35-hd96": dict(
        sliding_window=None,
        hidden_size=192,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION,
        original_max_position_embeddings=ORIGINAL_MAX,
        **_rope_overrides(longrope_params(48)),
    ),
    # partial rotary with plain RoPE (rotary_dim 12 of head_dim 16)
    "partial-default": dict(
        sliding_window=None,
        partial_rotary_factor=0.75,
        max_position_embeddings=MAX_POSITION,
        **_rope_overrides({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    ),
}


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("phi3_rope")
    return {name: make_tiny_model("phi3", root / name, **kw) for name, kw in VARIANTS.items()}


@lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # else generate() merges the checkpoint's eos back in
    return model


@lru_cache(maxsize=64)
def _hf_generate_one(path: str, prompt: tuple[int, ...], max_new: int) -> tuple[list[int], list[float]]:
    model = _hf_model(path)
    token_ids = list(prompt)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([token_ids]), use_cache=False).logits[0, -1]  # [vocab]
            logprob = torch.log_softmax(logits.float(), dim=-1)
            token = int(logprob.argmax())
            tokens.append(token)
            logprobs.append(logprob[token].item())
            token_ids.append(token)
    return tokens, logprobs


def hf_generate(path: str, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy decoding (float32, one prompt at a time, EOS ignored) with a full forward pass over
    the sequence so far for each new token: each prompt's new tokens and their logprobs.

    That is what ``generate`` computes: its KV cache is an optimization that Phi-3 drops when the sequence first
    grows past O, so that every step sees the rotation of a pass over the whole sequence
    (``test_reference_is_generate``). Without a cache the reference does not depend on how a transformers
    version handles that drop (5.17's ``generate`` differs from it past the switch; 5.24's agrees)."""
    return [_hf_generate_one(path, tuple(p), max_new) for p in prompts]


def assert_match_hf(outs, path: str, prompts: list[list[int]], max_new: int, what: str = "") -> None:
    want = hf_generate(path, prompts, max_new)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, want)):
        comp = out.outputs[0]
        assert list(comp.token_ids) == tokens, f"{what} prompt {i} (len {len(prompts[i])})"
        got = [lps[t].logprob for t, lps in zip(comp.token_ids, comp.logprobs)]
        np.testing.assert_allclose(got, logprobs, atol=LOGPROB_ATOL, rtol=0, err_msg=f"{what} prompt {i}")


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK_SIZE)
    kw.setdefault("async_scheduling", False)
    return LLM(path, device="cpu", dtype="float32", **kw)


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)


def generate(llm: LLM, prompts: list[list[int]], max_new: int):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_new), use_tqdm=False)


def check_idle(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


# ------------------------------------------------------------------------------------------- rope tables


def test_rope_config_partial_only_where_asked(phi3_dirs: dict[str, str]) -> None:
    """Phi-3 asks for partial rotary and LongRoPE and gets transformers' truncated width; every other caller is
    refused."""
    from transformers import AutoConfig, LlamaConfig

    config = AutoConfig.from_pretrained(phi3_dirs["phi4mini"])
    assert rotary_dim_of(config, 32) == 24 and rotary_dim_of(config, 30) == 22  # int(30 * 0.75) = 22
    theta, scaling = rope_config(config, allow_partial=True, allow_longrope=True)
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL_MAX
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_config(config, allow_longrope=True)
    # only Phi-3 reproduces generate's recompute at the switch
    with pytest.raises(ValueError, match="longrope"):
        rope_config(config, allow_partial=True)
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_config(llama)
    assert longrope_original_max(config) == ORIGINAL_MAX
    assert longrope_original_max(AutoConfig.from_pretrained(phi3_dirs["partial-default"])) is None


@pytest.mark.parametrize("name", ["phi35-longrope", "phi4mini", "partial-default"])
def test_rotary_table_rows_match_transformers(phi3_dirs: dict[str, str], name: str) -> None:
    """Our table's rows are transformers' cos/sin: for LongRoPE the short set at rows [0, O), the long set for
    positions O..M-1 at rows [O, M), the long set for positions 0..O-1 at rows [M, M + O)."""
    model = _hf_model(phi3_dirs[name])
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    theta, scaling = rope_config(config, allow_partial=True, allow_longrope=True)
    ours = RotaryEmbedding(head_dim, MAX_POSITION, theta, scaling, rotary_dim_of(config, head_dim))
    half = ours.rotary_dim // 2
    table = ours.cos_sin_cache  # [rows, rotary_dim]: [cos | sin]

    def hf_rows(positions: torch.Tensor) -> torch.Tensor:  # [n] -> [n, rotary_dim] as [cos | sin]
        # transformers' forward picks the set from the pass's largest position, so each set needs its own call
        hf_rotary = type(model.model.rotary_emb)(config)
        cos, sin = hf_rotary(torch.zeros(1), positions[None])  # [1, n, rotary_dim] each, [c | c] and [s | s]
        return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)

    if scaling is None:
        assert table.shape == (MAX_POSITION, 24 if name == "phi4mini" else 12)
        torch.testing.assert_close(table, hf_rows(torch.arange(MAX_POSITION)), atol=0, rtol=0)
        return
    o, m = ORIGINAL_MAX, MAX_POSITION
    assert table.shape[0] == m + o and ours.original_max == o
    long_all = hf_rows(torch.arange(m))  # one pass over every position: the long set
    short = hf_rows(torch.arange(o))  # a pass that ends at the switch: the short set
    torch.testing.assert_close(table[:o], short, atol=0, rtol=0)
    torch.testing.assert_close(table[o:m], long_all[o:], atol=0, rtol=0)
    torch.testing.assert_close(table[m:], long_all[:o], atol=0, rtol=0)
    assert (table[:o] - table[m:]).abs().max() > 1e-2, "the sets do not differ: the tests would prove nothing"


def test_longrope_positions_rule() -> None:
    """Long iff the request has more than O tokens; only its tokens before O move (to M + p)."""
    o, m = 32, 128
    positions = np.array([0, 31, 0, 31, 32, 40, 5, 31], dtype=np.int64)
    num_tokens = np.array([10, 32, 33, 33, 33, 41, 32, 32], dtype=np.int64)
    rows = longrope_positions(positions, num_tokens, o, m)
    assert rows.tolist() == [0, 31, m + 0, m + 31, 32, 40, 5, 31]


def test_reference_is_generate(phi3_dirs: dict[str, str]) -> None:
    """``hf_generate`` (a full pass per token) gives ``generate``'s tokens and logprobs, across the switch too."""
    from transformers import GenerationConfig

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip("checked against transformers 5.24's generate (earlier versions differ past the switch)")
    path = phi3_dirs["phi35-longrope"]
    model = _hf_model(path)
    config = GenerationConfig(
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for prompt in (random_prompt(27, 300, seed=1), random_prompt(40, 300, seed=2)):
        input_ids = torch.tensor([prompt])  # [1, prompt_len]
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(x[0].float(), dim=-1)[t].item() for x, t in zip(out.logits, tokens)]
        ((want_tokens, want_logprobs),) = hf_generate(path, [prompt], 12)
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- engine vs HF


@pytest.mark.parametrize("name", ["phi35-longrope", "phi4mini", "phi35-hd96"])
def test_longrope_generate_across_switch(phi3_dirs: dict[str, str], name: str) -> None:
    """Short prompts that decode past the switch, long prompts, and both in one batch, whole, in chunks of 8
    tokens and with async scheduling, match ``generate``."""
    path = phi3_dirs[name]
    short = [random_prompt(n, 300, seed=n) for n in (12, 27, 32)]  # 32: the longest short prompt
    long = [random_prompt(n, 300, seed=100 + n) for n in (33, 45)]
    max_new = 12  # the short prompts end at 24, 39 and 44: the last two cross the switch while decoding
    llm = make_llm(path, max_model_len=MAX_POSITION)
    assert_match_hf(generate(llm, short, max_new), path, short, max_new, "short alone")
    assert_match_hf(generate(llm, long, max_new), path, long, max_new, "long alone")
    mixed = [short[1], long[0], short[2], long[1], short[0]]
    assert_match_hf(generate(llm, mixed, max_new), path, mixed, max_new, "mixed")
    check_idle(llm)
    chunked = make_llm(
        path, max_model_len=MAX_POSITION, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert_match_hf(generate(chunked, mixed, max_new), path, mixed, max_new, "chunked")
    check_idle(chunked)
    # async scheduling: a request may cross the switch with its last token still in flight
    pipelined = make_llm(path, max_model_len=MAX_POSITION, async_scheduling=True)
    assert_match_hf(generate(pipelined, mixed, max_new), path, mixed, max_new, "async")
    check_idle(pipelined)


def test_longrope_prefix_cache_keeps_regimes_apart(phi3_dirs: dict[str, str]) -> None:
    """A short and a long prompt with a common prefix: the prefix's keys are rotated with different sets, so
    neither may reuse the other's blocks (in either order); two long prompts (or two short ones) still share
    theirs. Every output matches ``generate``."""
    path = phi3_dirs["phi35-longrope"]
    shared = random_prompt(24, 300, seed=7)  # 6 full blocks
    short = shared + random_prompt(6, 300, seed=8)  # 30 tokens (+ 2 new: never past the switch)
    short2 = shared + random_prompt(4, 300, seed=12)
    long = shared + random_prompt(16, 300, seed=9)  # 40 tokens
    long2 = shared + random_prompt(12, 300, seed=10)
    max_new = 2
    for order in ([short, long, long2, short2], [long, short, short2, long2]):
        llm = make_llm(path, max_model_len=MAX_POSITION, max_num_batched_tokens=16)
        cached = []
        for prompt in order:
            out = generate(llm, [prompt], max_new)
            assert_match_hf(out, path, [prompt], max_new, f"len {len(prompt)}")
            cached.append(out[0].num_cached_tokens)
        # the second prompt is of the other regime: no hit; the third and fourth hit their own regime's prefix
        assert cached[1] == 0, cached
        assert cached[2] >= len(shared) and cached[3] >= len(shared), cached
        check_idle(llm)


def test_longrope_decode_across_switch_recomputes_long(phi3_dirs: dict[str, str]) -> None:
    """A short prompt decodes past the switch: the engine restarts it in the long regime, as ``generate``
    recomputes its cache. Its long blocks then serve its own prompt + output sent again as a long prompt, while a
    short prompt with its first tokens only hits the short blocks computed before the switch."""
    path = phi3_dirs["phi35-longrope"]
    prompt = random_prompt(28, 300, seed=21)
    max_new = 16
    llm = make_llm(path, max_model_len=MAX_POSITION)
    first = generate(llm, [prompt], max_new)
    assert_match_hf(first, path, [prompt], max_new, "short")
    assert llm.llm_engine.engine_core.scheduler.num_preemptions == 0  # the restart is not a preemption
    again = prompt + list(first[0].outputs[0].token_ids)  # 44 tokens: a long prompt
    out = generate(llm, [again], max_new)
    # every full block of the first run's long-regime recompute and decode
    assert out[0].num_cached_tokens >= 40
    assert_match_hf(out, path, [again], max_new, "long")
    short = prompt[:20] + random_prompt(6, 300, seed=22)
    out = generate(llm, [short], 4)
    assert out[0].num_cached_tokens == 20  # the short blocks from before the first run crossed the switch
    assert_match_hf(out, path, [short], 4, "short again")
    check_idle(llm)


@pytest.mark.usefixtures("admit_while_blocks_last")
def test_longrope_preemption(phi3_dirs: dict[str, str]) -> None:
    """A pool too small for the batch: requests are preempted and recomputed (their prompt and output as one
    prefill), and still match ``generate``, on both sides of the switch."""
    path = phi3_dirs["phi4mini"]
    prompts = [random_prompt(n, 300, seed=200 + n) for n in (26, 36, 30, 40)]
    max_new = 14
    llm = make_llm(path, max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks_override=26)
    outs = generate(llm, prompts, max_new)
    assert_match_hf(outs, path, prompts, max_new, "preempted")
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0  # else nothing was recomputed
    check_idle(llm)


def test_partial_rotary_generate(phi3_dirs: dict[str, str]) -> None:
    """Partial rotary with plain RoPE: greedy tokens and logprobs match ``generate``, chunked and with a prefix hit."""
    path = phi3_dirs["partial-default"]
    shared = random_prompt(20, 300, seed=31)
    prompts = [shared + random_prompt(9, 300, seed=32), random_prompt(50, 300, seed=33), shared + [5, 6, 7]]
    max_new = 12
    llm = make_llm(path, max_num_batched_tokens=8)
    assert_match_hf(generate(llm, prompts[:1], max_new), path, prompts[:1], max_new, "partial alone")
    outs = generate(llm, prompts, max_new)  # the first two again, and the third hits the shared prefix
    assert_match_hf(outs, path, prompts, max_new, "partial")
    assert outs[2].num_cached_tokens >= 16
    check_idle(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["phi35-longrope", "phi4mini", "phi35-hd96"])
def test_longrope_on_gpu(phi3_dirs: dict[str, str], name: str) -> None:
    """The Triton path (fused RoPE writing the KV cache, padded rotary halves for Phi-4-mini's 12, CUDA graphs for
    decode and piecewise graphs for the rest, or eager) in float32 against ``generate``: each prompt's tokens
    agree up to a first difference, if any, where transformers' token is our second choice within 1e-2 of
    ours (TF32 attention), and the logprobs before it agree within 2e-3."""
    path = phi3_dirs[name]
    prompts = [random_prompt(n, 300, seed=300 + n) for n in (27, 45, 32, 12, 36)]
    max_new = 12
    want = hf_generate(path, prompts, max_new)
    for kw in ({}, {"enforce_eager": True}, {"max_num_batched_tokens": 16}):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            block_size=16,
            max_model_len=MAX_POSITION,
            kv_cache_memory_bytes=16 << 20,
            **kw,
        )
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (out, (tokens, logprobs)) in enumerate(zip(outs, want)):
            comp = out.outputs[0]
            for j, (ours, ref) in enumerate(zip(comp.token_ids, tokens)):
                lps = comp.logprobs[j]
                if ours != ref:
                    assert ref in lps and lps[ours].logprob - lps[ref].logprob < 1e-2, (kw, i, j)
                    break
                assert abs(lps[ours].logprob - logprobs[j]) < 2e-3, (kw, i, j)
        check_idle(llm)
        del llm
        torch.cuda.empty_cache()
