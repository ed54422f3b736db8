"""Mixture-of-experts models (Mixtral, Qwen3-MoE) vs transformers on tiny random checkpoints (float32, CPU).

Also CUDA-graph safety of every family's MoE block (routing, shared experts, the kernel path) checked on CPU
without a host sync, and (``gpu``) the engine capturing MoE decode steps in CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.layers.fused_moe import FusedMoE, select_experts
from tests.kernels.test_triton_fused_moe import no_host_sync, use_emulated_kernels
from tests.models.test_models import (
    PagedRunner,
    assert_ragged_and_chunked_logits,
    hf_logits,
    load_ours,
    random_prompt,
)
from tests.utils import hf_greedy, save_random_model, train_tiny_tokenizer

ATOL = 1e-5

# variant -> (arch, config overrides)
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "mixtral-window": ("mixtral", {"sliding_window": 8}),
    "qwen3moe": ("qwen3_moe", {}),  # norm_topk_prob false: top-k weights used as they are
    "qwen3moe-norm-dense": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3moe-step": ("qwen3_moe", {"decoder_sparse_step": 2, "num_experts": 4}),  # layer 0 dense
}


def _moe_config(arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, **overrides):
    import transformers
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        num_experts_per_tok=2,
    )
    if arch == "mixtral":
        cls = MixtralConfig
        common.update(intermediate_size=96, num_local_experts=8, sliding_window=None)
    elif arch == "qwen3_moe":
        cls = Qwen3MoeConfig
        common.update(
            head_dim=32, intermediate_size=128, moe_intermediate_size=48, num_experts=8, norm_topk_prob=False
        )
    else:
        raise ValueError(arch)
    if int(transformers.__version__.split(".")[0]) >= 5:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        common["rope_theta"] = 10000.0
    common.update(overrides)
    return cls(**common)


def make_tiny_moe(arch: str, path: Path, seed: int, **overrides) -> str:
    """A tiny random MoE checkpoint saved by transformers' ``save_pretrained`` (+ the tiny tokenizer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer()
    config = _moe_config(
        arch,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        **overrides,
    )
    return save_random_model(config, tokenizer, path, seed)  # (these configs have no biases)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: make_tiny_moe(arch, root / name, seed=7 + i, **overrides)
        for i, (name, (arch, overrides)) in enumerate(VARIANTS.items())
    }


