"""DeepSeek-V2/V3 (MLA, shared experts, grouped routing) vs transformers on tiny random checkpoints (float32, CPU).

Each variant is saved by transformers' ``save_pretrained`` and loaded as a user model would be. Through the engine
under pressure (chunked prefill, prefix-cache hits, preemption; prompts past YaRN's original context) the greedy
tokens equal transformers' and each generated token's logprob (and the top 3) agree within 1e-4. Prefill chunks
take MLA's expanded path, decodes the absorbed one (pagedllm/attention/mla.py); both meet transformers there.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import group_limited_topk, noaux_tc_topk
from pagedllm.models.deepseek_v2 import DeepseekMoE
from tests.models.test_models import load_ours
from tests.utils import hf_greedy, hf_logprobs, train_tiny_tokenizer

KV_LORA_RANK, ROPE_DIM = 32, 8
MAX_NEW = 12

# YaRN with an original context (32) shorter than the prompts, mscale != mscale_all_dim: the frequencies, cos/sin
# magnitude (attention_factor) and softmax scale (mscale_all_dim) all differ from plain RoPE.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

# variant -> (transformers config class name, overrides)
VARIANTS = {
    # V2-Lite's layout: no q LoRA, greedy top-k, one dense layer first, YaRN.
    "v2-lite": ("DeepseekV2Config", {"q_lora_rank": None, "topk_method": "greedy", "rope": YARN}),
    # V2's: q LoRA, group-limited routing (2 groups of 4, the best one eligible), biases on the attention
    # projections and MLPs.
    "v2-group": (
        "DeepseekV2Config",
        {
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
            "attention_bias": True,
            "mlp_bias": True,
            "routed_scaling_factor": 2.0,
        },
    ),
    # V3's: sigmoid + correction bias ("noaux_tc"), top-2-sum groups, renormalised and scaled weights, interleaved
    # rope with YaRN; sharded checkpoint.
    "v3": (
        "DeepseekV3Config",
        {
            "q_lora_rank": 24,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope": YARN,
            "shard": True,
        },
    ),
    # V3 with rotate-half rope (rope_interleave false), no q LoRA, ungrouped routing, one shared expert.
    "v3-rotate-half": (
        "DeepseekV3Config",
        {"q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    ),
}
ENGINE_VARIANTS = ["v2-lite", "v2-group", "v3"]


def _deepseek_config(cls_name: str, tokenizer, rope: dict | None = None, **overrides):
    import transformers

    rope_params = {"rope_type": "default", **(rope or {}), "rope_theta": 10000.0}
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,  # layer 0 dense, layers 1-2 MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=24,  # != qk_nope_head_dim: mixing up k and v widths fails loudly
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters=rope_params,
    )
    common.update(overrides)
    return getattr(transformers, cls_name)(**common)


def make_tiny_deepseek(cls_name: str, path: Path, seed: int, shard: bool = False, **overrides) -> str:
    """A tiny random DeepSeek checkpoint saved by transformers (+ the tiny tokenizer). Weights are larger than HF's
    init (std 0.15, norms around 1, random biases and correction biases) so that routing and generation vary."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer()
    config = _deepseek_config(cls_name, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("inv_freq"):
                continue
            noise = torch.randn(tensor.shape, generator=gen)
            if name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.1 * noise)
            elif name.endswith((".bias", "e_score_correction_bias")):
                tensor.copy_(0.1 * noise)
            else:
                tensor.copy_(0.15 * noise)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="200KB" if shard else "50GB")
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_deepseek(variant: str, path: Path, seed: int) -> str:
    """``make_tiny_deepseek`` for one of ``VARIANTS`` (other tests reuse them: tests/models/test_moe_tp.py,
    tests/distributed/test_tp_pp_families.py)."""
    cls_name, overrides = VARIANTS[variant]
    return make_tiny_deepseek(cls_name, path, seed, **overrides)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: tiny_deepseek(name, root / name, seed=31 + i) for i, name in enumerate(VARIANTS)}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(36)]  # 9 full blocks another prompt can hit
    return [
        shared + [rng.randrange(3, vocab) for _ in range(8)],
        [rng.randrange(3, vocab) for _ in range(41)],
        shared + [rng.randrange(3, vocab) for _ in range(5)],
    ]


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` (looked up at call time by its callers) to count its calls: ``[count]``."""
    original, calls = getattr(module, name), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def check_engine_under_pressure(path: str, device: str, tol: float) -> LLM:
    """Chunks of at most 8 tokens, a pool too small for all three sequences (preemption), a shared 36-token prefix
    (prefix-cache hits): transformers' greedy tokens, and its logprobs (and top 3) within ``tol``. CUDA graphs on
    (what the runner does on CUDA unless told otherwise). Returns the LLM, for further checks."""
    llm = LLM(
        path,
        device=device,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=20,
    )
    core = llm.llm_engine.engine_core
    prompts = _prompts(core.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = hf_greedy(path, prompts, MAX_NEW)
    assert any(len(set(w)) > 2 for w in want), want  # the tiny model's output varies
    assert [o.outputs[0].token_ids for o in outs] == want
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(path, prompt + comp.token_ids[:-1])  # [len, vocab]
        for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(lps[tok].logprob - row[tok].item()) < tol
            top = torch.topk(row, 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lps[t].logprob - v) < tol
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the test meant to preempt"
    assert stats.prefix_cache_hits > 0, "the test meant to hit the prefix cache"
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    return llm


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_greedy_and_logprobs_match_transformers_under_pressure(
    deepseek_dirs, variant: str, monkeypatch
) -> None:
    """On CPU, logprobs within 1e-4; prefill chunks took the expanded path (batched: the PyTorch twin of the Triton
    kernel) and decodes the absorbed one."""
    import pagedllm.kernels.mla_decode as mla_decode
    import pagedllm.kernels.mla_prefill as mla_prefill

    expanded = _count_calls(monkeypatch, mla_prefill, "mla_prefill_attention_ref")
    absorbed = _count_calls(monkeypatch, mla_decode, "mla_decode_ref")
    check_engine_under_pressure(deepseek_dirs[variant], "cpu", 1e-4)
    assert expanded[0] > 0 and absorbed[0] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_gpu_triton_decode_matches_transformers(deepseek_dirs, variant: str, monkeypatch) -> None:
    """On CUDA (float32, the Triton backend) decodes run the Triton MLA kernel and the Triton MoE kernel, pure
    decode steps as replays of CUDA graphs (MLA's absorbed decode and ``moe_align`` read nothing on the host),
    prefill chunks the Triton MLA prefill kernel; tokens still equal transformers' (on CPU) and logprobs agree
    within 1e-3."""
    import pagedllm.kernels.mla_decode as mla_decode
    import pagedllm.kernels.mla_prefill as mla_prefill
    from pagedllm.worker import cuda_graphs

    triton_calls = _count_calls(monkeypatch, mla_decode, "mla_decode")
    prefill_calls = _count_calls(monkeypatch, mla_prefill, "mla_prefill_attention")
    replays = _count_calls(monkeypatch, cuda_graphs.CudaGraphRunner, "run")
    llm = check_engine_under_pressure(deepseek_dirs[variant], "cuda", 1e-3)
    assert llm.llm_engine.engine_core.runner.graph_runner is not None
    assert triton_calls[0] > 0 and prefill_calls[0] > 0
    assert replays[0] > 0, "no pure-decode step replayed a graph"


def test_cache_holds_latent_and_rope_key_per_token(deepseek_dirs) -> None:
    """One row of kv_lora_rank + qk_rope_head_dim values per token and layer, not per-head keys and values: the
    block size in bytes, the allocated tensors, and the block count a byte budget buys all follow from it."""
    path = deepseek_dirs["v2-lite"]
    config = json.loads((Path(path) / "config.json").read_text())
    num_layers, block_size, elem = config["num_hidden_layers"], 4, 4  # float32
    bytes_per_token = num_layers * (KV_LORA_RANK + ROPE_DIM) * elem
    budget = 1 << 20
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        block_size=block_size,
        max_model_len=64,
        kv_cache_memory_bytes=budget,
    )
    core = llm.llm_engine.engine_core
    runner = core.runner
    assert runner.kv_block_bytes() == block_size * bytes_per_token
    num_blocks = budget // (block_size * bytes_per_token)
    assert core.kv_cache_manager.pool.num_blocks == num_blocks
    assert [tuple(c.shape) for c in runner.kv_caches] == [
        (num_blocks, block_size, KV_LORA_RANK + ROPE_DIM)
    ] * 3


def test_dummy_weights_load_and_run(deepseek_dirs) -> None:
    """``load_format="dummy"`` builds every parameter (V3: the correction bias too) and the model runs."""
    llm = LLM(deepseek_dirs["v3"], device="cpu", dtype="float32", load_format="dummy", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_cache_is_refused(deepseek_dirs) -> None:
    llm = LLM(deepseek_dirs["v2-lite"], device="cpu", dtype="float32", kv_cache_dtype="fp8", max_model_len=64)
    with pytest.raises(ValueError, match="fp8"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_routing_matters(deepseek_dirs) -> None:
    """The comparisons above would catch a routing slip: dropping V3's correction bias, its renormalisation or the
    scaling factor, or V2's group limit, moves the logits far beyond the tolerance."""
    from tests.models.test_models import hf_logits

    prompt = random.Random(3).sample(range(3, 300), 20)
    for variant, breakages in {
        "v3": ["bias", "renormalize", "scale"],
        "v2-group": ["groups", "scale"],
    }.items():
        path = deepseek_dirs[variant]
        model, model_config = load_ours(path)
        expected = hf_logits(path, prompt)
        moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
        assert len(moes) == 2
        torch.testing.assert_close(paged_logits(model, prompt, [len(prompt)]), expected, atol=1e-4, rtol=0)
        for breakage in breakages:
            saved = [dict(m.__dict__) for m in moes]
            saved_bias = [m.gate.e_score_correction_bias.clone() for m in moes] if variant == "v3" else []
            for m in moes:
                if breakage == "bias":
                    m.gate.e_score_correction_bias.zero_()
                elif breakage == "renormalize":
                    m.renormalize = False
                elif breakage == "scale":
                    m.routed_scaling_factor = 1.0
                elif breakage == "groups":
                    m.num_groups = 1
            assert (paged_logits(model, prompt, [len(prompt)]) - expected).abs().max() > 1e-2, (
                variant,
                breakage,
            )
            for m, d in zip(moes, saved):
                m.__dict__.update(d)
            for m, b in zip(moes, saved_bias):
                m.gate.e_score_correction_bias.copy_(b)


@torch.inference_mode()
def paged_logits(model, token_ids: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """Run one request through ``model`` in steps of ``chunks`` tokens (a step of one token as a pure decode)
    over NaN-filled caches whose blocks are in reverse order; the logits of every position, ``[len, vocab]``."""
    from pagedllm.attention.base import AttentionMetadata

    assert sum(chunks) == len(token_ids)
    num_blocks = -(-len(token_ids) // block_size) + 1
    caches = [torch.full(shape, float("nan")) for shape in model.kv_cache_shapes(num_blocks, block_size)]
    block_table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)[None]  # [1, num_blocks]
    out, done = [], 0
    for size in chunks:
        positions = torch.arange(done, done + size)  # [size]
        slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
        qsl, seq_lens = (
            torch.tensor([0, size], dtype=torch.int32),
            torch.tensor([done + size], dtype=torch.int32),
        )
        meta = AttentionMetadata(
            num_reqs=1,
            num_tokens=size,
            max_query_len=size,
            max_seq_len=done + size,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            is_pure_decode=size == 1,
        )
        hidden = model(torch.tensor(token_ids[done : done + size]), positions, caches, meta)
        out.append(model.compute_logits(hidden))
        done += size
    return torch.cat(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunks_and_decodes_match_transformers_logits(deepseek_dirs, variant: str) -> None:
    """Prefill chunks over cached context (expanded form) then pure-decode steps (absorbed form): transformers'
    logits at every position, within 1e-4; unwritten cache slots hold NaN and are never read."""
    from tests.models.test_models import hf_logits

    path = deepseek_dirs[variant]
    model, _ = load_ours(path)
    prompt = random.Random(7).sample(range(3, 300), 40)  # past YaRN's original context of 32
    got = paged_logits(model, prompt, [13, 8, 1, 7, 3] + [1] * 8)
    torch.testing.assert_close(got, hf_logits(path, prompt), atol=1e-4, rtol=0)


def test_grouped_routing_functions() -> None:
    """The routing rules against hand-worked cases: V2 keeps only the best groups' experts; V3 selects by biased
    scores but weights by unbiased ones."""
    # 4 experts in 2 groups; group 1 holds the best single expert, group 0 the two next best.
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.05, 0.4]]))
    weights, ids = group_limited_topk(logits, top_k=2, num_groups=2, topk_group=1, routed_scaling_factor=2.0)
    assert sorted(ids[0].tolist()) == [2, 3]  # group 1 only: its 0.05 beats group 0's 0.3
    torch.testing.assert_close(weights[0].sort().values, torch.tensor([0.1, 0.8]))
    weights, ids = group_limited_topk(logits, top_k=2)  # greedy
    assert sorted(ids[0].tolist()) == [0, 3]

    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # pulls expert 2 in (and its group) without weighting it up
    weights, ids = noaux_tc_topk(logits, bias, top_k=2, num_groups=2, topk_group=1, renormalize=False)
    assert sorted(ids[0].tolist()) == [2, 3]
    scores = torch.sigmoid(logits[0])
    torch.testing.assert_close(weights[0].sort().values, scores[[2, 3]].sort().values)
    weights, ids = noaux_tc_topk(logits, bias, 2, 2, 1, renormalize=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(weights.sum(), torch.tensor(2.5))


def test_shape_dirs_load_as_transformers_configs(tmp_path: Path) -> None:
    """``python -m pagedllm.benchmarks.shapes`` entries for DeepSeek-V2-Lite, Qwen3-30B-A3B and Qwen3-235B-A22B: transformers reads
    them, our registry knows them, and V2-Lite's cache row is 512 + 64 values."""
    from transformers import AutoConfig

    from pagedllm.benchmarks.shapes import write_shape_dir
    from pagedllm.models.registry import get_model_class

    lite = AutoConfig.from_pretrained(write_shape_dir("deepseek-v2-lite", tmp_path / "lite"))
    assert (lite.hidden_size, lite.num_hidden_layers, lite.num_attention_heads) == (2048, 27, 16)
    assert lite.q_lora_rank is None and (lite.kv_lora_rank, lite.qk_rope_head_dim) == (512, 64)
    assert (lite.n_routed_experts, lite.num_experts_per_tok, lite.n_shared_experts) == (64, 6, 2)
    assert lite.rope_parameters["rope_type"] == "yarn" and lite.rope_parameters["factor"] == 40
    qwen = AutoConfig.from_pretrained(write_shape_dir("qwen3-30b-a3b", tmp_path / "qwen"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.num_hidden_layers) == (128, 8, 48)
    big = AutoConfig.from_pretrained(write_shape_dir("qwen3-235b-a22b", tmp_path / "qwen235"))  # the 8-GPU shape
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (
        4096, 94, 64, 4,
    )  # fmt: skip
    assert (big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size) == (128, 8, 1536)
    for cfg in (lite, qwen, big):
        assert get_model_class(cfg.architectures[0], import_module=False) is None  # known, not imported


def test_latent_cache_write_does_not_sync(monkeypatch) -> None:
    """The MLA cache write runs inside CUDA-graph capture (pure decode steps): no op that reads a device value on
    the host (the first device run failed capture on indexing with a 0-d tensor, which calls ``item``)."""
    from pagedllm.attention.mla import write_latent_cache
    from tests.kernels.test_triton_fused_moe import no_host_sync

    cache = torch.zeros(4, 2, 6)  # [num_blocks, block_size, L + R]
    latent, k_pe = torch.randn(3, 4), torch.randn(3, 2)
    for slots in ([-1, 5, 2], [-1, -1, -1], [0, 7, 3]):
        before = cache.clone()
        slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64)
        with no_host_sync(monkeypatch):
            write_latent_cache(latent, k_pe, cache, slot_mapping)
        flat, want = cache.view(-1, 6), before.view(-1, 6).clone()
        for t, s in enumerate(slots):
            if s >= 0:
                want[s] = torch.cat([latent[t], k_pe[t]])
        assert torch.equal(flat, want)
