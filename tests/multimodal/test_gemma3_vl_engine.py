"""Gemma 3 with images through the engine: greedy tokens and logprobs equal transformers' (float32, CPU) with one
image, two images, a text-only prompt in the same batch, a step budget that forces chunks (which never split an
image's tokens: they attend to each other both ways) and a prefix hit on a repeated image."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import GEMMA3_MM_TOKENS, hf_gemma3_vl_greedy_and_logprobs, tiny_image

MAX_NEW = 6
ENGINE = dict(
    device="cpu",
    dtype="float32",
    block_size=4,
    max_model_len=128,
    num_gpu_blocks_override=128,
    enforce_eager=True,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


def _check_against_hf(path: str, out, prompt: str, images: list) -> None:
    ids, new, logprobs = hf_gemma3_vl_greedy_and_logprobs(path, prompt, images, MAX_NEW)
    assert out.prompt_token_ids == ids
    comp = out.outputs[0]
    assert comp.token_ids == new
    for j, tok in enumerate(new):
        assert abs(comp.logprobs[j][tok].logprob - logprobs[j][tok].item()) < 1e-4


def _mm(prompt: str, images: list) -> dict | str:
    if not images:
        return prompt
    return {"prompt": prompt, "multi_modal_data": {"image": images if len(images) != 1 else images[0]}}


def _assert_clean(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.scheduler.check_integrity()
    enc = core.scheduler.encoder_cache
    assert not enc.cached and enc.num_free_slots + enc.num_freeable_slots == enc.cache_size


CASES = [
    ("hello <start_of_image> world the", [tiny_image(1, (56, 40))]),
    ("<start_of_image> the cat <start_of_image> and the dog", [tiny_image(2), tiny_image(3, (20, 50))]),
    ("the quick brown fox jumps", []),
]


@pytest.fixture(scope="module")
def llm(tiny_gemma3_vl: str):
    with LLM(tiny_gemma3_vl, **ENGINE) as engine:
        yield engine


def test_images_and_text_in_one_batch_match_transformers(llm: LLM, tiny_gemma3_vl: str) -> None:
    outs = llm.generate([_mm(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(CASES, outs):
        _check_against_hf(tiny_gemma3_vl, out, prompt, images)
        assert out.prompt == prompt  # as given (the blank lines around an image are the processor's)
    _assert_clean(llm)


def test_chat_lays_an_image_out_as_the_processor_does(llm: LLM) -> None:
    """A chat image part renders as ``<start_of_image>`` between blank lines (then the text), as the chat template's
    ``<start_of_image>`` becomes once Gemma3Processor has laid it out; the same ids as the text prompt written so."""
    tok = llm.get_tokenizer()
    msg = [{"role": "user", "content": [{"type": "image_pil", "image_pil": tiny_image(3)}, {"type": "text", "text": "hi"}]}]
    chat = llm.chat(msg, GREEDY, use_tqdm=False)[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<start_of_image>\nhi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.count("<start_of_image>") == 1 and text.startswith(tok.bos_token)
    text = text[len(tok.bos_token) :]  # a text prompt gets its BOS from the tokenizer
    direct = llm.generate(_mm(text, [tiny_image(3)]), GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    boi = chat.prompt_token_ids.index(tok.convert_tokens_to_ids("<start_of_image>"))
    assert tok.decode(chat.prompt_token_ids[:boi]).endswith("\n\n")
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    _assert_clean(llm)


def test_chunks_never_split_an_image(tiny_gemma3_vl: str) -> None:
    """A 20-token step budget: prompts are computed over several chunks, each image's 16 tokens within one (a
    chunk that would end inside an image ends before it); outputs still match transformers'."""
    from pagedllm.core.scheduler import Scheduler

    seen: list[tuple[int, int, list]] = []
    plan = Scheduler._plan_encoder

    def spy(self, request, num_computed, num_new, budget):
        out = plan(self, request, num_computed, num_new, budget)
        seen.append((num_computed, out[0], request.mm_features))
        return out

    Scheduler._plan_encoder = spy
    try:
        with LLM(tiny_gemma3_vl, max_num_batched_tokens=20, **ENGINE) as llm:
            outs = llm.generate([_mm(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
            _assert_clean(llm)
    finally:
        Scheduler._plan_encoder = plan
    for start, num_new, features in seen:
        end = start + num_new
        assert not any(f.offset < end < f.end for f in features)  # no chunk ends inside an image
    assert any(0 < num_new < 20 for _, num_new, _ in seen)  # some chunk was cut before an image
    for (prompt, images), out in zip(CASES, outs):
        _check_against_hf(tiny_gemma3_vl, out, prompt, images)


def test_budget_smaller_than_an_image_is_refused(tiny_gemma3_vl: str) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny_gemma3_vl, max_num_batched_tokens=GEMMA3_MM_TOKENS - 1, **ENGINE)


def test_prefix_hit_on_a_repeated_image(llm: LLM, tiny_gemma3_vl: str) -> None:
    prompt = "hello <start_of_image> world and the rest of the prompt"
    first = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
    runner = llm.llm_engine.engine_core.runner.encoder_runner
    encoded = runner.num_encoded
    again = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_mm(prompt, [tiny_image(12)]), GREEDY, use_tqdm=False)[0]
    image_end = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<end_of_image>"))
    assert again.num_cached_tokens >= image_end  # past the image
    assert runner.num_encoded == encoded + 1  # the hit covered the image: only the other image was encoded
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _check_against_hf(tiny_gemma3_vl, again, prompt, [tiny_image(11)])
    _check_against_hf(tiny_gemma3_vl, other, prompt, [tiny_image(12)])
    _assert_clean(llm)


def test_prefix_hit_ending_inside_an_image(llm: LLM, tiny_gemma3_vl: str) -> None:
    """A prompt that ends near its image: the second time, the hit (whole blocks, not the last token) ends inside
    the image's tokens, and the step computes the rest of them seeing each other both ways. (The processor's blank
    line follows the image: words go before it until the last whole block ends inside the image.)"""
    ip, image_token = llm.llm_engine.input_processor, llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>")
    for words in range(8):
        prompt = "hello" + " a" * words + " <start_of_image>"
        ids = ip.process("probe", _mm(prompt, [tiny_image(31)]), GREEDY).prompt_token_ids
        if ids.index(image_token) < (len(ids) - 1) // 4 * 4 < ids.index(image_token) + GEMMA3_MM_TOKENS - 1:
            break
    first = llm.generate(_mm(prompt, [tiny_image(31)]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_mm(prompt, [tiny_image(31)]), GREEDY, use_tqdm=False)[0]
    ids = first.prompt_token_ids
    image_start = ids.index(llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>"))
    assert image_start < again.num_cached_tokens < image_start + GEMMA3_MM_TOKENS - 1
    for out in (first, again):
        _check_against_hf(tiny_gemma3_vl, out, prompt, [tiny_image(31)])
    _assert_clean(llm)


def test_spans_go_to_the_reference_attention_whatever_the_backend() -> None:
    """A step with bidirectional spans runs the PyTorch reference (the layer's own backend is not called) with
    ``AND(window, OR(causal, span))``, transformers' mask for Gemma 3's images."""
    import torch

    from pagedllm.attention.base import AttentionMetadata
    from pagedllm.layers.attention import Attention

    class NotCalled:
        name = "triton"

        def forward(self, *args, **kwargs):
            raise AssertionError("the fast backend was called for a step with bidirectional spans")

    torch.manual_seed(0)
    T, heads, kv_heads, hd, window, span = 7, 2, 1, 8, 3, (1, 5)
    layer = Attention(heads, hd, hd**-0.5, kv_heads, NotCalled(), 0, sliding_window=window)
    q, k, v = torch.randn(T, heads, hd), torch.randn(T, kv_heads, hd), torch.randn(T, kv_heads, hd)
    kv_cache = torch.zeros(2, 2, 4, kv_heads, hd)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=1, num_tokens=T, max_query_len=T, max_seq_len=T, query_start_loc=torch.tensor([0, T], **i32),
        seq_lens=torch.tensor([T], **i32), block_table=torch.tensor([[0, 1]], **i32), slot_mapping=torch.arange(T),
        query_start_loc_cpu=torch.tensor([0, T], **i32), seq_lens_cpu=torch.tensor([T], **i32),
        bidirectional_spans=((0, *span),),
    )  # fmt: skip
    out = layer(q, k, v, kv_cache, meta)
    pos = torch.arange(T)
    qp, kp = pos[:, None], pos[None, :]
    in_span = lambda p: (p >= span[0]) & (p < span[1])  # noqa: E731
    visible = ((kp <= qp) | (in_span(qp) & in_span(kp))) & (kp > qp - window)
    scores = torch.einsum("qhd,kd->hqk", q, k[:, 0]) * hd**-0.5
    ref = torch.einsum("hqk,kd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v[:, 0])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert visible[1, 4] and not visible[4, 5] and not visible[4, 1]  # the span sees ahead, the window cuts


@pytest.mark.parametrize(
    "renames",
    [
        # transformers 5's module names
        (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
         ("language_model.model.", "model.language_model.")),
        # the published checkpoints: the SigLIP tower under vision_model
        (("vision_tower.", "vision_tower.vision_model."),),
    ],
)  # fmt: skip
def test_other_checkpoint_names_load(llm: LLM, tiny_gemma3_vl: str, tmp_path, renames) -> None:
    from tests.multimodal.test_llava_engine import _resave_with_names

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    path = _resave_with_names(tiny_gemma3_vl, tmp_path / "renamed", rename)
    prompt = _mm(*CASES[0])
    with LLM(path, **ENGINE) as other:
        assert other.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
            llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        )


def test_token_id_prompts_with_a_mark_or_the_expanded_image(llm: LLM, tiny_gemma3_vl: str) -> None:
    """A token-id prompt may hold ``<start_of_image>`` alone (expanded here, with ``<end_of_image>``) or the whole
    expanded image (kept); the chat front-end's length estimate counts the expansion."""
    prompt, images = CASES[0]
    ids, new, _ = hf_gemma3_vl_greedy_and_logprobs(tiny_gemma3_vl, prompt, images, MAX_NEW)
    tok = llm.get_tokenizer()
    image_id, eoi = tok.convert_tokens_to_ids(["<image_soft_token>", "<end_of_image>"])
    mark = [t for t in ids if t not in (image_id, eoi)]
    for prompt_ids in (ids, mark):
        out = llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": images[0]}}, GREEDY,
                           use_tqdm=False)[0]  # fmt: skip
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == new
    assert llm.llm_engine.input_processor.expanded_prompt_len(mark, 1) == len(ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_async_scheduling(
    tiny_gemma3_vl: str, admit_while_blocks_last, async_scheduling: bool
) -> None:
    """A cache too small for both requests at once: one is preempted and recomputed (its image encoded again, its
    chunks still whole around the image), and both still give transformers' tokens; with async scheduling too."""
    engine = {**ENGINE, "max_model_len": 48, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 20}
    text = "the end of it and the rest of the words"
    cases = [(f"{w} <start_of_image> {text}", [tiny_image(50 + i)]) for i, w in enumerate(("one", "two"))]
    with LLM(tiny_gemma3_vl, async_scheduling=async_scheduling, **engine) as llm:
        outs = llm.generate([_mm(p, imgs) for p, imgs in cases], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.scheduler.make_stats()
        _assert_clean(llm)
    assert stats.num_preemptions > 0
    for (prompt, images), out in zip(cases, outs):
        _check_against_hf(tiny_gemma3_vl, out, prompt, images)


def test_pan_and_scan_crops_are_refused(llm: LLM) -> None:
    """An image processor set to pan-and-scan (extra crops per image, each with its own image tokens) is refused
    with the field named, not served with the crops dropped."""
    import copy

    import numpy as np

    proc = copy.copy(llm.llm_engine.input_processor.mm_processor)
    proc._image_processor = lambda images, return_tensors: {
        "pixel_values": np.zeros((3, 3, 56, 56), np.float32),
        "num_crops": np.array([2]),
    }
    with pytest.raises(ValueError, match="multi_modal_data.image: .*pan-and-scan"):
        proc.process([1, 2], [tiny_image(1)])
