"""CPU profile of a throughput run: how much of the wall time is Python work vs waiting on the GPU.

python benchmarks/profile_throughput.py MODEL_DIR [throughput flags...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from pagedllm.benchmarks import throughput


def main() -> None:
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(["--model", sys.argv[1], "--load-format", "dummy", *sys.argv[2:]])
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    throughput.main(args)
    prof.disable()
    print(f"wall {time.perf_counter() - start:.2f} s")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:9000])


if __name__ == "__main__":
    main()
