"""Our model forward with LoRA layers installed, one flattened batch mixing base rows and several adapters,
against transformers + peft per row's adapter (float32, CPU, torch attention backend; the same on CUDA with
the Triton kernels under ``-m gpu``). Also: the comparison fails when the scaling or the q/k/v order is wrong.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm.lora.layers import LoRALinearMethod
from pagedllm.lora.manager import LoRAManager
from tests.lora.lora_utils import (
    ATOL,
    LORA_ARCHS,
    MIXED,
    hf_peft_logits,
    load_model,
    prefill,
    random_prompt,
    run_mixed_batch,
)


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_mixed_adapters_match_peft(arch, tiny_model_dirs, lora_adapters) -> None:
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    out, prompts, slots = run_mixed_batch(base, adapters, MIXED)
    assert slots[0] == slots[3] == -1 and slots[1] == slots[5] and len({s for s in slots if s >= 0}) == 4
    for name, prompt, logits in zip(MIXED, prompts, out):
        expected = hf_peft_logits(base, adapters.get(name), tuple(prompt))
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        if name is not None:  # the adapter really moves the logits
            base_logits = hf_peft_logits(base, None, tuple(prompt))
            assert (logits - base_logits).abs().max() > 100 * ATOL, name


@pytest.mark.gpu
@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_mixed_adapters_match_peft_cuda(arch, tiny_model_dirs, lora_adapters) -> None:
    """The same batch on CUDA: the LoRA layers take the Triton shrink/expand kernels."""
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    out, prompts, _ = run_mixed_batch(base, adapters, MIXED, device="cuda")
    for name, prompt, logits in zip(MIXED, prompts, out):
        expected = hf_peft_logits(base, adapters.get(name), tuple(prompt))
        torch.testing.assert_close(logits, expected, atol=5e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_lora_layers_leave_base_rows_alone(tiny_llama) -> None:
    """Installed LoRA layers with no adapter active (and with one active for other rows) change nothing for
    base rows; the layers wrap the original method."""
    model, model_config = load_model(tiny_llama)
    prompts = [random_prompt(n, model_config.vocab_size, seed=n) for n in (6, 9)]
    before = prefill(model, model_config, prompts)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_num_tokens=64)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert (
        isinstance(layer.quant_method, LoRALinearMethod)
        and layer.quant_method is manager.layers["model.layers.0.self_attn.qkv_proj"]
    )
    assert len(manager.layers) == 4 * model_config.num_layers
    manager.set_mapping([-1, -1], [6, 9])
    assert not manager.mapping.apply_lora
    after = prefill(model, model_config, prompts)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# --------------------------------------------------------------------- the comparison catches mistakes


def _max_err(base, adapters, name, **kwargs) -> float:
    out, prompts, _ = run_mixed_batch(base, adapters, [None, name], **kwargs)
    expected = hf_peft_logits(base, adapters[name], tuple(prompts[1]))
    return (out[1] - expected).abs().max().item()


def test_wrong_scaling_is_caught(tiny_llama, lora_adapters, tmp_path) -> None:
    """Reading the rsLoRA adapter as plain LoRA (alpha / r instead of alpha / sqrt(r)) breaks the match."""
    adapters = dict(lora_adapters["llama"])
    assert _max_err(tiny_llama, adapters, "rs") < ATOL
    wrong = shutil.copytree(adapters["rs"], tmp_path / "rs_as_plain")
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["use_rslora"] = False
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    out, prompts, _ = run_mixed_batch(tiny_llama, {**adapters, "rs": str(wrong)}, [None, "rs"])
    expected = hf_peft_logits(tiny_llama, adapters["rs"], tuple(prompts[1]))
    assert (out[1] - expected).abs().max() > 100 * ATOL


def test_wrong_qkv_order_is_caught(tiny_llama, lora_adapters) -> None:
    """Mapping k_proj's and v_proj's adapters to each other's shard (same shapes) breaks the match; so does
    swapping gate and up."""
    adapters = lora_adapters["llama"]
    assert _max_err(tiny_llama, adapters, "all") < ATOL

    def swap(order):
        def tweak(manager):
            manager.packed_modules_mapping = {**manager.packed_modules_mapping, **order}

        return tweak

    assert (
        _max_err(tiny_llama, adapters, "all", tweak=swap({"qkv_proj": ["q_proj", "v_proj", "k_proj"]}))
        > 100 * ATOL
    )
    assert (
        _max_err(tiny_llama, adapters, "all", tweak=swap({"gate_up_proj": ["up_proj", "gate_proj"]}))
        > 100 * ATOL
    )
