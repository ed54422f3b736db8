"""LoRA on a multimodal model's text model: a PEFT adapter saved from transformers' vision-language class (its
text layers named ``model.language_model.layers...``) gives transformers + PEFT's greedy tokens with an image in
the prompt (LLaVA, Qwen2-VL), and the base model's without the adapter."""

from __future__ import annotations

import pytest
import torch

import tests.utils as tu
from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=96,
              enforce_eager=True)  # fmt: skip
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _adapter(path: str, out_dir) -> str:
    """q, v and down projections of the text model only, with seeded noise in every LoRA tensor."""
    from peft import LoraConfig, get_peft_model

    model = tu._hf_vlm_class(path).from_pretrained(path, dtype=torch.float32)
    targets = r".*language_model.*\.(q_proj|v_proj|down_proj)"
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.mark.parametrize(
    "fixture, oracle",
    [("tiny_llava", tu.hf_llava_greedy_and_logprobs), ("tiny_qwen2_vl", tu.hf_qwen2_vl_greedy_and_logprobs)],
)
def test_adapter_with_images_matches_transformers_peft(request, monkeypatch, tmp_path, fixture, oracle) -> None:
    from peft import PeftModel

    path = request.getfixturevalue(fixture)
    adapter = _adapter(path, tmp_path / "adapter")
    image = tu.tiny_image(3)
    with LLM(path, enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        prompt = f"{llm.llm_engine.input_processor.image_placeholder}\nwhat is it"
        mm = {"prompt": prompt, "multi_modal_data": {"image": image}}
        tuned = llm.generate(mm, GREEDY, lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)[0]
        base = llm.generate(mm, GREEDY, use_tqdm=False)[0]
    want_base = oracle(path, prompt, [image], MAX_NEW)[1]

    def load_with_adapter(cls, p: str):  # a fresh model (the oracles' cached one must stay without LoRA)
        model = cls.from_pretrained(p, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        return PeftModel.from_pretrained(model, adapter).eval()

    monkeypatch.setattr(tu, "_load_hf_vlm", load_with_adapter)
    ids, want, _ = oracle(path, prompt, [image], MAX_NEW)
    assert tuned.prompt_token_ids == ids
    assert tuned.outputs[0].token_ids == want
    assert base.outputs[0].token_ids == want_base != want
