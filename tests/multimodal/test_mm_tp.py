"""Vision-language models under tensor parallelism (TP=2 on CPU, gloo): the text model shards over both
ranks, the vision tower runs whole on each. Every rank receives the images (pixels, grid sizes, placeholder
offsets, hashes) with the broadcast scheduler output, encodes the same ones and computes the same M-RoPE
positions, so greedy tokens and logprobs equal one rank's (whose tests tie them to transformers) with one
image, two images and a text-only prompt in one batch, and 8-token steps that split every image span; with
async scheduling and preemption too. The encoder cache is the scheduler's: once all requests finish no block
or cache entry is held, on the scheduler or on any rank."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import QWEN2_VL_IMAGE, tiny_image

MAX_NEW = 6
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=192, num_gpu_blocks_override=160,
              enforce_eager=True, max_num_batched_tokens=8)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
CASES = {
    "llava": [
        ("hello <image> world the", [tiny_image(1)]),  # 16 placeholders an image
        ("<image> the cat <image> and the dog", [tiny_image(2), tiny_image(3, (20, 50))]),
        ("the quick brown fox", []),
    ],
    "qwen2_vl": [
        (f"hello {QWEN2_VL_IMAGE} world the", [tiny_image(1)]),  # 40x30: 20 placeholders
        (f"a {QWEN2_VL_IMAGE} b {QWEN2_VL_IMAGE} c", [tiny_image(2), tiny_image(3, (20, 50))]),  # 20 + 12
        ("just text here", []),
    ],
}


def _prompt(prompt: str, images: list):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def _rank_state(worker) -> tuple[int, int, int, int]:
    """(images encoded, embeddings held, requests with images tracked, the text model's query heads on this
    rank)."""
    enc = worker.model_runner.encoder_runner
    heads = worker.model_runner.model.language_model.model.layers[0].self_attn.num_heads
    return enc.num_encoded, len(enc.cache), len(enc.req_features) + len(enc.mrope), heads


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llava", {}),
        # Async scheduling, and a pool too small for the three at once: requests are preempted and recomputed
        # (their images encoded again on every rank).
        ("qwen2_vl", dict(async_scheduling=True, num_gpu_blocks_override=14, max_model_len=56)),
    ],
)
def test_tp2_matches_one_rank(request, arch: str, extra: dict) -> None:
    path = request.getfixturevalue(f"tiny_{arch}")
    cases = CASES[arch]
    prompts = [_prompt(p, imgs) for p, imgs in cases]
    engine = {**ENGINE, **extra}
    with LLM(path, **engine) as llm:
        want = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.llm_engine.engine_core
        preempted = core.scheduler.make_stats().num_preemptions
        assert llm.llm_engine.config.scheduler_config.async_scheduling == bool(extra)
        assert preempted > 0 if extra else preempted == 0
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
        enc = core.scheduler.encoder_cache
        assert not enc.cached and enc.num_free_slots + enc.num_freeable_slots == enc.cache_size
        # Each rank encoded every image (once, without preemption) and holds no embedding or request state
        # once all finished; the text model's 4 heads are split over the ranks.
        states = llm.collective_rpc(_rank_state)
        # (the embeddings kept are the scheduler's freeable entries: reusable by a later request)
        assert states[0] == states[1] and states[0][1:] == (len(enc.freeable), 0, 2)
        # a recomputed request encodes its images again
        assert states[0][0] == 3 if not preempted else states[0][0] >= 3
    for w, g in zip(want, got):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for j, tok in enumerate(w.outputs[0].token_ids):
            assert abs(g.outputs[0].logprobs[j][tok].logprob - w.outputs[0].logprobs[j][tok].logprob) < 1e-4