def moe_layers(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(moe_dirs, variant: str) -> None:
    """Ragged prefill of three prompts in one forward, then chunked prefill + decode steps: transformers'
    logits at every position."""
    path = moe_dirs[variant]
    model, model_config = load_ours(path)
    num_sparse = {"qwen3moe-norm-dense": 1, "qwen3moe-step": 1}.get(variant, 2)
    assert len(moe_layers(model)) == num_sparse
    assert_ragged_and_chunked_logits(path, model, model_config, (5, 21, 9), ATOL)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3moe-norm-dense"])
def test_greedy_through_llm_matches_transformers(moe_dirs, variant: str) -> None:
    """pagedllm.LLM greedy = transformers greedy token for token, with small prefill chunks."""
    from pagedllm import LLM, SamplingParams

    path = moe_dirs[variant]
    llm = LLM(
        path, dtype="float32", device="cpu", block_size=4, async_scheduling=False, max_num_batched_tokens=7
    )
    vocab = llm.llm_engine.engine_core.vocab_size
    prompts = [random_prompt(n, vocab, seed=40 + n) for n in (3, 17, 9, 12)]
    max_new = 10
    want = hf_greedy(path, prompts, max_new)
    assert len({tuple(w) for w in want}) > 1 and any(len(set(w)) > 2 for w in want), want  # varied output
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


@pytest.mark.parametrize("variant", ["mixtral", "qwen3moe", "qwen3moe-norm-dense"])
def test_wrong_routing_changes_logits(moe_dirs, variant: str) -> None:
    """The comparisons above would catch a routing mistake: top-1 instead of top-2, or the renormalisation
    flipped, moves the logits far beyond the tolerance."""
    path = moe_dirs[variant]
    model, model_config = load_ours(path)
    prompt = random_prompt(21, model_config.vocab_size, seed=5)
    expected = hf_logits(path, prompt)
    runner_out = PagedRunner(model, model_config).step({0: prompt})[0]
    torch.testing.assert_close(runner_out, expected, atol=ATOL, rtol=0)
    for layer in moe_layers(model):
        layer.top_k = 1
    wrong = PagedRunner(model, model_config).step({0: prompt})[0]
    assert (wrong - expected).abs().max() > 100 * ATOL
    for layer in moe_layers(model):
        layer.top_k = 2
        layer.renormalize = not layer.renormalize
    wrong = PagedRunner(model, model_config).step({0: prompt})[0]
    assert (wrong - expected).abs().max() > 100 * ATOL


def test_fused_moe_layer_matches_dense_mixture() -> None:
    """FusedMoE = an independent dense oracle: every expert on every token, weighted by the routing mask."""
    torch.manual_seed(0)
    num_experts, top_k, hidden, inter, tokens = 6, 2, 16, 24, 11
    for renormalize in (True, False):
        layer = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
        with torch.no_grad():
            layer.gate.weight.normal_()
            layer.w13.normal_(0, 0.3)
            layer.w2.normal_(0, 0.3)
        x = torch.randn(tokens, hidden)
        probs = torch.softmax(x @ layer.gate.weight.T, dim=-1)  # [T, E]
        weights, ids = probs.topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros(tokens, num_experts).scatter(1, ids, weights)  # [T, E]
        want = torch.zeros(tokens, hidden)
        for e in range(num_experts):
            gate, up = (x @ layer.w13[e].T).chunk(2, dim=-1)
            want += dense[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ layer.w2[e].T)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
        got_w, got_ids = select_experts(x @ layer.gate.weight.T, top_k, renormalize)
        assert torch.equal(got_ids, ids)
        # the per-expert checkpoint slots are views of the stacked tensors
        assert layer.experts[3].w13.weight.data_ptr() == layer.w13[3].data_ptr()
        assert layer.experts[3].w2.weight.data_ptr() == layer.w2[3].data_ptr()
    assert FusedMoE(4, 2, 8, 8, True)(torch.zeros(0, 8)).shape == (0, 8)


def test_loading_is_strict_per_expert(moe_dirs, tmp_path: Path) -> None:
    """Each expert's tensors land in its own slot: dropping one expert's w3 is reported as a partly loaded
    slot; swapping two experts' tensors changes the logits."""
    import shutil

    src = Path(moe_dirs["mixtral"])
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    ckpt = dst / "model.safetensors"
    tensors = load_file(ckpt)
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    dropped = {k: v for k, v in tensors.items() if k != name}
    save_file(dropped, ckpt, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.5\.w13\.weight"):
        load_ours(str(dst))

    model, _ = load_ours(str(src))
    layer = moe_layers(model)[1]
    for j, w in enumerate(("w1", "w3")):
        want = tensors[f"model.layers.1.block_sparse_moe.experts.5.{w}.weight"]
        assert torch.equal(layer.w13[5, j * want.shape[0] : (j + 1) * want.shape[0]], want)
    assert torch.equal(layer.w2[5], tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"])


# ------------------------------------------------------------------ CUDA graphs


def _moe_blocks() -> dict[str, torch.nn.Module]:
    """Each family's MoE block (its routing rule, shared experts, activation) on a tiny config."""
    from pagedllm.models.deepseek_v2 import DeepseekMoE
    from pagedllm.models.gpt_oss import GptOssMoE
    from pagedllm.models.qwen2_moe import Qwen2MoeSparseMoe

    hidden, inter = 32, 16
    deepseek = dict(
        n_routed_experts=16, num_experts_per_tok=4, hidden_size=hidden, moe_intermediate_size=inter,
        hidden_act="silu", n_shared_experts=2, mlp_bias=False, routed_scaling_factor=2.0, n_group=4, topk_group=2,
    )  # fmt: skip
    blocks = {
        "mixtral": FusedMoE(8, 2, hidden, inter, renormalize=True),
        "qwen3_moe": FusedMoE(16, 4, hidden, inter, renormalize=False, cast_weights_to_input_dtype=True),
        "qwen2_moe": Qwen2MoeSparseMoe(
            SimpleNamespace(
                num_experts=8,
                num_experts_per_tok=2,
                hidden_size=hidden,
                moe_intermediate_size=inter,
                norm_topk_prob=True,
                hidden_act="silu",
                shared_expert_intermediate_size=24,
            )
        ),
        "gpt_oss": GptOssMoE(
            SimpleNamespace(
                num_local_experts=8,
                num_experts_per_tok=2,
                hidden_size=hidden,
                intermediate_size=inter,
                swiglu_limit=1.0,
            )
        ),
        "deepseek_v2_group": DeepseekMoE(
            SimpleNamespace(**deepseek, topk_method="group_limited_greedy"), noaux_tc=False
        ),
        "deepseek_v3_noaux_tc": DeepseekMoE(SimpleNamespace(**deepseek, norm_topk_prob=True), noaux_tc=True),
    }
    gen = torch.Generator().manual_seed(0)
    for block in blocks.values():
        with torch.no_grad():
            for t in [*block.parameters(), *block.buffers()]:
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
    return blocks


@pytest.mark.parametrize("tokens", [1, 13])
def test_moe_blocks_run_the_kernel_path_without_host_sync(tokens: int, monkeypatch) -> None:
    """Every family's MoE forward as it runs on CUDA (the kernel path; its Triton launches replaced by sync-free
    PyTorch stand-ins with the same contract) makes no host sync, so a CUDA graph can capture it, and equals the
    forward's PyTorch twin path."""
    import pagedllm.layers.fused_moe as layer_module

    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    for name, block in _moe_blocks().items():
        want = block(x)  # CPU: the twin
        with monkeypatch.context() as m:
            m.setattr(layer_module, "use_fused_kernels", lambda t: True)
            use_emulated_kernels(m)
            with no_host_sync(m):
                got = block(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mixtral", "qwen3moe-norm-dense"])
def test_cuda_graphs_capture_moe_decode(moe_dirs, variant: str, monkeypatch) -> None:
    """On the GPU (float32, Triton) the runner captures decode graphs for a MoE model, pure-decode steps replay
    them, and the greedy tokens and logprobs equal an eager run's."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.cuda_graphs import CudaGraphRunner

    replays = [0]
    run = CudaGraphRunner.run

    def counted(self, *args, **kwargs):
        replays[0] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(CudaGraphRunner, "run", counted)
    path = moe_dirs[variant]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for eager in (True, False):
        llm = LLM(
            path,
            dtype="float32",
            device="cuda",
            max_model_len=128,
            max_num_seqs=16,
            kv_cache_memory_bytes=16 << 20,
            enforce_eager=eager,
        )
        core = llm.llm_engine.engine_core
        assert (core.runner.graph_runner is None) == eager
        prompts = [random_prompt(n, core.vocab_size, seed=60 + n) for n in (3, 17, 9)]
        results[eager] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        core.check_integrity()
        del llm, core
        torch.cuda.empty_cache()
    assert replays[0] > 0, "no decode step replayed a graph"
    for eager_out, graph_out in zip(results[True], results[False]):
        a, b = eager_out.outputs[0], graph_out.outputs[0]
        assert a.token_ids == b.token_ids
        for tok, lps_a, lps_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(lps_a[tok].logprob - lps_b[tok].logprob) < 1e-4
    want = hf_greedy(path, [list(o.prompt_token_ids) for o in results[False]], 12)
    assert [list(o.outputs[0].token_ids) for o in results[False]] == want
