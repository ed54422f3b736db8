"""How many threads torch's CPU ops use, chosen from the cores other processes leave free.

torch runs each CPU op over ``torch.get_num_threads()`` threads that meet at a barrier when the op ends. When
another process keeps one of those cores busy, the thread sharing it waits a scheduler time slice (milliseconds)
for its turn at every op, and a decode step is hundreds of small ops: on a 2-core machine beside one busy process
the demo model fell from ~147 to 1.4-4.9 tokens/s, against 77 tokens/s with one thread.

``CpuThreadGovernor`` samples, every ``interval_s`` of engine steps, how much CPU time the cores this process may
run on spent on other processes (``/proc/stat`` less this process's own time from ``/proc/self/stat``, so our
own spinning threads do not count against us), and uses as many threads as there are cores left, at least one and
at most the thread count it started with. A neighbour that takes one core thus costs about one core's share.

The user's choice wins: with ``OMP_NUM_THREADS`` (or ``PAGEDLLM_CPU_THREADS``) set, or after the user calls
``torch.set_num_threads`` while the engine runs, the governor leaves the count alone. A count set before the engine
starts is the most it will use. Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

logger = logging.getLogger(__name__)

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, bounded by a cgroup v2 CPU quota if one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _cpu_busy_ticks(cpus: set[int]) -> int:
    """Busy clock ticks since boot summed over ``cpus`` (``/proc/stat``'s per-CPU lines)."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break  # the per-CPU lines come first, after the "cpu " total
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cpus:
                total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total


def _own_ticks() -> int:
    """This process's user + system clock ticks (all its threads)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)


class CpuThreadGovernor:
    """Sets torch's intra-op thread count from the free cores; call ``maybe_update()`` once per engine step."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.enabled = _can_govern()
        self.max_threads = max(1, min(torch.get_num_threads(), usable_cores()))
        self.num_threads = self.max_threads
        self._sample: tuple[float, int, int] | None = None  # (monotonic s, busy ticks, own ticks)
        if not self.enabled:
            return
        try:
            self._cpus = os.sched_getaffinity(0)
            self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
            self._sample = self._read()
        except (AttributeError, OSError, ValueError):
            self.enabled = False
            return
        if torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)

    def _read(self) -> tuple[float, int, int]:
        return time.monotonic(), _cpu_busy_ticks(self._cpus), _own_ticks()

    def maybe_update(self) -> None:
        """Re-sample the other processes' load if ``interval_s`` has passed, and move the thread count to the
        cores they leave free. Cheap otherwise (one clock read)."""
        if not self.enabled or time.monotonic() - self._sample[0] < self.interval_s:
            return
        if torch.get_num_threads() != self.num_threads:  # the user set a count while we ran: theirs stands
            logger.info("torch.set_num_threads(%d) was called: the CPU thread count stays there",
                        torch.get_num_threads())
            self.enabled = False
            return
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._sample, now
        self._sample = now
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) * self._tick_s / (t1 - t0)  # cores, on average
        threads = self.threads_for(others)
        if threads != self.num_threads:
            torch.set_num_threads(threads)
            self.num_threads = threads

    def release(self) -> None:
        """Give torch back the thread count this governor started with, unless the user has set one since."""
        if self.enabled and torch.get_num_threads() == self.num_threads != self.max_threads:
            torch.set_num_threads(self.max_threads)
        self.enabled = False

    def threads_for(self, others_cores: float) -> int:
        """Threads to use when other processes keep ``others_cores`` cores busy (an average over the last
        interval): the cores they leave, where a neighbour that keeps a quarter of a core busy or more takes a
        whole one; between 1 and ``max_threads``."""
        taken = max(0, math.ceil(others_cores - 0.25))
        return max(1, min(self.max_threads, len(self._cpus) - taken))


def _can_govern() -> bool:
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("PAGEDLLM_CPU_THREADS"):
        return False
    return os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")


def apply_user_thread_setting() -> None:
    """``PAGEDLLM_CPU_THREADS=N`` fixes torch's CPU thread count (``OMP_NUM_THREADS`` is torch's own)."""
    value = os.environ.get("PAGEDLLM_CPU_THREADS")
    if not value:
        return
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"PAGEDLLM_CPU_THREADS must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"PAGEDLLM_CPU_THREADS must be a positive integer, got {value!r}")
    torch.set_num_threads(n)
