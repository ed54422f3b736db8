"""The CPU thread count follows the cores other processes leave free, and the user's own setting wins."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker import cpu_threads
from pagedllm.worker.cpu_threads import CpuThreadGovernor


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _governor(num_cpus: int, max_threads: int) -> CpuThreadGovernor:
    torch.set_num_threads(max_threads)
    gov = CpuThreadGovernor(interval_s=0.0)
    gov.enabled, gov._cpus, gov.max_threads, gov.num_threads = True, set(range(num_cpus)), max_threads, max_threads
    gov._tick_s = 0.01
    torch.set_num_threads(max_threads)
    return gov


def test_threads_leave_the_cores_others_use(restore_threads):
    gov = _governor(num_cpus=4, max_threads=4)
    assert [gov.threads_for(x) for x in (0.0, 0.2, 0.3, 1.0, 1.2, 1.4, 2.9, 8.0)] == [4, 4, 3, 3, 3, 2, 1, 1]
    gov.max_threads = 2  # a count set before the engine started is the most it uses
    assert gov.threads_for(0.0) == 2 and gov.threads_for(3.0) == 1


def test_maybe_update_moves_the_thread_count_with_the_load(restore_threads):
    gov = _governor(num_cpus=2, max_threads=2)
    # (seconds, busy ticks over all cores, own ticks); 100 ticks per second at _tick_s 0.01
    readings = iter([(1.0, 180, 80), (2.0, 380, 180), (3.0, 480, 280), (4.0, 680, 380)])
    gov._sample = (0.0, 0, 0)
    gov._read = lambda: next(readings)
    gov.maybe_update()  # others: 180 - 80 = 100 ticks in 1 s = one core
    assert gov.num_threads == torch.get_num_threads() == 1
    gov.maybe_update()  # others: 200 - 100 = 100 ticks: still one core
    assert torch.get_num_threads() == 1
    gov.maybe_update()  # others: 0
    assert gov.num_threads == torch.get_num_threads() == 2
    torch.set_num_threads(1)  # the user's call while the engine runs: theirs stands from now on
    gov.maybe_update()
    assert not gov.enabled and torch.get_num_threads() == 1
    gov.release()
    assert torch.get_num_threads() == 1


def test_release_gives_back_the_starting_count(restore_threads):
    gov = _governor(num_cpus=2, max_threads=2)
    gov._sample, gov._read = (0.0, 0, 0), lambda: (1.0, 100, 0)  # one core busy elsewhere
    gov.maybe_update()
    assert torch.get_num_threads() == 1
    gov.release()  # the engine shut down: torch's count is the one it started with
    assert torch.get_num_threads() == 2 and not gov.enabled


def test_omp_num_threads_turns_the_governor_off(restore_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert not CpuThreadGovernor().enabled


def test_the_engine_consults_the_governor_every_step(restore_threads, monkeypatch, tiny_llama):
    calls = []
    monkeypatch.setattr(CpuThreadGovernor, "maybe_update", lambda self: calls.append(self))
    with LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20) as llm:
        llm.generate(["The quick brown fox"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        gov = llm.llm_engine.engine_core._cpu_threads
    assert gov is not None and len(calls) >= 5 and all(c is gov for c in calls)


def test_pagedllm_cpu_threads_fixes_the_count(restore_threads, monkeypatch, tiny_llama):
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "1")
    llm = LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20)
    try:
        llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
        assert torch.get_num_threads() == 1
        assert not llm.llm_engine.engine_core._cpu_threads.enabled
    finally:
        llm.shutdown()
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "two")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_THREADS"):
        LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20)


@pytest.mark.skipif(cpu_threads.usable_cores() < 2 or sys.platform != "linux", reason="needs 2 cores and /proc")
def test_a_busy_neighbour_takes_a_core(restore_threads):
    """A real process spinning on one core: the governor gives it that core (waits for the reading, no sleep)."""
    torch.set_num_threads(cpu_threads.usable_cores())
    gov = CpuThreadGovernor(interval_s=0.2)
    assert gov.enabled
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        while gov.num_threads == gov.max_threads and time.monotonic() < deadline:
            gov.maybe_update()
        assert gov.num_threads <= gov.max_threads - 1
    finally:
        busy.kill()
        busy.wait()
