"""Where an engine step's time goes: host time per phase and the GPU's busy fraction (``bench throughput
--profile-steps``).

Wraps one ``EngineCore``'s phases with timers: ``schedule``, ``launch`` (input preparation and the forward's
kernel launches, ``ModelRunner.launch``), ``sample`` (sampling metadata and the sampler's launches), ``mask``
(structured outputs: filling a step's token bitmask on the engine's thread, or, with async scheduling, waiting for
the fill running in the background), ``wait`` (blocked in ``collect`` for the device to finish a step: large means
the GPU is the bottleneck), ``update`` (``update_from_output``), ``propose`` (speculative decoding: the proposer's
drafts, its own waits for the device included) and the rest of each engine step (front-end output
processing). On CUDA an event before each launch and one after its sampling bracket the step; the GPU is "busy"
from the start event (which fires once the previous work is done) to the end event, so the busy fraction is the
sum of those intervals over the wall time (it counts gaps while the host is still launching a step as busy).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

_PHASES = ("schedule", "launch", "sample", "mask", "wait", "update", "propose")


class StepProfiler:
    def __init__(self, llm_engine: Any) -> None:
        self.llm_engine = llm_engine
        core = llm_engine.engine_core
        self.core = core
        self.host: dict[str, float] = defaultdict(float)
        self.num_steps = 0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cuda = core.runner.device.type == "cuda"
        self._originals: list[tuple[Any, str, Any]] = []
        self._open_event: torch.cuda.Event | None = None  # recorded before a launch, until its sampling
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update")
        self._wrap(core.runner, "collect", "wait")
        self._wrap(core.runner, "launch", "launch", event="start")
        self._wrap(core.runner, "sample", "sample", event="end")
        self._wrap(core, "_grammar_bitmask", "mask")
        self._wrap(core, "_await_bitmask", "mask")
        if getattr(core, "proposer", None) is not None:
            self._wrap(core.proposer, "propose", "propose")
        self._wrap(llm_engine, "step", "engine_step")
        self.start = time.perf_counter()

    def _wrap(self, obj: Any, name: str, key: str, event: str | None = None) -> None:
        fn = getattr(obj, name)
        host = self.host

        def timed(*args, **kwargs):
            if event == "start" and self.cuda:
                self._open_event = torch.cuda.Event(enable_timing=True)
                self._open_event.record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            host[key] += time.perf_counter() - t0
            if key == "engine_step":
                self.num_steps += 1
            if event == "end" and self._open_event is not None:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record()
                self.events.append((self._open_event, end_ev))
                self._open_event = None
            return out

        self._originals.append((obj, name, fn))
        setattr(obj, name, timed)

    def stop(self) -> dict[str, float]:
        """Restore the wrapped methods; per-step milliseconds and the GPU busy fraction."""
        wall = time.perf_counter() - self.start
        for obj, name, _ in self._originals:
            delattr(obj, name)  # the instance attribute shadowed the class's method
        n = max(self.num_steps, 1)
        report = {"steps": self.num_steps, "wall_ms_per_step": 1e3 * wall / n}
        for key in _PHASES:
            report[f"{key}_ms_per_step"] = 1e3 * self.host[key] / n
        accounted = sum(self.host[k] for k in _PHASES)
        report["other_ms_per_step"] = 1e3 * (self.host["engine_step"] - accounted) / n
        if self.cuda and self.events:
            torch.cuda.synchronize()
            busy_ms = sum(s.elapsed_time(e) for s, e in self.events)
            report["gpu_busy_fraction"] = busy_ms / (1e3 * wall)
        return report


def format_report(report: dict[str, float]) -> str:
    parts = [f"{report['steps']} steps, {report['wall_ms_per_step']:.2f} ms/step wall"]
    parts += [
        f"{k[:-12]} {report[k]:.2f}" for k in report if k.endswith("_ms_per_step") and k != "wall_ms_per_step"
    ]
    line = "Step profile: " + ", ".join(parts) + " (host ms per step)"
    if "gpu_busy_fraction" in report:
        line += f"; GPU busy {100 * report['gpu_busy_fraction']:.1f}% of the wall time"
    return line
