"""transformers' Qwen2.5-VL as the baseline of the multimodal serving row: requests/s and TTFT on the requests that
`pagedllm bench serve --dataset-name random-mm` sends.

    python benchmarks/vl_hf_bench.py [--model DIR] [--num-prompts 500] [--batch-size 16] [--input-len 64]
                                     [--output-len 64] [--image-size 1024x768] [--seed 0]

The model is ``Qwen2_5_VLForConditionalGeneration`` built from ``DIR``'s config with random weights (``from_config``,
no checkpoint read), bfloat16, SDPA attention, on CUDA (CPU: a smoke run of the script). ``DIR`` defaults to the
qwen2.5-vl-7b shape (``pagedllm.benchmarks.shapes``) written under ``--model-dir``.

Requests: ``random_mm_prompts`` with the arguments bench serve gets (same seed, same texts, same JPEG images, one
per request), each a user message through the directory's chat template with the content both servers give it
(pagedllm's layout, vLLM's with ``--chat-template-content-format string``): the image mark
``<|vision_start|><|image_pad|><|vision_end|>``, a newline, the text. The image is decoded and processed by the
directory's image processor, its ``<|image_pad|>`` expanded to the image's token count (what Qwen2.5-VL's processor
does; done here so that no video processor, hence no torchvision, is needed).

Serving: static batches of ``--batch-size`` requests in dataset order, left padded, ``generate(max_new_tokens=N,
min_new_tokens=N, do_sample=False)``: every request makes exactly ``--output-len`` tokens, like ``--ignore-eos``.

Timing, with bench serve's definitions at ``--request-rate inf``: every request arrives at t0, when the first batch
starts; batches run one after another. A batch's time covers its JPEG decoding, image processing, tokenization and
``generate``. TTFT of a request is the time from t0 to the moment its batch's first generated tokens reach the host
(a streamer's second ``put``, which follows the prefill and the first sampling step); E2E latency is t0 to the end
of its batch; TPOT is (E2E - TTFT) / (output_len - 1). requests/s = number of requests / (end of the last batch - t0).
One warm-up batch runs before t0 (not counted). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import inspect
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.benchmarks.datasets import random_mm_prompts
from pagedllm.benchmarks.shapes import write_shape_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a Qwen2-VL chat prompt


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _decode_data_url(url: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def build_requests(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, width: int, height: int, seed: int
) -> list[tuple[str, str]]:
    """``(chat-template text with one image mark, image data URL)`` per request: bench serve's random-mm requests
    (one image of ``width`` x ``height`` each) as the servers render them (image mark first, then the text)."""
    requests = random_mm_prompts(
        tokenizer, num_prompts, input_len, output_len, seed=seed, base_items_per_request=1,
        limit_mm_per_prompt={"image": 1}, bucket_config={(height, width, 1): 1.0},
    )  # fmt: skip
    out = []
    for r in requests:
        (part,) = r.mm_content
        messages = [{"role": "user", "content": IMAGE_MARK + "\n" + (r.prompt or "")}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append((text, part["image_url"]["url"]))
    return out


def prepare_batch(
    tokenizer: Any, image_processor: Any, config: Any, batch: list[tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """One left-padded batch of ``generate`` inputs: token ids with each image mark expanded to its tokens,
    attention mask, the images' patches and grids, and the image-token mask transformers 5 takes."""
    images = [_decode_data_url(url) for _, url in batch]
    pixels = image_processor(images=images, return_tensors="pt")
    merge = int(config.vision_config.spatial_merge_size)
    counts = (pixels["image_grid_thw"].prod(-1) // (merge * merge)).tolist()
    pad = int(config.image_token_id)
    rows = []
    for (text, _), count in zip(batch, counts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids.count(pad) == 1, "one image mark per request"
        at = ids.index(pad)
        rows.append(ids[:at] + [pad] * count + ids[at + 1 :])
    width = max(map(len, rows))
    fill = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[fill] * (width - len(r)) + r for r in rows])  # [batch, width]
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [batch, width]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixels["pixel_values"],  # [sum of t*h*w, C * T * P * P]
        "image_grid_thw": pixels["image_grid_thw"],  # [batch, 3]
        "mm_token_type_ids": (input_ids == pad).int() * attention_mask,  # [batch, width]
    }


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated tokens reach the host (its second ``put``: the
    first one carries the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _run_batch(
    model: Any, inputs: dict[str, torch.Tensor], output_len: int, pad_id: int
) -> tuple[float, torch.Tensor]:
    """``generate`` on one batch: (when its first tokens reached the host, the new tokens [batch, output_len])."""
    from transformers import GenerationConfig

    params = set(inspect.signature(model.forward).parameters)
    inputs = {k: v.to(DEVICE) for k, v in inputs.items() if k in params}
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    clock = _FirstTokenClock()
    gen = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None,
        pad_token_id=pad_id,
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen, streamer=clock)
    _sync()
    assert clock.first_token_at is not None
    return clock.first_token_at, out[:, inputs["input_ids"].shape[1] :]


def _percentiles(values: list[float], prefix: str) -> dict[str, float]:
    arr = np.array(values) * 1000.0
    return {f"mean_{prefix}_ms": float(arr.mean()), f"p50_{prefix}_ms": float(np.percentile(arr, 50)),
            f"p99_{prefix}_ms": float(np.percentile(arr, 99))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Qwen2.5-VL directory (config, tokenizer, image processor)")
    ap.add_argument("--model-dir", default="/tmp/vl-hf-bench", help="where the default shape is written")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    path = args.model or write_shape_dir("qwen2.5-vl-7b", Path(args.model_dir) / "qwen2.5-vl-7b")
    width, height = (int(x) for x in args.image_size.lower().split("x"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    requests = build_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, width, height, args.seed)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with torch.device(DEVICE):  # random init in place: no host copy of the weights
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    warm = requests[: args.batch_size]
    _run_batch(model, prepare_batch(tokenizer, image_processor, config, warm), args.output_len, pad_id)

    ttft, e2el = [], []
    num_prompt_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), args.batch_size):
        batch = requests[i : i + args.batch_size]
        inputs = prepare_batch(tokenizer, image_processor, config, batch)
        num_prompt_tokens += int(inputs["attention_mask"].sum())
        first_at, new = _run_batch(model, inputs, args.output_len, pad_id)
        assert new.shape[1] == args.output_len
        end = time.perf_counter()
        ttft += [first_at - t0] * len(batch)
        e2el += [end - t0] * len(batch)
    duration = time.perf_counter() - t0
    tpot = [(e - t) / max(1, args.output_len - 1) for e, t in zip(e2el, ttft)]
    result = {
        "engine": "transformers", "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "num_prompts": len(requests), "batch_size": args.batch_size, "image_size": args.image_size,
        "duration_s": duration, "request_throughput": len(requests) / duration,
        "output_throughput": len(requests) * args.output_len / duration,
        "mean_prompt_tokens": num_prompt_tokens / len(requests),
        **_percentiles(ttft, "ttft"), **_percentiles(tpot, "tpot"), **_percentiles(e2el, "e2el"),
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
