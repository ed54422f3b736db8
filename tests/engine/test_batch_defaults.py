"""max_num_seqs / max_num_batched_tokens left unset take vLLM's device-dependent defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import SchedulerConfig, default_batch_limits, make_engine_config
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler

GiB = 2**30


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str, total_gib: float) -> torch.device:
    props = SimpleNamespace(name=name, total_memory=int(total_gib * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("name", "gib", "llm", "server"),
    [
        ("NVIDIA H100 80GB HBM3", 79.2, (16384, 1024), (8192, 1024)),
        ("NVIDIA H200", 139.8, (16384, 1024), (8192, 1024)),
        ("NVIDIA A100-SXM4-80GB", 79.2, (8192, 256), (2048, 256)),  # vLLM measured large budgets slower there
        ("NVIDIA L4", 22.0, (8192, 256), (2048, 256)),
    ],
)
def test_gpu_defaults_follow_vllms_table(monkeypatch, name, gib, llm, server) -> None:
    device = _fake_gpu(monkeypatch, name, gib)
    assert default_batch_limits(device, "llm") == llm
    assert default_batch_limits(device, "api_server") == server


def test_cpu_defaults() -> None:
    cpu = torch.device("cpu")
    assert default_batch_limits(cpu, "llm") == default_batch_limits(cpu, "api_server") == (8192, 256)


def test_resolve_fills_only_what_the_user_left_unset(monkeypatch) -> None:
    device = _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79.2)
    cfg = SchedulerConfig(max_model_len=4096)
    assert cfg.max_num_seqs is None and cfg.max_num_batched_tokens is None
    cfg.resolve_defaults(device)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (16384, 1024)

    cfg = SchedulerConfig(max_model_len=4096, max_num_seqs=64, usage_context="api_server")
    cfg.resolve_defaults(device)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 64)

    cfg = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=512)
    cfg.resolve_defaults(device)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 1024)


def test_without_chunked_prefill_the_default_budget_covers_max_model_len() -> None:
    cfg = SchedulerConfig(max_model_len=20000, enable_chunked_prefill=False)
    cfg.resolve_defaults(torch.device("cpu"))
    assert cfg.max_num_batched_tokens == 20000
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=20000, max_num_batched_tokens=8192, enable_chunked_prefill=False)


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_model_len=64, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="usage_context"):
        SchedulerConfig(max_model_len=64, usage_context="server")


def test_scheduler_refuses_unresolved_limits() -> None:
    with pytest.raises(ValueError, match="resolve_defaults"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(16, 4))


def test_serve_and_llm_contexts(tiny_llama: str) -> None:
    assert make_engine_config(tiny_llama, device="cpu").scheduler_config.usage_context == "llm"
    served = make_engine_config(tiny_llama, device="cpu", usage_context="api_server")
    assert served.scheduler_config.usage_context == "api_server"
    assert served.scheduler_config.max_num_seqs is None  # resolved by the engine core, on its device

    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20)
    cfg = llm.llm_engine.engine_core.config.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 256)
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20, max_num_seqs=3)
    cfg = llm.llm_engine.engine_core.config.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 3)


def test_admission_headroom_default_and_environment(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDLLM_ADMISSION_HEADROOM", raising=False)
    assert SchedulerConfig(max_model_len=64).admission_headroom_tokens == 128
    monkeypatch.setenv("PAGEDLLM_ADMISSION_HEADROOM", "0")
    assert SchedulerConfig(max_model_len=64).admission_headroom_tokens == 0
    monkeypatch.setenv("PAGEDLLM_ADMISSION_HEADROOM", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_ADMISSION_HEADROOM"):
        SchedulerConfig(max_model_len=64)
    monkeypatch.setenv("PAGEDLLM_ADMISSION_HEADROOM", "-1")
    with pytest.raises(ValueError, match="admission_headroom_tokens"):
        SchedulerConfig(max_model_len=64)
