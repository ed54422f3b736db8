"""Our models vs HF transformers on tiny random checkpoints (float32, CPU, torch attention backend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from tests.utils import hf_greedy, hf_logprobs, make_tiny_model

ATOL = 1e-4
BLOCK_SIZE = 4
# Qwen2/3 with use_sliding_window: transformers marks layers >= max_window_layers "sliding_attention".
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}

# variant -> (arch, make_tiny_model options); the plain archs come from the session fixture
VARIANTS = {
    "llama": ("llama", {}),
    "llama3": ("llama3", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "qwen2-window": ("qwen2", QWEN_WINDOW),
    "qwen3-window": ("qwen3", QWEN_WINDOW),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen2-sharded": ("qwen2", {"shard": True}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tiny_model_dirs, tmp_path_factory) -> str:
    arch, options = VARIANTS[request.param]
    if not options:
        return tiny_model_dirs[arch]
    path = make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **options)
    if options.get("shard"):
        assert (Path(path) / "model.safetensors.index.json").is_file()
    return path


def load_ours(path: str, **kwargs) -> tuple[torch.nn.Module, ModelConfig]:
    model_config = ModelConfig(model=path, dtype="float32", **kwargs)
    model = get_model(model_config, torch.device("cpu"), TorchAttentionBackend())
    return model, model_config


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([token_ids])).logits[0].float()


class PagedRunner:
    """A minimal stand-in for the model runner: scattered blocks per request, hand-built metadata."""

    def __init__(self, model, model_config: ModelConfig, num_blocks: int = 64, num_pad: int = 0) -> None:
        self.model = model
        self.num_pad = num_pad  # padding tokens appended to each step (slot -1)
        self.kv_caches = [
            torch.zeros(2, num_blocks, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim)
            for _ in range(model_config.num_layers)
        ]  # each [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.block_ids: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run each request's next tokens in one flattened forward; its logits [len(chunk), vocab]."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for req_id, chunk in chunks.items():
            start = self.num_computed.get(req_id, 0)
            end = start + len(chunk)
            blocks = self.block_ids.setdefault(req_id, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids += chunk
            positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + len(chunk))
            seq_lens.append(end)
            self.num_computed[req_id] = end
        num_tokens = len(input_ids)
        input_ids += [0] * self.num_pad
        positions += [0] * self.num_pad
        slots += [-1] * self.num_pad
        max_blocks = max(len(self.block_ids[r]) for r in chunks)
        block_table = torch.full((len(chunks), max_blocks), 0, dtype=torch.int32)  # [num_reqs, max_blocks]
        for i, req_id in enumerate(chunks):
            block_table[i, : len(self.block_ids[req_id])] = torch.tensor(self.block_ids[req_id])
        query_lens = [len(c) for c in chunks.values()]
        metadata = AttentionMetadata(
            num_reqs=len(chunks),
            num_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            is_pure_decode=all(n == 1 for n in query_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata
        )  # [num_tokens + num_pad, hidden]
        logits = self.model.compute_logits(hidden[:num_tokens])  # [num_tokens, vocab]
        assert logits.dtype == torch.float32
        return {r: logits[query_start_loc[i] : query_start_loc[i + 1]] for i, r in enumerate(chunks)}


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_ragged_and_chunked_logits(path: str, model, model_config, prompt_lens, atol: float) -> None:
    """transformers' logits at every position: a ragged prefill of prompts of ``prompt_lens`` in one forward, then
    one 19-token sequence in chunks of 7, 5 and 3 and single-token decodes, with two padding tokens."""
    prompts = [random_prompt(n, model_config.vocab_size, seed=n) for n in prompt_lens]
    out = PagedRunner(model, model_config).step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], hf_logits(path, prompt), atol=atol, rtol=0)
    seq = random_prompt(19, model_config.vocab_size, seed=3)
    expected = hf_logits(path, seq)
    runner = PagedRunner(model, model_config, num_pad=2)
    done = 0
    for size in (7, 5, 3, 1, 1, 1, 1):
        out = runner.step({0: seq[done : done + size]})
        torch.testing.assert_close(out[0], expected[done : done + size], atol=atol, rtol=0)
        done += size


def test_ragged_prefill_matches_hf(model_dir: str) -> None:
    model, model_config = load_ours(model_dir)
    prompts = [random_prompt(n, model_config.vocab_size, seed=n) for n in (5, 17, 9)]
    out = PagedRunner(model, model_config).step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], hf_logits(model_dir, prompt), atol=ATOL, rtol=0)


def test_chunked_decode_matches_hf(model_dir: str) -> None:
    model, model_config = load_ours(model_dir)
    seqs = {
        0: random_prompt(19, model_config.vocab_size, seed=1),
        1: random_prompt(13, model_config.vocab_size, 2),
    }
    # chunk sizes per step: prefix chunks, then mixed chunk + decode steps, then single-token decode
    schedule = {0: [7, 5, 1, 3, 1, 1, 1], 1: [5, 1, 4, 1, 1, 1]}
    expected = {r: hf_logits(model_dir, seq) for r, seq in seqs.items()}
    runner = PagedRunner(model, model_config, num_pad=2)
    done = {r: 0 for r in seqs}
    for step in range(max(len(s) for s in schedule.values())):
        chunks = {}
        for r, sizes in schedule.items():
            if step < len(sizes):
                chunks[r] = seqs[r][done[r] : done[r] + sizes[step]]
        out = runner.step(chunks)
        for r, chunk in chunks.items():
            torch.testing.assert_close(out[r], expected[r][done[r] : done[r] + len(chunk)], atol=ATOL, rtol=0)
            done[r] += len(chunk)
    assert done == {r: len(s) for r, s in seqs.items()}


# --- loader ---------------------------------------------------------------------------------------


def _edit_checkpoint(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_missing_key_fails(tiny_llama: str, tmp_path: Path) -> None:
    path = _edit_checkpoint(
        tiny_llama, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
    )
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_ours(path)


def test_unexpected_key_fails(tiny_llama: str, tmp_path: Path) -> None:
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    path = _edit_checkpoint(tiny_llama, tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"unexpected.*extra_proj"):
        load_ours(path)


def test_shape_mismatch_fails(tiny_llama: str, tmp_path: Path) -> None:
    def shrink(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()

    path = _edit_checkpoint(tiny_llama, tmp_path / "m", shrink)
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_ours(path)


def test_rotary_inv_freq_is_ignored(tiny_llama: str, tmp_path: Path) -> None:
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    load_ours(_edit_checkpoint(tiny_llama, tmp_path / "m", add))


def test_unsupported_architecture(tiny_llama: str, tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FancyForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_ours(str(path))


def test_dummy_weights_finite_and_seeded(tiny_model_dirs: dict[str, str]) -> None:
    path = tiny_model_dirs["qwen3"]

    def logits(seed: int) -> torch.Tensor:
        model, model_config = load_ours(path, load_format="dummy", seed=seed)
        return PagedRunner(model, model_config).step({0: list(range(3, 12))})[0]

    a, b, c = logits(0), logits(0), logits(1)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_bfloat16_close_to_float32(tiny_llama: str) -> None:
    model, model_config = load_ours(tiny_llama)
    model_bf16 = get_model(
        ModelConfig(model=tiny_llama, dtype="bfloat16"), torch.device("cpu"), TorchAttentionBackend()
    )
    assert next(model_bf16.parameters()).dtype == torch.bfloat16
    prompt = random_prompt(10, model_config.vocab_size, seed=3)
    ref = PagedRunner(model, model_config).step({0: prompt})[0]
    runner = PagedRunner(model_bf16, model_config)
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    out = runner.step({0: prompt})[0]
    assert (out - ref).abs().max() < 0.25 * ref.abs().max()


# --- the shared tiny-model oracles (tests/utils.py) -------------------------------------------------


def test_hf_greedy_is_varied_and_ignores_eos(tiny_llama: str, tmp_path: Path) -> None:
    prompt = random_prompt(6, 400, seed=4)
    out = hf_greedy(tiny_llama, [prompt], 16)[0]
    assert len(out) == 16 and len(set(out)) > 4  # not stuck on one token
    # make the 4th generated token the EOS: generation must still run to max_new_tokens
    path = tmp_path / "m"
    shutil.copytree(tiny_llama, path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = out[3]
        (path / name).write_text(json.dumps(cfg))
    assert hf_greedy(path, [prompt], 16)[0] == out
    logprobs = hf_logprobs(tiny_llama, prompt + out)  # [len, vocab]
    assert logprobs[len(prompt) - 1 : -1].argmax(-1).tolist() == out


def test_model_from_pickled_config_is_the_same(model_dir: str) -> None:
    """The engine core process receives the HF config as plain attributes (no transformers classes): a model
    built from it has the same parameters and logits as one built from the transformers config."""
    import pickle

    from pagedllm.config import PlainHFConfig

    model, model_config = load_ours(model_dir)
    plain_config = pickle.loads(pickle.dumps(model_config))
    assert isinstance(plain_config.hf_config, PlainHFConfig)
    assert type(model_config.hf_config).__module__.startswith("transformers")  # the original is untouched
    plain = get_model(plain_config, torch.device("cpu"), TorchAttentionBackend())
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [
        (n, p.shape) for n, p in model.named_parameters()
    ]
    prompt = {0: list(range(3, 14))}
    torch.testing.assert_close(
        PagedRunner(plain, plain_config).step(prompt)[0], PagedRunner(model, model_config).step(prompt)[0]
    )


# --- sliding windows (and Gemma 2's soft-caps) --------------------------------------------------------

# variant -> (arch, make_tiny_model options) of the tiny models whose window is far shorter than SW_LEN
WINDOWED = {
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "qwen2-window": ("qwen2", QWEN_WINDOW),
    "qwen3-window": ("qwen3", QWEN_WINDOW),
}
SW_LEN = 64  # prompt tokens in the long-sequence tests: 4x the 16-token windows, 2x Phi-3's 32


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed_dir(request, tiny_model_dirs, tmp_path_factory) -> str:
    arch, options = WINDOWED[request.param]
    if not options:
        return tiny_model_dirs[arch]
    return make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **options)


def _attn_layers(model) -> list:
    return [layer.self_attn.attn for layer in model.model.layers]


def test_per_layer_windows(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    """Which layers slide, as transformers decides it: Mistral / Phi-3 every layer, Qwen2/3 only with
    use_sliding_window and then the layers that layer_types marks (layers >= max_window_layers), Gemma 2 per
    layer_types (alternating, layer 0 local), Gemma 3 per layer_types (local layers with their own RoPE),
    Llama / Gemma none."""

    def windows(path: str) -> list[int | None]:
        return [a.sliding_window for a in _attn_layers(load_ours(path)[0])]

    assert windows(tiny_model_dirs["mistral"]) == [16, 16]
    assert windows(tiny_model_dirs["phi3"]) == [32, 32]
    assert windows(tiny_model_dirs["gemma2"]) == [16, None]
    assert windows(tiny_model_dirs["gemma3"]) == [16, None]
    assert windows(tiny_model_dirs["llama"]) == [None, None]
    assert windows(tiny_model_dirs["gemma"]) == [None, None]
    assert windows(tiny_model_dirs["qwen2"]) == [None, None]  # carries a window, use_sliding_window false
    assert windows(make_tiny_model("qwen2", tmp_path / "q2", **QWEN_WINDOW)) == [None, 16]
    all_sliding = {**QWEN_WINDOW, "max_window_layers": 0}
    assert windows(make_tiny_model("qwen3", tmp_path / "q3", **all_sliding)) == [16, 16]
    explicit = {**QWEN_WINDOW, "layer_types": ["sliding_attention", "full_attention"]}  # layer_types win
    assert windows(make_tiny_model("qwen2", tmp_path / "q2t", **explicit)) == [16, None]
    gemma2 = _attn_layers(load_ours(tiny_model_dirs["gemma2"])[0])
    assert [a.logits_soft_cap for a in gemma2] == [4.0, 4.0] and gemma2[0].scale == 24**-0.5
    gemma3 = load_ours(tiny_model_dirs["gemma3"])[0].model.layers
    assert gemma3[0].self_attn.rotary_emb is not gemma3[1].self_attn.rotary_emb  # local vs global RoPE


def test_sliding_window_no_longer_caps_max_model_len(tiny_model_dirs: dict[str, str]) -> None:
    """The window is applied by the attention, so a windowed model serves its full position range."""
    phi3 = ModelConfig(model=tiny_model_dirs["phi3"])
    assert phi3.sliding_window == 32 and phi3.max_model_len == 512
    assert ModelConfig(model=tiny_model_dirs["mistral"], max_model_len=400).max_model_len == 400
    with pytest.raises(ValueError, match=r"max_model_len \(600\).*maximum context \(512\)"):
        ModelConfig(model=tiny_model_dirs["phi3"], max_model_len=600)


def test_long_sequence_chunks_and_decodes_match_hf(windowed_dir: str) -> None:
    """Logits over a sequence 4x the window: a prefill chunk, a chunk over the cached prefix that crosses the
    window, a mixed step with another request, then decodes; block size 4 so windows start mid-block."""
    model, model_config = load_ours(windowed_dir)
    seqs = {
        0: random_prompt(SW_LEN + 6, model_config.vocab_size, seed=11),
        1: random_prompt(40, model_config.vocab_size, seed=12),
    }
    schedule = {0: [21, 30, 13, 1, 1, 1, 1, 1, 1], 1: [7, 1, 25, 1, 3, 1, 1, 1]}
    expected = {r: hf_logits(windowed_dir, seq) for r, seq in seqs.items()}
    runner = PagedRunner(model, model_config, num_blocks=64, num_pad=1)
    done = {r: 0 for r in seqs}
    for step in range(max(len(s) for s in schedule.values())):
        chunks = {
            r: seqs[r][done[r] : done[r] + sizes[step]] for r, sizes in schedule.items() if step < len(sizes)
        }
        out = runner.step(chunks)
        for r, chunk in chunks.items():
            torch.testing.assert_close(out[r], expected[r][done[r] : done[r] + len(chunk)], atol=ATOL, rtol=0)
            done[r] += len(chunk)
    assert done == {r: len(s) for r, s in seqs.items()}


def _without_window(path: str, dst: Path) -> str:
    """The same checkpoint with the window pushed past max_position_embeddings (full attention everywhere)."""
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    config["sliding_window"] = 4096
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_windowed_greedy_through_llm_matches_transformers(windowed_dir: str, tmp_path: Path) -> None:
    """pagedllm.LLM greedy = transformers greedy, token for token, on prompts longer than the window: with
    small prefill chunks, and with prefix caching serving a shared prefix longer than the window. The window
    matters: transformers' own output changes without it (else this test could not catch an ignored window)."""
    from pagedllm import LLM, SamplingParams

    vocab = ModelConfig(model=windowed_dir).vocab_size
    shared = random_prompt(SW_LEN - 24, vocab, seed=21)
    prompts = [
        random_prompt(SW_LEN, vocab, seed=22),
        shared + random_prompt(24, vocab, seed=23),
        shared + random_prompt(9, vocab, seed=24),
        random_prompt(5, vocab, seed=25),
    ]
    max_new = 12
    want = hf_greedy(windowed_dir, prompts, max_new)
    full = hf_greedy(_without_window(windowed_dir, tmp_path / "full"), prompts[:2], max_new)
    assert full != want[:2], "the window does not change transformers' output: the test would prove nothing"

    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for kwargs in (
        {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 20, "enable_prefix_caching": True},
    ):
        llm = LLM(windowed_dir, dtype="float32", device="cpu", block_size=4, async_scheduling=False, **kwargs)
        # The first prompt alone (fills the prefix cache with `shared` when caching), then all of them together.
        first = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
        assert list(first[0].outputs[0].token_ids) == want[1], kwargs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want, kwargs
        if kwargs["enable_prefix_caching"]:
            assert outs[2].num_cached_tokens >= len(shared) - 4
        core = llm.llm_engine.engine_core
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_gemma2_soft_caps_matter(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    """Gemma 2's tiny caps bend its outputs (so the logits comparisons above check them), and the final cap
    bounds our logits as it does transformers'."""
    path = tiny_model_dirs["gemma2"]
    prompt = random_prompt(30, 400, seed=31)
    ref = hf_logits(path, prompt)
    assert ref.abs().max() < 6.0
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        dst = tmp_path / field
        shutil.copytree(path, dst)
        config = json.loads((dst / "config.json").read_text())
        config[field] = None
        (dst / "config.json").write_text(json.dumps(config))
        assert (hf_logits(str(dst), prompt) - ref).abs().max() > 1e-2, field
    model, model_config = load_ours(path)
    out = PagedRunner(model, model_config).step({0: prompt})[0]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_partial_rotary_is_refused_where_the_model_ignores_it(tmp_path: Path) -> None:
    """transformers' Llama rotates whole heads whatever partial_rotary_factor says: refused, not guessed."""
    path = make_tiny_model(
        "llama",
        tmp_path / "p",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_ours(path)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
         "beta_slow": 2, "attention_factor": 1.3},  # fmt: skip
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 0.707,
         "mscale_all_dim": 0.707, "truncate": False},  # fmt: skip
    ],
)
def test_yarn_rope_matches_transformers(scaling: dict) -> None:
    """``rope_type: yarn`` (Qwen long-context configs, GPT-OSS; DeepSeek's own rotary uses the same frequencies):
    frequencies and the cos/sin factor equal transformers' ``_compute_yarn_parameters``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedllm.layers.rotary import get_rope, rope_config

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )  # fmt: skip
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, parsed = rope_config(config)
    rope = get_rope(32, 256, theta, parsed)
    positions = torch.arange(256, dtype=torch.float32)
    freqs = torch.outer(positions, want_freq.float())
    want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * want_factor
    torch.testing.assert_close(rope.cos_sin_cache, want, atol=1e-6, rtol=1e-6)


def test_fused_qk_norm_rope_picked_for_plain_rms_norm_only(tiny_model_dirs: dict[str, str]) -> None:
    """Qwen3's plain RMSNorm and rotary table may take the one-launch q/k norm + RoPE kernel on CUDA; Gemma 3's
    norm (weight offset by one) and models without q/k norms may not."""
    from pagedllm.models.llama import LlamaAttention

    for arch, fusable in (("qwen3", True), ("gemma3", False), ("llama", False)):
        model, _ = load_ours(tiny_model_dirs[arch], load_format="dummy")
        flags = {m.norm_rope_fusable for m in model.modules() if isinstance(m, LlamaAttention)}
        assert flags == {fusable}, arch
