"""Benchmark prompts shared by `pagedllm bench serve | throughput | latency`, built as vLLM's datasets are.

- random (``random_token_prompts``): every request draws its input and output lengths uniformly from
  ``[floor(len * (1 - range_ratio)), ceil(len * (1 + range_ratio))]``; its prompt is an optional prefix of
  ``prefix_len`` random token ids shared by all requests, then a run of consecutive token ids starting at a random
  offset (``(offset + i + j) % vocab``), so prompts differ from each other and share no more than that prefix.
  Token ids are drawn from the non-special part of the vocabulary when a tokenizer is given.
- prefix_repetition (``prefix_repetition_prompts``): ``num_prefixes`` random prefixes, each followed by
  ``num_prompts // num_prefixes`` different random suffixes, shuffled.
- sonnet (``sonnet_prompts``): "Pick as many lines as you can from these poem lines:" + the first lines of the
  poem (the shared prefix) + random lines, through the chat template.
- sharegpt (``sharegpt_prompts``): the first human turn of each conversation, its reply's length as the output
  length; pairs too short or too long are dropped.
- custom (``custom_prompts``): JSONL of ``{"prompt": ..., "output_tokens": ...}``.

- random-mm (``random_mm_prompts``): random prompts, each with images of random pixels as ``image_url`` chat parts
  (chat endpoint only), their count and sizes drawn as vLLM's flags say.

Token-id datasets (random, prefix_repetition) carry ``prompt_token_ids`` of exactly ``prompt_len`` tokens; text
datasets (sonnet, sharegpt, custom) carry ``prompt`` text only and ``prompt_len`` counts its tokens as the
tokenizer encodes it (special tokens included, as vLLM counts them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SONNET_PATH = Path(__file__).resolve().parent / "data" / "sonnet.txt"
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


@dataclass
class SampleRequest:
    """One benchmark request: the prompt as token ids (exact length) or text, and how many tokens to ask for."""

    prompt_token_ids: list[int] | None
    prompt_len: int
    expected_output_len: int
    prompt: str | None = None  # the text: a text dataset's prompt, or a token-id prompt decoded on request
    mm_content: list[dict[str, Any]] | None = None  # chat content parts after the text (images), random-mm


def _length_range(length: int, range_ratio: float, name: str) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"{name} must be >= 1, got {length}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def _usable_token_ids(tokenizer_or_vocab: Any) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocabulary for an int, non-special ids for a tokenizer."""
    if isinstance(tokenizer_or_vocab, (int, np.integer)):
        if tokenizer_or_vocab < 1:
            raise ValueError(f"vocab size must be >= 1, got {tokenizer_or_vocab}")
        return np.arange(int(tokenizer_or_vocab))
    tok = tokenizer_or_vocab
    vocab_size = len(tok)
    special = {int(t) for t in (getattr(tok, "all_special_ids", None) or []) if t is not None}
    ids = np.array([i for i in range(vocab_size) if i not in special])
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    return ids


def _decode(tokenizer_or_vocab: Any, token_ids: list[int]) -> str:
    if isinstance(tokenizer_or_vocab, (int, np.integer)):
        raise ValueError("decode=True needs a tokenizer, not a vocabulary size")
    return tokenizer_or_vocab.decode(token_ids)


