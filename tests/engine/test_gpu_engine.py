"""The engine on a CUDA GPU: bf16 greedy output against transformers, with logprob tolerance; graphs vs eager."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(vocab: int, lengths=(5, 33, 17, 64, 2, 120)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def _hf_greedy_bf16(path: str, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = list(prompt)
    steps = []
    for _ in range(n):
        logits = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        steps.append(torch.log_softmax(logits, -1).cpu())
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], steps


def _check_close(ours_ids, ours_lps, ref_ids, ref_lps, k: int = 5) -> None:
    """vLLM's check_logprobs_close: up to the first divergence, equal; at it, each side's token is in the
    other's top-k; after it, the sequences may differ."""
    for j, (a, b) in enumerate(zip(ours_ids, ref_ids)):
        if a == b:
            continue
        assert a in set(torch.topk(ref_lps[j], k).indices.tolist()), f"step {j}: our {a} not in HF top-{k}"
        assert b in ours_lps[j], f"step {j}: HF {b} not in our top-{k}"
        return


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "phi3", "mistral", "gemma2", "gemma3"])
def test_bf16_greedy_close_to_transformers(tiny_model_dirs, arch, tmp_path):
    path = tiny_model_dirs[arch]  # prompts up to 120 tokens: longer than the tiny models' windows (16, 32)
    if arch == "gemma2":
        # The CPU fixture's caps (4, 6) squash the logits so far that bf16 cannot order them (ties everywhere);
        # Gemma 2's own caps (50, 30) leave them apart.
        from tests.utils import make_tiny_model

        path = make_tiny_model(
            "gemma2", tmp_path / "gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        )
    llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    assert llm.llm_engine.engine_core.runner.attn_backend.name == "triton"
    prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref_ids, ref_lps = _hf_greedy_bf16(path, p, 16)
        _check_close(comp.token_ids, [set(d) for d in comp.logprobs], ref_ids, ref_lps)
    llm.llm_engine.check_integrity()


def test_cuda_graphs_match_eager(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(
            path,
            dtype="float32",
            device="cuda",
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=512,
            enforce_eager=eager,
            max_num_seqs=16,
        )
        runner = llm.llm_engine.engine_core.runner
        assert (runner.graph_runner is None) == eager
        prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
        results.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ]
        )
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]


def test_triton_and_torch_backends_agree_fp32(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            dtype="float32",
            device="cuda",
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=512,
            attention_backend=backend,
            enforce_eager=True,
            max_num_batched_tokens=64,
            block_size=16,
        )
        prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
        results.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ]
        )
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]


def test_gpu_memory_utilization_sizes_cache_from_profile(tiny_model_dirs):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(tiny_model_dirs["llama"], device="cuda", gpu_memory_utilization=0.5, max_model_len=512)
    info = llm.llm_engine.engine_core.kv_cache_info
    total = torch.cuda.get_device_properties(0).total_memory
    # The cache gets most of half the card (tiny weights), never more than half.
    assert 0.2 * total < info["kv_cache_bytes"] < 0.5 * total
    out = llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_async_scheduling_matches_sync_with_graphs_and_preemption(tiny_model_dirs):
    """On the GPU the async loop feeds sampled ids to the next step on the device (graphs and eager steps), with
    preemption, seeds, penalties and logprobs in one batch: the same tokens as the synchronous loop (fp32)."""
    path = tiny_model_dirs["llama"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=1, top_p=0.9, top_k=40, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=5),
    ]
    results = []
    for mode in (False, True):
        llm = LLM(
            path,
            dtype="float32",
            device="cuda",
            num_gpu_blocks_override=14,  # 224 tokens: the six requests (up to 144 tokens each) cannot all fit
            block_size=16,
            max_model_len=192,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            async_scheduling=mode,
        )
        core = llm.llm_engine.engine_core
        assert core.async_scheduling == mode and core.runner.graph_runner is not None
        prompts = _prompts(core.vocab_size)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert llm.llm_engine.get_stats().num_preemptions > 0
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
        del llm, core
        torch.cuda.empty_cache()
    assert results[0] == results[1]
