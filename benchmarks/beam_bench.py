"""Beam search, pagedllm's ``LLM.beam_search`` against transformers' ``generate(num_beams=...)`` on the same GPU.

    python benchmarks/beam_bench.py [--shape qwen3-0.6b] [--beam-width 4] [--num-prompts 32] [--input-len 128]
                                    [--output-len 128] [--hf-batch 8]

Both load one checkpoint of the shape with random weights (written once under --model-dir) in bfloat16. Every prompt is
random token ids; every beam runs the full ``--output-len`` (``ignore_eos`` / ``min_new_tokens``), so both do the same
work. transformers runs the prompts in batches of ``--hf-batch`` (every prompt has the same length: no padding).
Prints one JSON line per engine (seconds, prompts/s, generated beam tokens/s) and the ratio, and how many prompts'
best sequences agree (bfloat16 can break ties differently, so this is a sanity figure, not an exactness test: the CPU
tests check exactness in float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from pagedllm.benchmarks.shapes import SHAPES, write_shape_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script itself


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_checkpoint(shape: str, root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / shape
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    write_shape_dir(shape, path)
    cfg = dict(SHAPES[shape])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model-dir", default="/tmp/beam-bench")
    args = ap.parse_args()

    path = build_checkpoint(args.shape, Path(args.model_dir))
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 10, (args.num_prompts, args.input_len), generator=gen).tolist()
    generated = args.num_prompts * args.beam_width * args.output_len
    rows = {}

    from pagedllm import LLM
    from pagedllm.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", max_model_len=args.input_len + args.output_len + 16, seed=0) as llm:
        llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], params)  # warm-up
        _sync()
        t0 = time.perf_counter()
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        _sync()
        rows["pagedllm"] = time.perf_counter() - t0
    ours_best = [o.sequences[0].tokens[args.input_len:] for o in outs]
    gc.collect()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(DEVICE).eval()
    kwargs = dict(
        num_beams=args.beam_width,
        num_return_sequences=1,
        do_sample=False,
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        early_stopping=False,
        length_penalty=1.0,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2], device=DEVICE), **kwargs)  # warm-up
        _sync()
        t0 = time.perf_counter()
        hf_best = []
        for i in range(0, len(prompts), args.hf_batch):
            batch = torch.tensor(prompts[i : i + args.hf_batch], device=DEVICE)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            hf_best += out[:, args.input_len :].tolist()
        _sync()
        rows["transformers"] = time.perf_counter() - t0

    for name, seconds in rows.items():
        print(json.dumps({
            "engine": name,
            "shape": args.shape,
            "beam_width": args.beam_width,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seconds": round(seconds, 3),
            "prompts_per_s": round(args.num_prompts / seconds, 2),
            "beam_tokens_per_s": round(generated / seconds),
        }))
    same = sum(a == b for a, b in zip(ours_best, hf_best))
    print(json.dumps({
        "speedup_vs_transformers": round(rows["transformers"] / rows["pagedllm"], 2),
        "best_sequence_equal": f"{same}/{len(prompts)}",
        "hf_batch": args.hf_batch,
    }))


if __name__ == "__main__":
    main()