def random_token_prompts(
    tokenizer_or_vocab: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    decode: bool = False,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` random prompts (vLLM's random dataset semantics, see the module docstring).

    ``tokenizer_or_vocab`` is a HF tokenizer or a vocabulary size. Each prompt is ``prefix_len`` shared tokens plus
    its sampled input length. With ``decode=True`` (needs a tokenizer) each request also carries its prompt as
    text; re-tokenizing that text may give a slightly different length.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    usable = _usable_token_ids(tokenizer_or_vocab)
    rng = np.random.default_rng(seed)
    in_low, in_high = _length_range(input_len, range_ratio, "input_len")
    out_low, out_high = _length_range(output_len, range_ratio, "output_len")
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, usable.size, size=num_prompts)
    prefix = usable[rng.integers(0, usable.size, size=prefix_len)].tolist() if prefix_len else []
    requests = []
    for i in range(num_prompts):
        positions = (offsets[i] + i + np.arange(input_lens[i])) % usable.size
        token_ids = prefix + usable[positions].tolist()
        requests.append(
            SampleRequest(
                prompt_token_ids=token_ids,
                prompt_len=len(token_ids),
                expected_output_len=int(output_lens[i]),
                prompt=_decode(tokenizer_or_vocab, token_ids) if decode else None,
            )
        )
    return requests


def parse_bucket_config(value: str | dict) -> dict[tuple[int, int, int], float]:
    """vLLM's ``--random-mm-bucket-config``: ``{(height, width, frames): probability}`` as a Python literal (frames
    1 = an image; more = a video, which pagedllm does not take: such a bucket must have probability 0). The
    probabilities are normalized; ``ValueError`` naming the flag when the value is not such a dict."""
    import ast

    flag = "--random-mm-bucket-config"
    try:
        buckets = ast.literal_eval(value) if isinstance(value, str) else value
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"{flag}: not a dict literal like {{(256, 256, 1): 1.0}}: {e}") from e
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"{flag}: a non-empty dict {{(height, width, frames): probability}}, got {value!r}")
    out: dict[tuple[int, int, int], float] = {}
    for key, prob in buckets.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) and k > 0 for k in key)):
            raise ValueError(f"{flag}: keys are (height, width, frames) of positive ints, got {key!r}")
        if not isinstance(prob, (int, float)) or prob < 0:
            raise ValueError(f"{flag}: probabilities are numbers >= 0, got {prob!r} for {key}")
        if key[2] != 1 and prob > 0:
            raise ValueError(f"{flag}: {key} is a video bucket; only images (frames 1) are supported")
        if prob > 0:
            out[key] = float(prob)
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"{flag}: every probability is 0")
    return {k: p / total for k, p in out.items()}


def _random_image_url(rng: np.random.Generator, height: int, width: int) -> str:
    """A data URL of a JPEG of random pixels (vLLM's random-mm images are random pixels too)."""
    import base64
    import io

    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def random_mm_prompts(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    base_items_per_request: int = 1,
    num_mm_items_range_ratio: float = 0.0,
    limit_mm_per_prompt: dict[str, int] | None = None,
    bucket_config: dict[tuple[int, int, int], float] | None = None,
    num_unique_images: int | None = None,
) -> list[SampleRequest]:
    """vLLM's random-mm dataset: random text prompts (as ``random_token_prompts``, decoded) each followed by
    ``base_items_per_request`` images (± ``num_mm_items_range_ratio``, at most the limit), of sizes drawn from
    ``bucket_config``, as ``image_url`` chat parts holding JPEG data URLs. ``num_unique_images`` (pagedllm's
    addition): draw the images from a pool of that many, so requests repeat images (an encoder cache's workload);
    None: every image is new."""
    limit = (limit_mm_per_prompt or {"image": 255}).get("image", 255)
    if base_items_per_request < 0:
        raise ValueError(f"--random-mm-base-items-per-request must be >= 0, got {base_items_per_request}")
    if not 0.0 <= num_mm_items_range_ratio <= 1.0:
        raise ValueError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {num_mm_items_range_ratio}")
    if num_unique_images is not None and num_unique_images < 1:
        raise ValueError(f"--random-mm-num-unique-images must be >= 1, got {num_unique_images}")
    buckets = bucket_config or {(256, 256, 1): 0.5, (720, 1280, 1): 0.5}
    requests = random_token_prompts(tokenizer, num_prompts, input_len, output_len, range_ratio, seed, decode=True)
    rng = np.random.default_rng(seed + 1)
    sizes = list(buckets)
    probs = np.array([buckets[k] for k in sizes])
    lo = math.floor(base_items_per_request * (1 - num_mm_items_range_ratio))
    hi = math.ceil(base_items_per_request * (1 + num_mm_items_range_ratio))
    pool: list[str] = []
    if num_unique_images is not None:
        for _ in range(num_unique_images):
            h, w, _ = sizes[rng.choice(len(sizes), p=probs)]
            pool.append(_random_image_url(rng, h, w))
    for request in requests:
        n = min(int(rng.integers(lo, hi + 1)), limit)
        urls = []
        for _ in range(n):
            if pool:
                urls.append(pool[int(rng.integers(len(pool)))])
            else:
                h, w, _ = sizes[rng.choice(len(sizes), p=probs)]
                urls.append(_random_image_url(rng, h, w))
        request.mm_content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return requests


def prefix_repetition_prompts(
    tokenizer_or_vocab: Any,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    *,
    decode: bool = False,
    shuffle: bool = True,
) -> list[SampleRequest]:
    """vLLM's prefix_repetition dataset: ``num_prefixes`` random prefixes of ``prefix_len`` tokens, each shared by
    ``num_prompts // num_prefixes`` prompts that end in their own ``suffix_len`` random tokens.

    Gives ``num_prefixes * (num_prompts // num_prefixes)`` requests (vLLM drops the remainder), shuffled unless
    ``shuffle=False`` (then grouped by prefix, in order)."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    per_prefix = num_prompts // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"num_prompts ({num_prompts}) must be >= num_prefixes ({num_prefixes})")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError(f"prefix_len ({prefix_len}) and suffix_len ({suffix_len}) must be >= 0, sum >= 1")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    usable = _usable_token_ids(tokenizer_or_vocab)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix = usable[rng.integers(0, usable.size, size=prefix_len)].tolist()
        for _ in range(per_prefix):
            token_ids = prefix + usable[rng.integers(0, usable.size, size=suffix_len)].tolist()
            requests.append(
                SampleRequest(
                    prompt_token_ids=token_ids,
                    prompt_len=len(token_ids),
                    expected_output_len=output_len,
                    prompt=_decode(tokenizer_or_vocab, token_ids) if decode else None,
                )
            )
    if shuffle:
        order = rng.permutation(len(requests))
        requests = [requests[i] for i in order]
    return requests


# ---------------------------------------------------------------------------------------------- text datasets


def _num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _as_chat(tokenizer: Any, text: str) -> str:
    """``text`` as one user message through the tokenizer's chat template (unchanged without a template)."""
    if not _has_chat_template(tokenizer):
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _oversample(
    requests: list[SampleRequest], num_prompts: int, rng: np.random.Generator
) -> list[SampleRequest]:
    """vLLM's oversampling: repeat randomly chosen requests until there are ``num_prompts``."""
    if not requests:
        raise ValueError("the dataset has no usable requests")
    extra = [
        requests[int(i)] for i in rng.integers(0, len(requests), size=max(0, num_prompts - len(requests)))
    ]
    return requests + extra


def sonnet_prompts(
    tokenizer: Any,
    num_prompts: int,
    input_len: int = 550,
    output_len: int = 150,
    prefix_len: int = 200,
    seed: int = 0,
    *,
    path: str | Path | None = None,
    return_formatted: bool = True,
) -> list[SampleRequest]:
    """vLLM's sonnet dataset over the lines of ``path`` (default: the bundled Shakespeare sonnets).

    Every prompt is ``SONNET_BASE_PROMPT`` + the file's first ``round((prefix_len - base) / avg_line)`` lines (shared
    by all prompts) + random lines up to ``round((input_len - base) / avg_line)`` lines in all, where ``base`` is the
    token count of the base prompt through the chat template and ``avg_line`` a line's mean token count. Prompts
    longer than ``input_len`` tokens (through the template) are drawn again. ``prompt_len`` counts the prompt
    through the chat template; ``return_formatted=False`` returns the raw text instead (for a chat endpoint, which
    applies the template itself). A tokenizer without a chat template uses the plain text throughout.
    """
    lines = Path(path or SONNET_PATH).read_text(encoding="utf-8").splitlines(keepends=True)
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise ValueError(f"no poem lines in {path or SONNET_PATH}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    avg_len = sum(_num_tokens(tokenizer, line) for line in lines) / len(lines)
    base_offset = _num_tokens(tokenizer, _as_chat(tokenizer, SONNET_BASE_PROMPT))
    if input_len <= base_offset:
        raise ValueError(
            f"input_len ({input_len}) must exceed the base prompt's length ({base_offset} tokens)"
        )
    num_input_lines = round((input_len - base_offset) / avg_len)
    num_prefix_lines = max(round((prefix_len - base_offset) / avg_len), 0)
    if num_prefix_lines > num_input_lines:
        raise ValueError(f"prefix_len ({prefix_len}) must not exceed input_len ({input_len})")
    prefix = "".join(lines[:num_prefix_lines])
    rng = np.random.default_rng(seed)
    requests: list[SampleRequest] = []
    max_attempts = 100 * num_prompts
    for _ in range(max_attempts):
        if len(requests) == num_prompts:
            break
        picks = rng.integers(0, len(lines), size=num_input_lines - num_prefix_lines)
        prompt = SONNET_BASE_PROMPT + prefix + "".join(lines[int(i)] for i in picks)
        formatted = _as_chat(tokenizer, prompt)
        prompt_len = _num_tokens(tokenizer, formatted)
        if prompt_len <= input_len:
            text = formatted if return_formatted else prompt
            requests.append(SampleRequest(None, prompt_len, output_len, prompt=text))
    if len(requests) < num_prompts:
        raise ValueError(
            f"could not draw sonnet prompts of at most {input_len} tokens; raise --sonnet-input-len"
        )
    return requests


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    skip_min_output_len_check: bool = False,
) -> bool:
    """vLLM's ShareGPT filter: prompt and output at least ``min_len`` tokens (the output's check skipped when the
    output length is fixed), prompt at most ``max_prompt_len``, prompt + output at most ``max_total_len``."""
    if prompt_len < min_len or (not skip_min_output_len_check and output_len < min_len):
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


_HUMAN_ROLES = ("human", "user")
_REPLY_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


def _first_exchange(conversation: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The first human turn of a ShareGPT conversation and the reply that follows it, or None."""
    for i, turn in enumerate(conversation[:-1]):
        if turn.get("from") in _HUMAN_ROLES and conversation[i + 1].get("from") in _REPLY_ROLES:
            return str(turn.get("value", "")), str(conversation[i + 1].get("value", ""))
    return None


def sharegpt_prompts(
    tokenizer: Any,
    path: str | Path,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    *,
    shuffle: bool = True,
    oversample: bool = True,
) -> list[SampleRequest]:
    """vLLM's ShareGPT dataset from a JSON list of ``{"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}``: conversations with fewer than two turns are dropped, the rest shuffled
    (seeded); each request is the first human turn, asking for as many tokens as its reply has (or
    ``output_len``), kept when ``is_valid_sequence`` accepts it. Too few are oversampled unless
    ``oversample=False``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    rng = np.random.default_rng(seed)
    if shuffle:
        entries = [entries[i] for i in rng.permutation(len(entries))]
    requests: list[SampleRequest] = []
    for entry in entries:
        if len(requests) >= num_prompts:
            break
        exchange = _first_exchange(entry["conversations"])
        if exchange is None:
            continue
        prompt, completion = exchange
        prompt_len = _num_tokens(tokenizer, prompt)
        new_output_len = _num_tokens(tokenizer, completion) if output_len is None else output_len
        if not is_valid_sequence(
            prompt_len, new_output_len, skip_min_output_len_check=output_len is not None
        ):
            continue
        requests.append(SampleRequest(None, prompt_len, new_output_len, prompt=prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation passed the length filter")
    return _oversample(requests, num_prompts, rng) if oversample else requests


def write_sharegpt_file(path: str | Path, exchanges: list[tuple[str, str]]) -> Path:
    """Write ``(human, gpt)`` pairs as a ShareGPT-format JSON file (for tests and quick local runs)."""
    data = [
        {
            "id": f"conv-{i}",
            "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}],
        }
        for i, (human, gpt) in enumerate(exchanges)
    ]
    path = Path(path)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return path


def custom_prompts(
    tokenizer: Any,
    path: str | Path,
    num_prompts: int,
    output_len: int = 256,
    seed: int = 0,
    *,
    apply_chat_template: bool = True,
    shuffle: bool = True,
    oversample: bool = True,
) -> list[SampleRequest]:
    """vLLM's custom dataset: a ``.jsonl`` file with one ``{"prompt": ...}`` object a line, optionally with
    ``"output_tokens"`` (that request's output length; ``output_len`` otherwise). Lines are shuffled (seeded)
    unless ``shuffle=False``; each prompt goes through the chat template when ``apply_chat_template`` and the
    tokenizer has one. ``num_prompts`` <= 0 takes every line."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: the custom dataset reads a .jsonl file")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{n}: each line must be an object with a string 'prompt'")
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    rng = np.random.default_rng(seed)
    if shuffle:
        items = [items[i] for i in rng.permutation(len(items))]
    if num_prompts <= 0:
        num_prompts = len(items)
    requests = []
    for item in items[:num_prompts]:
        prompt = _as_chat(tokenizer, item["prompt"]) if apply_chat_template else item["prompt"]
        item_output_len = int(item.get("output_tokens") or output_len)
        requests.append(SampleRequest(None, _num_tokens(tokenizer, prompt), item_output_len, prompt=prompt))
    return _oversample(requests, num_prompts, rng) if oversample else requests


# ShareGPT-shaped lengths: log-normal prompt and reply lengths (median, sigma) close to ShareGPT V3's after vLLM's
# filter (is_valid_sequence) with a Llama-3 tokenizer: means of about 200 prompt and 250 reply tokens, long tails.
SHAREGPT_PROMPT_LENGTHS = (130.0, 1.15)
SHAREGPT_REPLY_LENGTHS = (150.0, 1.0)


def sharegpt_like_exchanges(tokenizer: Any, num: int, seed: int = 0) -> list[tuple[str, str]]:
    """``num`` (human, gpt) text pairs of random tokens whose lengths follow ShareGPT's (the two log-normals above,
    drawn until ``is_valid_sequence`` accepts them), for a ShareGPT-shaped benchmark where the real file cannot be
    fetched. Lengths are in ``tokenizer``'s tokens before decoding; re-encoding the text may move them slightly."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    ids = _usable_token_ids(tokenizer)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < num:
        prompt_len = int(
            round(rng.lognormal(math.log(SHAREGPT_PROMPT_LENGTHS[0]), SHAREGPT_PROMPT_LENGTHS[1]))
        )
        reply_len = int(round(rng.lognormal(math.log(SHAREGPT_REPLY_LENGTHS[0]), SHAREGPT_REPLY_LENGTHS[1])))
        if not is_valid_sequence(prompt_len, reply_len):
            continue
        texts = (tokenizer.decode(rng.choice(ids, n).tolist()) for n in (prompt_len, reply_len))
        pairs.append((next(texts), next(texts)))
    return pairs


def main(argv: list[str] | None = None) -> None:
    """``python -m pagedllm.benchmarks.datasets sharegpt-file OUT.json --tokenizer DIR [--num N] [--seed S]``:
    write a ShareGPT-shaped file (``sharegpt_like_exchanges``) for ``--dataset-name sharegpt``."""
    import argparse

    from pagedllm.tokenizer import get_tokenizer

    parser = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.datasets")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "sharegpt-file", help="write a ShareGPT-shaped JSON file of random-token conversations"
    )
    gen.add_argument("path")
    gen.add_argument("--tokenizer", required=True)
    gen.add_argument("--num", type=int, default=1000)
    gen.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pairs = sharegpt_like_exchanges(get_tokenizer(args.tokenizer), args.num, args.seed)
    write_sharegpt_file(args.path, pairs)
    print(f"wrote {len(pairs)} conversations to {args.path}")


if __name__ == "__main__":
    main()
