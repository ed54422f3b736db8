"""The demo's tokens/s on CPU alone and beside a process that keeps one core busy.

Runs the README's demo generation (`pagedllm generate PROMPT --max-tokens 64`, the bundled model) in fresh
processes, alternating the cases, and prints each run's tokens/s and the medians:

- alone: nothing else running;
- busy neighbour: one other process spinning on a core for the whole run;
- "..., all cores": the same with the thread count fixed at the usable cores (``PAGEDLLM_CPU_THREADS``), i.e.
  without the engine's choice of thread count.

    python benchmarks/cpu_busy_neighbour.py --runs 3

Run it on an otherwise idle machine: the "alone" case assumes one.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

from pagedllm.worker.cpu_threads import usable_cores

_RATE = re.compile(r"\[(\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)")


def demo_rate(prompt: str, env: dict[str, str]) -> float:
    """tokens/s of one `pagedllm generate` run (its own report: generation only, not loading)."""
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", prompt, "--max-tokens", "64"],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    m = _RATE.search(out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"no rate in the demo's output:\n{out.stdout}\n{out.stderr}")
    return float(m.group(3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each case, alternating")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PAGEDLLM_CPU_THREADS")}
    fixed = {**env, "PAGEDLLM_CPU_THREADS": str(usable_cores())}
    cases = {
        "alone": (env, False),
        "alone, all cores": (fixed, False),
        "busy neighbour": (env, True),
        "busy neighbour, all cores": (fixed, True),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(args.runs):
        for name, (case_env, busy) in cases.items():
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                rate = demo_rate(args.prompt, case_env)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            rates[name].append(rate)
            print(f"run {run + 1}: {name}: {rate:.1f} tok/s", flush=True)
    alone = statistics.median(rates["alone"])
    print(f"\nusable cores: {usable_cores()}")
    print("| case | tok/s (median) | runs | of alone |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {med:.1f} | {runs} | {100 * med / alone:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
