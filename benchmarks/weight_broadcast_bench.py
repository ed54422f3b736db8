"""Weights broadcast from a trainer to the engine over NCCL (two GPUs): GB/s for a whole model shape.

    python benchmarks/weight_broadcast_bench.py [--shape llama-3.1-8b] [--repeats 2]

The engine (this process, cuda:0) loads the shape with dummy weights in bfloat16; a trainer process on cuda:1 hosts
the weight-update group (``init_weight_update_group``) and broadcasts every tensor of the shape's HF checkpoint
(names and shapes from transformers on the meta device, bfloat16 values), while the engine receives each one with
``collective_rpc("update_weight", ...)``, as vLLM's RLHF example drives it. Timed from the first tensor to the last
one written, over ``--repeats`` full passes after one warm-up pass; then the engine generates once more (the weights it
got are random, so only that it runs is checked). Prints one JSON line per pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import tempfile
import time

import torch

from pagedllm.benchmarks.shapes import SHAPES, write_shape_dir


def checkpoint_specs(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the HF checkpoint of ``shape``, in the model's order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[shape])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items() if "rotary_emb" not in name]


def trainer(port: int, specs: list[tuple[str, tuple[int, ...]]], passes: int) -> None:
    from pagedllm.distributed.weight_sync import stateless_process_group

    torch.cuda.set_device("cuda:1")
    group = stateless_process_group("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=600)
    tensors = [torch.randn(s, dtype=torch.bfloat16, device="cuda:1") * 0.02 for _, s in specs]
    for _ in range(passes):
        for t in tensors:
            group.broadcast(t, src=0)
    torch.cuda.synchronize()
    group.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")

    from pagedllm import LLM, SamplingParams

    specs = checkpoint_specs(args.shape)
    nbytes = sum(2 * torch.Size(s).numel() for _, s in specs)
    path = write_shape_dir(args.shape, tempfile.mkdtemp() + "/" + args.shape)
    llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda:0", max_model_len=4096,
              gpu_memory_utilization=0.6, seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=trainer, args=(port, specs, args.repeats + 1))
    proc.start()
    try:
        llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 2))
        for i in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for name, shape in specs:
                llm.collective_rpc("update_weight", args=(name, torch.bfloat16, shape))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            print(json.dumps({
                "pass": "warm-up" if i == 0 else i,
                "shape": args.shape,
                "tensors": len(specs),
                "gb": round(nbytes / 1e9, 3),
                "seconds": round(seconds, 3),
                "gb_per_s": round(nbytes / 1e9 / seconds, 2),
            }), flush=True)
        proc.join(600)
        llm.collective_rpc("destroy_weight_update_group")
        llm.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": list(range(10, 42))}], SamplingParams(max_tokens=8), use_tqdm=False)
        print(json.dumps({"generated_after_update": len(out[0].outputs[0].token_ids), "trainer_exit": proc.exitcode}))
    finally:
        if proc.is_alive():
            proc.kill()
        llm.shutdown()


if __name__ == "__main__":
    main()
