"""Tensor parallelism for GPT-OSS and DeepSeek-V2/V3, pipeline parallelism for the MoE families, GPT-OSS and
DeepSeek, on CPU (gloo, float32).

* In-process, no processes: a rank's attention weights are its heads' slice (GPT-OSS's sinks, DeepSeek's per-head
  ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` rows and ``o_proj`` columns; the latent projections replicated), and
  pipeline stages built one after another hand activations on to the whole model's logits, each stage holding only
  its layers (DeepSeek's dense or MoE MLP chosen by the global layer index) and their caches.
* Through the engine (one worker process each; one multi-rank engine at a time): ``tensor_parallel_size=2`` with
  and without ``enable_expert_parallel`` and ``pipeline_parallel_size=2`` give transformers' greedy tokens, with
  prompts longer than GPT-OSS's window, chunks of 8 tokens and a prefix-cache hit; no leaked blocks.
* What is still refused names the field.

The per-rank MoE block checks (expert slices, biases, shared experts, partial sums) are in
tests/models/test_moe_tp.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import PPGroup, TPGroup
from pagedllm.distributed.pipeline import is_missing
from tests.models.test_deepseek import tiny_deepseek
from tests.models.test_gpt_oss_qwen2moe import WINDOW, make_tiny
from tests.models.test_moe import make_tiny_moe
from tests.utils import hf_greedy, hf_logprobs

MAX_NEW = 6
TP = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_pp_families")
    return {
        # 2 layers (sliding window 8, full), 4 heads / 2 KV heads with sinks, 4 experts with biases
        "gpt_oss": make_tiny("gpt_oss", root / "gpt_oss", seed=41),
        # DeepSeek: 3 layers (0 dense, 1-2 MoE), 4 heads, 8 routed experts + shared ones
        "deepseek_v2_lite": tiny_deepseek("v2-lite", root / "v2_lite", seed=42),  # q_proj, no q LoRA
        "deepseek_v2": tiny_deepseek("v2-group", root / "v2", seed=43),  # q LoRA, grouped routing, biases
        "deepseek_v3": tiny_deepseek("v3", root / "v3", seed=44),  # noaux_tc, YaRN, sharded checkpoint
        "deepseek_v3_half": tiny_deepseek("v3-rotate-half", root / "v3_half", seed=45),  # no q LoRA, 1 shared
        # 3 layers: stages of 2 + 1
        "mixtral": make_tiny_moe("mixtral", root / "mixtral", seed=46, num_hidden_layers=3),
        "qwen3_moe": make_tiny_moe(
            "qwen3_moe", root / "qwen3_moe", seed=47, num_hidden_layers=3, mlp_only_layers=[1]
        ),  # layer 1 dense
        "qwen2_moe": make_tiny("qwen2_moe", root / "qwen2_moe", seed=48, num_hidden_layers=3),
    }


def _load(path: str, tp: TPGroup | None = None, pp: PPGroup | None = None) -> torch.nn.Module:
    from pagedllm.attention.torch_ref import TorchAttentionBackend
    from pagedllm.config import ModelConfig
    from pagedllm.model_loader import get_model

    return get_model(
        ModelConfig(model=path, dtype="float32"), torch.device("cpu"), TorchAttentionBackend(), tp, pp
    )


def _prompts(vocab: int) -> list[list[int]]:
    """Longer than GPT-OSS's window (8); the first and last share a 20-token (5-block) prefix."""
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    return [shared + [5, 6, 7], [rng.randrange(3, vocab) for _ in range(17)], shared + [9]]


def _generate_and_check(path: str, logprobs: bool = False, **kw) -> None:
    """Chunks of at most 8 tokens, a shared prefix hit: transformers' greedy tokens (and, with ``logprobs``, each
    token's logprob within 1e-4); the pool whole again afterwards."""
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        **kw,
    )
    core = llm.llm_engine.engine_core
    try:
        prompts = _prompts(core.vocab_size)
        assert all(len(p) > 2 * WINDOW for p in prompts)
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1 if logprobs else None
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        want = hf_greedy(path, prompts, MAX_NEW)
        assert any(len(set(w)) > 2 for w in want), want  # the tiny model's output varies
        assert [o.outputs[0].token_ids for o in outs] == want
        if logprobs:
            for prompt, out in zip(prompts, outs):
                comp = out.outputs[0]
                ref = hf_logprobs(path, prompt + comp.token_ids[:-1])  # [len, vocab]
                for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
                    assert abs(lps[tok].logprob - ref[len(prompt) - 1 + j][tok].item()) < 1e-4
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0, "the test meant to hit the prefix cache"
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        core.shutdown()


# --- in-process: a rank's and a stage's part ----------------------------------------------------------------------
@torch.inference_mode()
def test_gpt_oss_rank_keeps_its_heads_and_their_sinks(dirs) -> None:
    whole = _load(dirs["gpt_oss"])
    for r in range(TP):
        part = _load(dirs["gpt_oss"], TPGroup(r, TP))
        for layer, whole_layer in zip(part.model.layers, whole.model.layers):
            attn, want = layer.self_attn, whole_layer.self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 / 2
            assert torch.equal(attn.sinks, want.sinks[r * 2 : (r + 1) * 2])
            assert attn.attn.sinks is attn.sinks  # the backend reads this rank's sinks
            assert torch.equal(layer.mlp.router.weight, whole_layer.mlp.router.weight)


