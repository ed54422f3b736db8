"""Session-wide fixtures: tiny checkpoints built once; ``gpu`` tests skipped without CUDA."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # so `from tests.utils import ...` works under plain `pytest` too
    sys.path.insert(0, _ROOT)

from tests.utils import TINY_ARCHS, make_tiny_model  # noqa: E402

# `pagedllm serve` keeps engine configs between starts (core_launch's config cache): the tests' servers keep theirs
# in a directory of this run, not in the user's cache.
os.environ.setdefault("PAGEDLLM_CACHE_DIR", tempfile.mkdtemp(prefix="pagedllm-test-cache-"))
# Tests compare engines and transformers value for value: one fixed CPU thread count for the whole run (and its
# servers), so the results do not depend on how busy the machine is. The thread-count tests lift it.
os.environ.setdefault("PAGEDLLM_CPU_THREADS", str(torch.get_num_threads()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """arch -> directory of a tiny HF checkpoint, for every arch in ``TINY_ARCHS`` (untied, one file)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, str]) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def updated_tiny_llama(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A trainer's "new weights" for ``tiny_llama``: (a checkpoint directory holding them, their state dict in HF
    names), every tensor changed (``tests.utils.perturbed_checkpoint``)."""
    from tests.utils import perturbed_checkpoint

    dst = tmp_path_factory.mktemp("updated") / "llama"
    return str(dst), perturbed_checkpoint(tiny_llama, dst)


@pytest.fixture
def admit_while_blocks_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's admission rule, no decode headroom (``SchedulerConfig.admission_headroom_tokens`` = 0), for engines
    built after it: tests that mean to preempt under a small KV cache."""
    monkeypatch.setenv("PAGEDLLM_ADMISSION_HEADROOM", "0")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random LLaVA-1.5 checkpoint with its processor (``tests.utils.make_tiny_llava``): 16 tokens an image."""
    from tests.utils import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava") / "llava")


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2-VL checkpoint with its image processor (``tests.utils.make_tiny_qwen2_vl``)."""
    from tests.utils import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl") / "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2.5-VL checkpoint (window and full attention in its tower) with Qwen2-VL's image processor."""
    from tests.utils import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl") / "qwen2_5_vl", v2_5=True)


@pytest.fixture(scope="session")
def tiny_gemma3_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Gemma 3 checkpoint with images (``tests.utils.make_tiny_gemma3_vl``): 16 tokens an image."""
    from tests.utils import make_tiny_gemma3_vl

    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny_gemma3_vl") / "gemma3_vl")


@pytest.fixture(scope="session")
def tiny_llava_next(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random LLaVA-NeXT checkpoint with its processor: 2x1, 1x2 or 2x2 tiles of 28x28 an image."""
    from tests.utils import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava_next") / "llava_next", llava_next=True)
