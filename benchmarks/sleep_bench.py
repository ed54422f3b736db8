"""Sleep mode on a real model shape: seconds to sleep and wake, and the GPU memory held while asleep.

    python benchmarks/sleep_bench.py [--shape llama-3.1-8b] [--gpu-memory-utilization 0.9]

The engine loads the shape with dummy weights (bfloat16, CUDA graphs on, ``enable_sleep_mode=True``) and generates
a fixed greedy batch. Then: ``sleep(level=1)`` -> memory -> ``wake_up()`` -> the batch again (it must be identical),
and ``sleep(level=2)`` -> memory -> ``wake_up()``. "Used" is the device's used memory (``cudaMemGetInfo``: every
process on the GPU) minus what it was after this process created its CUDA context and before the engine existed, so
it counts what the engine holds beyond that context (an engine-core process's own context included, if any).
Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from pagedllm.benchmarks.shapes import SHAPES, write_shape_dir

GiB = 2**30


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams

    torch.cuda.init()
    torch.empty(1, device="cuda")
    context = device_used()
    path = write_shape_dir(args.shape, tempfile.mkdtemp() + "/" + args.shape)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(64)]} for i in range(8)]

    def row(phase: str, **kw) -> None:
        print(json.dumps({"phase": phase, "shape": args.shape, **kw}), flush=True)

    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", enable_sleep_mode=True, seed=0,
              max_model_len=4096, gpu_memory_utilization=args.gpu_memory_utilization)
    row("loaded", seconds=round(time.perf_counter() - t0, 2), used_gib=round((device_used() - context) / GiB, 3),
        context_gib=round(context / GiB, 3))
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    for level in (1, 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.sleep(level=level)
        slept = time.perf_counter() - t0
        row(f"asleep level {level}", sleep_seconds=round(slept, 3),
            used_gib=round((device_used() - context) / GiB, 3))
        t0 = time.perf_counter()
        llm.wake_up()
        woke = time.perf_counter() - t0
        used = device_used() - context
        if level == 1:
            after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            row("awake after level 1", wake_seconds=round(woke, 3), used_gib=round(used / GiB, 3),
                same_outputs=after == before)
        else:  # level 2 discarded the weights: time and memory only
            row("awake after level 2", wake_seconds=round(woke, 3), used_gib=round(used / GiB, 3))
    llm.shutdown()


if __name__ == "__main__":
    main()
