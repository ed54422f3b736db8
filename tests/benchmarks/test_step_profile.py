"""StepProfiler (`bench throughput --profile-steps`) times the phases the engine really runs."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.benchmarks.step_profile import StepProfiler, format_report


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_phase_is_timed(tiny_llama: str, async_scheduling: bool) -> None:
    llm = LLM(tiny_llama, dtype="float32", device="cpu", async_scheduling=async_scheduling)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z]{8}")
        ),
    ]
    llm.generate(["a b c", "d e f"], params, use_tqdm=False)  # compiles the grammar before profiling
    profiler = StepProfiler(llm.llm_engine)
    llm.generate(["a b c", "d e f"], params, use_tqdm=False)
    report = profiler.stop()
    assert report["steps"] >= 8
    for phase in ("schedule", "launch", "sample", "wait", "update"):
        assert report[f"{phase}_ms_per_step"] > 0, phase
    # sync: the fill on the engine's thread; async: waiting for the fill in the worker thread (maybe ~0, not 0)
    assert report["mask_ms_per_step"] > 0
    assert report["other_ms_per_step"] >= 0
    assert "launch" in format_report(report)
    # The wrappers are gone again: the engine runs its own methods.
    assert "launch" not in vars(llm.llm_engine.engine_core.runner)
