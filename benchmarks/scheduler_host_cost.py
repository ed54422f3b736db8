"""Host cost of the scheduler per step at N running decodes (CPU, a tiny random Llama; no GPU needed).

    python benchmarks/scheduler_host_cost.py [N]        (default 450, about the Qwen 1000 x 1024 row's running set)

Builds the engine core, admits N requests (32-token prompts, 300 tokens each), steps past the prefill, then times
30 synchronous steps' ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` and prints their medians.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.core.sched_output import EngineCoreRequest  # noqa: E402
from tests.utils import make_tiny_model  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 450
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model("llama", Path(tmp) / "llama")
        llm = LLM(
            path, dtype="float32", device="cpu", async_scheduling=False, max_num_seqs=1024, max_model_len=512,
            block_size=16, max_num_batched_tokens=16384,
        )  # fmt: skip
        core = llm.llm_engine.engine_core
        params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        for i in range(n):
            prompt = [5 + i % 7, 6, 7, 8] * 8
            core.add_request(EngineCoreRequest(str(i), prompt, params, eos_token_id=None, arrival_time=0.0))
        for _ in range(3):  # past the prefill: every request decodes from here on
            core.step()
        schedule_s, update_s = [], []
        for _ in range(30):
            t0 = time.perf_counter()
            sched = core.scheduler.schedule()
            t1 = time.perf_counter()
            step = core.runner.launch(sched)
            core.runner.sample(step)
            result = core.runner.collect(step)
            t2 = time.perf_counter()
            core.scheduler.update_from_output(sched, result)
            t3 = time.perf_counter()
            schedule_s.append(t1 - t0)
            update_s.append(t3 - t2)
    print(
        f"{n} running decodes: schedule {statistics.median(schedule_s) * 1e3:.2f} ms, "
        f"update_from_output {statistics.median(update_s) * 1e3:.2f} ms (medians of 30 steps)"
    )


if __name__ == "__main__":
    main()