@pytest.mark.parametrize("variant", ["deepseek_v2_lite", "deepseek_v2"])
@torch.inference_mode()
def test_deepseek_rank_keeps_its_heads_and_the_whole_latent(dirs, variant: str) -> None:
    whole = _load(dirs[variant])
    config = whole.config
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    kv = config.qk_nope_head_dim + config.v_head_dim
    local = config.num_attention_heads // TP
    for r in range(TP):
        part = _load(dirs[variant], TPGroup(r, TP))
        assert part.kv_cache_shapes(5, 4) == whole.kv_cache_shapes(5, 4)  # every rank caches the whole latent
        for layer, whole_layer in zip(part.model.layers, whole.model.layers):
            attn, want = layer.self_attn, whole_layer.self_attn
            assert attn.num_heads == attn.attn.num_heads == local
            q = "q_proj" if config.q_lora_rank is None else "q_b_proj"
            rows = slice(r * local * qk, (r + 1) * local * qk)
            assert torch.equal(getattr(attn, q).weight, getattr(want, q).weight[rows])
            assert torch.equal(
                attn.kv_b_proj.weight, want.kv_b_proj.weight[r * local * kv : (r + 1) * local * kv]
            )
            cols = slice(r * local * config.v_head_dim, (r + 1) * local * config.v_head_dim)
            assert torch.equal(attn.o_proj.weight, want.o_proj.weight[:, cols])
            for name, param in want.kv_a_proj_with_mqa.named_parameters():  # replicated
                assert torch.equal(getattr(attn.kv_a_proj_with_mqa, name), param)
            if want.o_proj.bias is not None:  # added once, on rank 0
                assert torch.equal(
                    attn.o_proj.bias, want.o_proj.bias if r == 0 else torch.zeros_like(want.o_proj.bias)
                )


@torch.inference_mode()
def _stage_logits(path: str, pp_size: int) -> tuple[torch.Tensor, list[torch.nn.Module]]:
    """Logits of a ragged prefill then one decode step through ``pp_size`` stage models run one after another in
    this process (activations handed on in memory), and the stage models."""
    from tests.distributed.workers import _metadata, prompts_for

    models = [_load(path, pp=PPGroup(r, pp_size) if pp_size > 1 else None) for r in range(pp_size)]
    caches = []
    for model in models:
        shapes = getattr(model, "kv_cache_shapes", None)
        if shapes is not None:  # MLA: [num_blocks, block_size, L + R] per own layer
            caches.append([torch.zeros(s) for s in shapes(16, 4)])
        else:
            layers = [m for m in model.model.layers if not is_missing(m)]
            attn = layers[0].self_attn
            caches.append([torch.zeros(2, 16, 4, attn.num_kv_heads, attn.head_dim) for _ in layers])
    prompts = prompts_for(models[0].config.vocab_size)
    lens = [len(p) for p in prompts]
    logits = []
    for ids, positions, meta in (
        (
            torch.tensor(sum(prompts, [])),
            torch.cat([torch.arange(n) for n in lens]),
            _metadata(lens, lens, 8),
        ),
        (torch.tensor([5, 7]), torch.tensor(lens), _metadata([1, 1], [n + 1 for n in lens], 8)),
    ):
        out = None
        for model, cache in zip(models, caches):
            out = (
                model(ids, positions, cache, meta, out)
                if out is not None
                else model(ids, positions, cache, meta)
            )
        logits.append(models[-1].compute_logits(out))
    return torch.cat(logits), models


PP_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("family", PP_FAMILIES)
def test_moe_stages_own_their_layers_and_chain_to_the_whole_model(dirs, family: str) -> None:
    whole, (whole_model,) = _stage_logits(dirs[family], 1)
    logits, (first, last) = _stage_logits(dirs[family], 2)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)

    def names(model: torch.nn.Module) -> set[str]:
        return {n for n, _ in model.named_parameters()}

    def layers(model: torch.nn.Module) -> set[int]:
        return {int(n.split(".")[2]) for n in names(model) if n.startswith("model.layers.")}

    assert (layers(first), layers(last)) == ({0, 1}, {2})  # 3 layers: 2 + 1
    assert "model.embed_tokens.weight" in names(first) and "model.norm.weight" in names(last)
    assert not any(n.startswith(("lm_head", "model.norm")) for n in names(first))
    assert "model.embed_tokens.weight" not in names(last)
    assert names(first) | names(last) == names(whole_model)
    # each owned layer's MLP is the one the whole model has at that global index (DeepSeek: layer 0 dense)
    for stage in (first, last):
        for i, layer in enumerate(stage.model.layers):
            if not is_missing(layer):
                mlp, want = (
                    getattr(layer, layer.mlp_name),
                    getattr(whole_model.model.layers[i], layer.mlp_name),
                )
                assert type(mlp) is type(want)
    if family.startswith("deepseek"):
        assert [len(m.kv_cache_shapes(3, 4)) for m in (first, last)] == [2, 1]


# --- through the engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, expert_parallel",
    [
        ("gpt_oss", False),
        ("gpt_oss", True),
        ("deepseek_v2_lite", False),
        ("deepseek_v2", True),
        ("deepseek_v3", False),
        ("deepseek_v3_half", True),
    ],
)
def test_tp2_greedy_matches_transformers(dirs, family: str, expert_parallel: bool) -> None:
    _generate_and_check(
        dirs[family],
        logprobs=family == "gpt_oss" and not expert_parallel,
        tensor_parallel_size=TP,
        enable_expert_parallel=expert_parallel,
    )


@pytest.mark.parametrize("family", [*PP_FAMILIES, "gpt_oss"])
def test_pp2_greedy_matches_transformers(dirs, family: str) -> None:
    _generate_and_check(dirs[family], pipeline_parallel_size=2)


def test_what_is_still_refused_names_the_field(dirs) -> None:
    from pagedllm.config import make_engine_config

    with pytest.raises(ValueError, match=r"num_local_experts \(4\).*tensor_parallel_size \(3\)"):
        make_engine_config(dirs["gpt_oss"], device="cpu", tensor_parallel_size=3, enable_expert_parallel=True)
