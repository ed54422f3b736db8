"""LoRA fixtures: the PEFT adapters of ``lora_utils`` saved once per session."""

from __future__ import annotations

import pytest

from tests.lora.lora_utils import LORA_ARCHS, adapter_kwargs, make_peft_adapter


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, dict[str, str]]:
    """arch -> adapter name -> adapter directory, for every arch in ``LORA_ARCHS``."""
    root = tmp_path_factory.mktemp("lora_adapters")
    out = {}
    for arch in LORA_ARCHS:
        out[arch] = {
            name: make_peft_adapter(tiny_model_dirs[arch], root / arch / name, seed=i + 1, **kwargs)
            for i, (name, kwargs) in enumerate(adapter_kwargs(arch).items())
        }
    return out
