"""CPU profile of a throughput run's timed ``generate`` (not the start-up): where the host's time per step goes.
Also prints the CUDA caching allocator's counters over the timed run (retries and device frees synchronize).

python benchmarks/profile_throughput.py MODEL_DIR [throughput flags...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

from pagedllm.benchmarks import throughput
from pagedllm.entrypoints.llm import LLM

COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def main() -> None:
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(["--model", sys.argv[1], "--load-format", "dummy", *sys.argv[2:]])
    prof = cProfile.Profile()
    generate = LLM.generate
    before: dict[str, int] = {}

    def timed_generate(self, *a, **kw):  # the timed call is the one with a progress bar
        if not kw.get("use_tqdm", True) or before:
            return generate(self, *a, **kw)
        if torch.cuda.is_available():
            before.update({k: torch.cuda.memory_stats().get(k, 0) for k in COUNTERS})
        prof.enable()
        try:
            return generate(self, *a, **kw)
        finally:
            prof.disable()

    LLM.generate = timed_generate
    throughput.main(args)
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        print("allocator over the timed run:", {k: stats.get(k, 0) - before.get(k, 0) for k in COUNTERS})
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
        print(s.getvalue()[:10000])


if __name__ == "__main__":
    main()
