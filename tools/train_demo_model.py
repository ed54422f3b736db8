"""Train pagedllm's bundled demo model: a small Llama trained on the Python standard library's own source.

The result is a code-completion model (``def fibonacci(n):`` continues with Python) that lets ``pagedllm``
run with no model hub. Everything it needs is on the machine already: the corpus is the ``.py`` files of
the running interpreter's standard library, the tokenizer is a byte-level BPE trained here with
``tokenizers``, the model is transformers' ``LlamaForCausalLM``.

Steps: list the corpus (sorted, test dirs left out) -> split off the last ~2% of files as held-out ->
train the tokenizer on the rest -> encode every file as ``<s> ... </s>`` into one token stream ->
train on random contiguous windows (AdamW, cosine LR with warmup, grad clip, bf16 autocast on CUDA),
evaluating the held-out stream every ``--eval-every`` steps and keeping the best weights ->
save weights, tokenizer, ``train_log.json`` and a README filled from the measured numbers.

Runs with no network. Seeded: with ``--steps`` alone (no ``--max-minutes`` stop) a CPU run repeats
exactly; a wall-clock stop depends on speed, so it does not.

    python tools/train_demo_model.py                       # demo config into pagedllm/demo_model
    python tools/train_demo_model.py --config tiny --steps 30 --out /tmp/tiny   # seconds, on CPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "pagedllm" / "demo_model"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
HELDOUT_FRACTION = 0.02
# Directory names never used for training: tests, third-party packages, and pydoc_data (one big
# string of HTML-derived documentation rather than code).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})  # kept with --include-tests: three times more code
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
MAX_FP32_WEIGHT_BYTES = 20 * 1000 * 1000  # above this, weights are saved in bfloat16 (see --save-dtype)

# System and user turns become Python comments and the reply follows as code, so `pagedllm chat`
# gives a code-completion model a prompt it can continue.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '# ' + message['role'] + ':\\n' }}"
    "{%- if message['role'] == 'assistant' %}{{- message['content'] + '\\n' }}"
    "{%- else %}{{- '# ' + (message['content'] | replace('\\n', '\\n# ')) + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '# assistant:\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TrainSpec:
    """One named size: the model's shape and the training defaults that suit it."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    log_every: int
    eval_every: int
    dropout: float


_TRAINING_FIELDS = ("steps", "batch_size", "seq_len", "lr", "log_every", "eval_every", "dropout")


SPECS = {
    # For tests: trains in seconds on a CPU.
    "tiny": TrainSpec(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=1024,
        steps=30,
        batch_size=8,
        seq_len=64,
        lr=3e-3,
        log_every=5,
        eval_every=10,
        dropout=0.0,
    ),
    # The bundled model: ~5.8M parameters, ~11.5 MB in bfloat16; sized for a few minutes on one H100.
    "demo": TrainSpec(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=1024,
        steps=6000,
        batch_size=32,
        seq_len=1024,
        lr=2e-3,
        log_every=50,
        eval_every=250,
        dropout=0.1,
    ),
    # The speculative-decoding demo target: ~16.5M parameters, ~33 MB in bfloat16, the "demo"
    # model's tokenizer (so the small model drafts for it), trained on the stdlib plus permissively
    # licensed installed packages (--extra-corpus) for a few minutes on one H100/H200.
    "target": TrainSpec(
        vocab_size=4096,
        hidden_size=384,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1280,
        max_position_embeddings=1024,
        steps=8000,
        batch_size=64,
        seq_len=1024,
        lr=1.5e-3,
        log_every=100,
        eval_every=500,
        dropout=0.0,
    ),
}

# Licenses whose code may be used as training data for a model shipped with pagedllm (matched as
# substrings of a package's License / License-Expression metadata or its license classifiers).
PERMISSIVE_LICENSES = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC")
COPYLEFT_LICENSES = ("GPL", "MPL", "EPL", "CDDL", "Proprietary", "Commercial")  # any of these: refused


# ---------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus(
    root: Path, max_bytes: int | None = None, excluded: frozenset[str] = EXCLUDED_DIRS
) -> list[Path]:
    """The stdlib's ``.py`` files in sorted relative-path order, minus EXCLUDED_DIRS.

    With ``max_bytes`` the list is cut (in the same order) before the total size passes it, keeping at
    least two files so that a held-out file remains.
    """
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if excluded.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel)
    files.sort(key=lambda p: p.as_posix())
    files = [root / rel for rel in files]
    if max_bytes is not None:
        kept, total = [], 0
        for path in files:
            size = path.stat().st_size
            if len(kept) >= 2 and total + size > max_bytes:
                break
            kept.append(path)
            total += size
        files = kept
    return files


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def split_heldout(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Last ~2% of the files (at least one) are held out from both tokenizer and model training."""
    num_heldout = max(1, round(len(files) * HELDOUT_FRACTION))
    return files[:-num_heldout], files[-num_heldout:]


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ``<s>`` (0), ``</s>`` (1), ``<pad>`` (2); encoding a text prepends ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def wrap_tokenizer(tok, model_max_length: int):
    """A transformers fast tokenizer around ``tok``, with special tokens and the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tok, texts: list[str]) -> torch.Tensor:
    """Each text as ``<s> ... </s>``, joined into one int64 stream of shape [num_tokens]."""
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts: list[torch.Tensor] = []
    for first in range(0, len(texts), 1024):  # batches: the encodings of a 100+ MB corpus at once are large
        for enc in tok.encode_batch(texts[first : first + 1024], add_special_tokens=False):
            parts.append(torch.tensor([bos_id, *enc.ids, eos_id], dtype=torch.long))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


# ---------------------------------------------------------------- model and training


def build_model_config(spec: TrainSpec, vocab_size: int, bos_id: int = 0, eos_id: int = 1, pad_id: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (the tied embedding / lm_head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first ``warmup`` of progress, then cosine down to 10% of ``peak``."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


class WindowSampler:
    """Random contiguous windows of a token stream, as inputs and next-token targets.

    Window starts come from a seeded CPU generator, so the data order is the same on every device; they
    are drawn ``chunk_steps`` steps at a time and copied once per chunk, and the stream lives on the
    training device, so no step waits on a host-to-device copy.
    """

    def __init__(
        self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int, device, chunk_steps=1024
    ):
        self.data = data.to(device)  # [num_tokens]
        self.offsets = torch.arange(seq_len + 1, device=device)  # [seq_len + 1]
        self.batch_size, self.seq_len, self.chunk_steps = batch_size, seq_len, chunk_steps
        self.gen = torch.Generator().manual_seed(seed)
        self.starts = torch.empty(0, batch_size, dtype=torch.long)  # [chunk_steps, batch_size]
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos == len(self.starts):
            high = self.data.numel() - self.seq_len - 1
            starts = torch.randint(0, high, (self.chunk_steps, self.batch_size), generator=self.gen)
            self.starts, self.pos = starts.to(self.data.device), 0
        window = self.data[self.starts[self.pos][:, None] + self.offsets]  # [batch_size, seq_len + 1]
        self.pos += 1
        return window[:, :-1], window[:, 1:]


def lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, autocast_dtype) -> torch.Tensor:
    device_type = inputs.device.type
    with torch.autocast(
        device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
    ):
        logits = model(input_ids=inputs, use_cache=False).logits  # [batch, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(
    model, data: torch.Tensor, seq_len: int, batch_size: int, autocast_dtype, max_tokens: int
) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    total, count = 0.0, 0
    for window in heldout_windows(data, seq_len, batch_size, max_tokens):
        loss = lm_loss(model, window[:, :-1], window[:, 1:], autocast_dtype)
        total += loss.item() * window.shape[0]
        count += window.shape[0]
    model.train()
    return total / count


def heldout_windows(data: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int):
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens of ``data`` (at most ``max_tokens`` tokens),
    ``batch_size`` at a time: ``[rows, seq_len + 1]`` each."""
    seq_len = min(seq_len, data.numel() - 1)
    num_windows = max(1, min((data.numel() - 1) // seq_len, max(1, max_tokens // seq_len)))
    for first in range(0, num_windows, batch_size):
        rows = range(first, min(first + batch_size, num_windows))
        idx = torch.tensor([r * seq_len for r in rows])[:, None] + torch.arange(seq_len + 1)
        yield data[idx.to(data.device)]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but torch sees no CUDA device")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--config", choices=sorted(SPECS), default="demo")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the config's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the config's)")
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the run spent warming up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, help="residual dropout while training (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--max-minutes",
        type=float,
        help="stop training after this much wall-clock time; the LR schedule then follows elapsed time "
        "or steps, whichever is further along, so it still ends decayed",
    )
    p.add_argument("--max-corpus-mb", type=float, help="use only the first N MB of the sorted corpus")
    p.add_argument("--include-tests", action="store_true", help="also train on the stdlib's test suites")
    p.add_argument(
        "--tokenizer", type=Path, help="reuse the tokenizer of this model directory (default: train one)"
    )
    p.add_argument(
        "--extra-corpus",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="also train on this installed package's .py files (repeatable; permissive licenses only)",
    )
    p.add_argument(
        "--max-extra-mb", type=float, default=200.0, help="bytes of --extra-corpus code, all packages"
    )
    p.add_argument("--log-every", type=int, help="steps between log lines (default: the config's)")
    p.add_argument(
        "--eval-every", type=int, help="steps between held-out evaluations (default: the config's)"
    )
    p.add_argument("--max-eval-tokens", type=int, default=262144, help="held-out tokens per evaluation")
    p.add_argument(
        "--save-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help=f"weights dtype on disk; auto = float32 up to {MAX_FP32_WEIGHT_BYTES / 1e6:g} MB, else bfloat16",
    )
    p.add_argument("--sample-tokens", type=int, default=64, help="new tokens per greedy sample at the end")
    args = p.parse_args(argv)
    spec = SPECS[args.config]
    for name in _TRAINING_FIELDS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(spec, name))
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len > spec.max_position_embeddings:
        p.error(f"--seq-len must be <= {spec.max_position_embeddings} (max_position_embeddings)")
    return args


def package_license(dist_name: str) -> str:
    """The license a distribution declares: License-Expression, else License, else its license classifiers."""
    from importlib.metadata import metadata

    meta = metadata(dist_name)
    declared = meta.get("License-Expression") or ""
    if not declared and len(meta.get("License") or "") < 100:  # some packages paste the whole text there
        declared = meta.get("License") or ""
    classifiers = [
        c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")
    ]
    return declared.strip() or "; ".join(classifiers)


def is_permissive(license_: str) -> bool:
    """A declared license that names a permissive license and no copyleft or proprietary one."""
    lowered = license_.lower()
    return any(w.lower() in lowered for w in PERMISSIVE_LICENSES) and not any(
        w.lower() in lowered for w in COPYLEFT_LICENSES
    )


def package_corpus(names: list[str], max_bytes: int) -> tuple[list[Path], list[dict]]:
    """The ``.py`` files of installed packages (import names), training data beside the stdlib.

    Each package must declare a permissive license (PERMISSIVE_LICENSES), else SystemExit names it. Files
    come in sorted order per package, at most ``max_bytes / len(names)`` bytes of each; test and vendored
    directories are left out (vendored code may carry other licenses).
    """
    import importlib.util
    from importlib.metadata import packages_distributions

    dists = packages_distributions()
    excluded = EXCLUDED_DIRS | {"_vendor", "vendor", "_vendored", "vendored", "third_party", "extern"}
    files: list[Path] = []
    stats = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--extra-corpus {name}: no installed package of that name")
        dist = (dists.get(name) or [name])[0]
        license_ = package_license(dist)
        if not is_permissive(license_):
            raise SystemExit(
                f"--extra-corpus {name}: license {license_!r} is not one of {PERMISSIVE_LICENSES}"
            )
        root = Path(next(iter(spec.submodule_search_locations)))
        kept = list_corpus(root, max_bytes // max(1, len(names)), excluded)
        files.extend(kept)
        from importlib.metadata import version

        stats.append(
            {"package": name, "distribution": dist, "version": version(dist), "license": license_,
             "num_files": len(kept), "num_bytes": sum(f.stat().st_size for f in kept)}
        )  # fmt: skip
    return files, stats


def load_tokenizer(path: Path):
    """A tokenizer saved by an earlier run (``tokenizer.json``), so a new model shares its token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    for special in (BOS, EOS, PAD):
        if tok.token_to_id(special) is None:
            raise SystemExit(f"--tokenizer {path}: no {special} token")
    return tok


def prepare_data(
    max_corpus_mb: float | None,
    vocab_size: int,
    include_tests: bool = False,
    tokenizer: Path | None = None,
    extra_corpus: list[str] | None = None,
    max_extra_mb: float = 200.0,
):
    """Corpus -> held-out split -> tokenizer -> token streams. Returns (tokenizer, train, held-out, stats).

    The held-out files are always the stdlib's last ones, whatever ``extra_corpus`` adds to training, so
    held-out losses compare across runs. ``tokenizer``: reuse that run's tokenizer instead of training one.
    """
    root = stdlib_root()
    excluded = EXCLUDED_DIRS - TEST_DIRS if include_tests else EXCLUDED_DIRS
    files = list_corpus(root, None if max_corpus_mb is None else int(max_corpus_mb * 1e6), excluded)
    train_files, heldout_files = split_heldout(files)
    train_texts = [read_text(f) for f in train_files]
    heldout_texts = [read_text(f) for f in heldout_files]
    raw_tok = train_tokenizer(train_texts, vocab_size) if tokenizer is None else load_tokenizer(tokenizer)
    extra_files, extra_stats = package_corpus(extra_corpus or [], int(max_extra_mb * 1e6))
    train_data = encode_documents(
        raw_tok, train_texts + [read_text(f) for f in extra_files]
    )  # [num_train_tokens]
    heldout_data = encode_documents(raw_tok, heldout_texts)  # [num_heldout_tokens]
    corpus = {
        "source": "Python standard library (.py files), PSF License Version 2",
        "python_version": platform.python_version(),
        "stdlib_root": str(root),
        "excluded_dirs": sorted(excluded),
        "num_files": len(files),
        "num_bytes": sum(f.stat().st_size for f in files),
        "num_train_files": len(train_files),
        "num_heldout_files": len(heldout_files),
        "heldout_first_file": heldout_files[0].relative_to(root).as_posix(),
        "num_train_tokens": train_data.numel(),
        "num_heldout_tokens": heldout_data.numel(),
        "vocab_size": raw_tok.get_vocab_size(),
        "tokenizer": "trained on the train files" if tokenizer is None else f"reused from {tokenizer}",
        "extra": extra_stats,
    }
    return raw_tok, train_data, heldout_data, corpus


def add_residual_dropout(model, p: float) -> None:
    """Dropout on every attention and MLP output before it joins the residual stream, in training mode
    only. Hooks, not config: the saved checkpoint stays a plain Llama."""
    if p <= 0.0:
        return

    def hook(module, inputs, output):
        if not module.training:
            return None
        if isinstance(output, tuple):  # attention returns (attn_output, attn_weights)
            return (F.dropout(output[0], p, True), *output[1:])
        return F.dropout(output, p, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def train(model, train_data, heldout_data, args, device, autocast_dtype, say) -> dict:
    """The training loop. Leaves the best held-out weights in ``model``; returns what happened.

    The clock that ``--max-minutes`` and the LR schedule read counts training steps only, not
    evaluations, so a rerun with ``--steps <steps done>`` follows nearly the same schedule.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    sampler = WindowSampler(train_data, args.batch_size, args.seq_len, args.seed, device)
    heldout_data = heldout_data.to(device)
    max_seconds = None if args.max_minutes is None else args.max_minutes * 60.0
    tokens_per_step = args.batch_size * args.seq_len
    history: list[dict] = []
    evals: list[dict] = []
    best = {"loss": math.inf, "step": 0, "state": None}
    loss_sum = torch.zeros((), device=device)
    interval_steps, interval_t0 = 0, time.perf_counter()
    eval_seconds = 0.0
    t0 = time.perf_counter()
    stopped_by = "steps"
    step, lr = 0, 0.0

    def train_seconds() -> float:
        return time.perf_counter() - t0 - eval_seconds

    def log_interval() -> None:
        nonlocal interval_steps, interval_t0
        mean_loss = loss_sum.item() / interval_steps  # syncs
        tok_s = interval_steps * tokens_per_step / max(time.perf_counter() - interval_t0, 1e-9)
        history.append(
            {"step": step, "loss": round(mean_loss, 4), "lr": float(f"{lr:.4g}"), "tokens_per_s": round(tok_s),
             "train_s": round(train_seconds(), 1)}
        )  # fmt: skip
        say(f"step {step}/{args.steps} loss {mean_loss:.4f} lr {lr:.2e} {tok_s:,.0f} tok/s")
        loss_sum.zero_()
        interval_steps, interval_t0 = 0, time.perf_counter()

    def run_eval() -> float:
        nonlocal eval_seconds, interval_t0
        if device.type == "cuda":
            torch.cuda.synchronize()  # queued training work belongs to the training clock
        t_eval = time.perf_counter()
        loss = evaluate(
            model, heldout_data, args.seq_len, args.batch_size, autocast_dtype, args.max_eval_tokens
        )
        evals.append({"step": step, "heldout_loss": round(loss, 4)})
        if loss < best["loss"]:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best.update(loss=loss, step=step, state=state)
        say(f"step {step}: held-out loss {loss:.4f} (best {best['loss']:.4f} at step {best['step']})")
        spent = time.perf_counter() - t_eval
        eval_seconds += spent
        interval_t0 += spent  # evaluation is not training throughput
        return loss

    while step < args.steps:
        progress = step / args.steps
        if max_seconds is not None:
            if train_seconds() >= max_seconds:
                stopped_by = "max_minutes"
                break
            progress = max(progress, train_seconds() / max_seconds)
        lr = lr_at(progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.next()  # [batch_size, seq_len] each
        loss = lm_loss(model, inputs, targets, autocast_dtype)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_sum += loss.detach()
        interval_steps += 1
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            log_interval()
        if step % args.eval_every == 0:
            run_eval()
    if interval_steps:
        log_interval()
    seconds = train_seconds()
    final_heldout = evals[-1]["heldout_loss"] if evals and evals[-1]["step"] == step else run_eval()
    if best["step"] != step:
        model.load_state_dict(best["state"])
        say(f"keeping the weights of step {best['step']} (lowest held-out loss)")
    return {
        "steps": step,
        "stopped_by": stopped_by,
        "first_train_loss": history[0]["loss"],
        "final_train_loss": history[-1]["loss"],
        "heldout_loss": round(best["loss"], 4),
        "best_step": best["step"],
        "final_heldout_loss": round(final_heldout, 4),
        "train_time_s": round(seconds, 1),
        "eval_time_s": round(eval_seconds, 1),
        "mean_tokens_per_s": round(step * tokens_per_step / max(seconds, 1e-9)),
        "history": history,
        "evals": evals,
    }


def save(model, raw_tok, spec: TrainSpec, out: Path, save_dtype: torch.dtype) -> int:
    """Weights (safetensors), config, generation config and tokenizer into ``out``; returns weight bytes."""
    from transformers import GenerationConfig

    bos_id, eos_id, pad_id = (raw_tok.token_to_id(t) for t in (BOS, EOS, PAD))
    model = model.to(device="cpu", dtype=save_dtype)
    model.config.dtype = save_dtype
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x writes only safetensors
    model.save_pretrained(out, **kwargs)
    wrap_tokenizer(raw_tok, spec.max_position_embeddings).save_pretrained(out, save_jinja_files=False)
    _fix_tokenizer_config(out)
    return sum(w.stat().st_size for w in out.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> dict:
    """Run the whole pipeline; return the dict written to ``train_log.json``."""
    import tokenizers
    import transformers
    from transformers import LlamaForCausalLM

    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    transformers.utils.logging.disable_progress_bar()
    spec = SPECS[args.config]
    device = pick_device(args.device)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    raw_tok, train_data, heldout_data, corpus = prepare_data(
        args.max_corpus_mb,
        spec.vocab_size,
        args.include_tests,
        args.tokenizer,
        args.extra_corpus,
        args.max_extra_mb,
    )
    say(
        f"corpus: {corpus['num_files']} files, {corpus['num_bytes'] / 1e6:.2f} MB from {corpus['stdlib_root']}; "
        f"{train_data.numel():,} train / {heldout_data.numel():,} held-out tokens, vocab {corpus['vocab_size']}"
    )
    for extra in corpus["extra"]:
        say(
            f"  + {extra['package']} {extra['version']} ({extra['license']}): {extra['num_files']} files, "
            f"{extra['num_bytes'] / 1e6:.2f} MB"
        )
    if train_data.numel() <= args.seq_len + 1:
        raise SystemExit(f"training stream ({train_data.numel()} tokens) is not longer than --seq-len")

    torch.manual_seed(args.seed)
    ids = (raw_tok.token_to_id(t) for t in (BOS, EOS, PAD))
    config = build_model_config(spec, raw_tok.get_vocab_size(), *ids)
    model = LlamaForCausalLM(config).to(device)
    model.train()
    add_residual_dropout(model, args.dropout)
    num_params = count_params(model)
    say(f"model: LlamaForCausalLM, {num_params:,} parameters, device {device_name(device)}")

    result = train(model, train_data, heldout_data, args, device, autocast_dtype, say)

    if args.save_dtype == "auto":
        save_dtype = torch.float32 if num_params * 4 <= MAX_FP32_WEIGHT_BYTES else torch.bfloat16
    else:
        save_dtype = getattr(torch, args.save_dtype)
    weights_bytes = save(model, raw_tok, spec, out, save_dtype)
    samples = greedy_samples(out, SAMPLE_PROMPTS, args.sample_tokens)
    for prompt, text in samples.items():
        say(f"sample {prompt!r} ->\n{prompt}{text}\n" + "-" * 60)

    shape = {k: v for k, v in asdict(spec).items() if k not in _TRAINING_FIELDS}
    log = {
        "command": shlex.join(["python", "tools/train_demo_model.py", *argv]),
        "argv": argv,
        "config": args.config,
        "seed": args.seed,
        "model": {
            "architecture": "LlamaForCausalLM",
            "num_params": num_params,
            **shape,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": True,
        },  # fmt: skip
        "save_dtype": str(save_dtype).removeprefix("torch."),
        "weights_bytes": weights_bytes,
        "corpus": corpus,
        "planned_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_seen": result["steps"] * args.batch_size * args.seq_len,
        "epochs": round(result["steps"] * args.batch_size * args.seq_len / train_data.numel(), 2),
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "dropout": args.dropout,
        **result,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "device": device_name(device),
        "autocast": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else "none (float32)",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "samples": samples,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (out / "README.md").write_text(render_readme(log))
    say(
        f"saved to {out}: {weights_bytes / 1e6:.2f} MB weights ({log['save_dtype']}), train loss "
        f"{log['final_train_loss']}, held-out loss {log['heldout_loss']} (step {log['best_step']})"
    )
    return log


def _fix_tokenizer_config(out: Path) -> None:
    """Name the portable tokenizer class so transformers 4.x loads it too, and keep the chat template
    inside tokenizer_config.json (loaders that read only that file find it)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.setdefault("add_bos_token", True)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


@torch.no_grad()
def greedy_samples(model_dir: Path, prompts, max_new_tokens: int) -> dict[str, str]:
    """Greedy continuations from the saved model, loaded back in float32 on CPU with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = {}
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        samples[prompt] = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return samples


def render_readme(log: dict) -> str:
    m, c = log["model"], log["corpus"]
    curve = "\n".join(f"| {e['step']} | {e['heldout_loss']} |" for e in log["evals"])
    samples = "\n\n".join(f"````python\n{p}{t}\n````" for p, t in log["samples"].items())
    extra = c.get("extra") or []
    extra_rows = "\n".join(
        f"| `{e['package']}` | {e['distribution']} {e['version']} | {e['license']} | {e['num_files']} | "
        f"{e['num_bytes'] / 1e6:.2f} MB |"
        for e in extra
    )
    extra_data = (
        f"""

Training also reads the `.py` files of these installed packages (sorted, tests and vendored directories left
out); the held-out files are the stdlib's alone, as above:

| package | distribution | license | files | size |
|---|---|---|---|---|
{extra_rows}"""
        if extra
        else ""
    )
    extra_license = (
        " It was also trained on the packages listed under Data, each under the license named there; treat the"
        " weights and outputs as derived from that code too."
        if extra
        else ""
    )
    tokenizer_note = f" Tokenizer: {c['tokenizer']}." if c.get("tokenizer") else ""
    speculation = (
        """

## Speculative decoding

This model reuses the tokenizer of the earlier, smaller demo model, which ships beside it as `draft/` and drafts
for it; `eagle/` holds an EAGLE-1 head trained for it by `tools/train_eagle_head.py` (see its README).

```python
from pagedllm.demo import default_model, demo_draft_model, demo_eagle_head

llm = LLM(model=default_model(), speculative_config={"model": demo_draft_model(), "num_speculative_tokens": 4})
llm = LLM(model=default_model(), speculative_config={"method": "eagle", "model": demo_eagle_head(),
                                                       "num_speculative_tokens": 3})
```

Acceptance lengths and speeds measured on the GPU are in `docs/benchmarks.md`."""
        if str(c.get("tokenizer", "")).startswith("reused")
        else ""
    )
    return f"""# pagedllm demo model

A small code-completion model bundled with pagedllm so that it runs with no model hub. It is a
`LlamaForCausalLM` with its own byte-level BPE tokenizer, trained from scratch on Python source code (the
standard library{" and the packages listed under Data" if extra else ""}) by `tools/train_demo_model.py`. It continues Python code (`def fibonacci(n):`);
it is not an assistant and knows nothing but Python code. Every number below was
measured by the training run and written by the script.

## Use

```python
from pagedllm import LLM, SamplingParams
from pagedllm.demo import default_model

llm = LLM(model=default_model(), dtype="float32")
print(llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=64, temperature=0))[0].outputs[0].text)
```

The chat template turns system and user turns into Python comments and opens the reply with
`# assistant:`, so chat requests get code back.{speculation}

## Model

| | |
|---|---|
| parameters | {m["num_params"]:,} (embedding tied to the LM head) |
| layers / hidden / MLP | {m["num_hidden_layers"]} / {m["hidden_size"]} / {m["intermediate_size"]} |
| attention heads / KV heads / head dim | {m["num_attention_heads"]} / {m["num_key_value_heads"]} / {m["head_dim"]} |
| vocabulary | {m["vocab_size"]} (byte-level BPE; `<s>` = 0, `</s>` = 1, `<pad>` = 2) |
| max positions | {m["max_position_embeddings"]} |
| weights on disk | {log["weights_bytes"] / 1e6:.2f} MB, {log["save_dtype"]} safetensors |

## Data

The {c["num_files"]} `.py` files ({c["num_bytes"] / 1e6:.2f} MB) of the Python {c["python_version"]} standard
library, in sorted path order, leaving out directories named {", ".join(f"`{d}`" for d in c["excluded_dirs"])}.
The last {c["num_heldout_files"]} file{"s" if c["num_heldout_files"] != 1 else ""} (from `{c["heldout_first_file"]}` on) are held out from both the
tokenizer and the model: {c["num_heldout_tokens"]:,} tokens, against {c["num_train_tokens"]:,} for training.
Each file is one document, `<s> ... </s>`; training takes random contiguous windows of the joined stream.{tokenizer_note}{extra_data}

## Training

| | |
|---|---|
| device | {log["device"]}, autocast {log["autocast"]} |
| steps | {log["steps"]} of {log["planned_steps"]} planned (stopped by {log["stopped_by"]}) |
| batch | {log["batch_size"]} x {log["seq_len"]} tokens; {log["tokens_seen"]:,} tokens seen ({log["epochs"]} epochs) |
| optimizer | AdamW (0.9, 0.95), peak LR {log["lr"]}, warmup {log["warmup"]} of the run, cosine to 10%, weight decay {log["weight_decay"]}, grad clip 1.0 |
| regularization | residual dropout {log["dropout"]} (training only) |
| seed | {log["seed"]} |
| training time | {log["train_time_s"]} s ({log["mean_tokens_per_s"]:,} tokens/s), plus {log["eval_time_s"]} s of held-out evaluation; whole run {log["wall_time_s"]} s |
| software | torch {log["torch_version"]}, transformers {log["transformers_version"]}, tokenizers {log["tokenizers_version"]} |

| | loss (nats/token) |
|---|---|
| train, first step | {log["first_train_loss"]} |
| train, last logged steps | {log["final_train_loss"]} |
| held-out, saved weights (step {log["best_step"]}) | {log["heldout_loss"]} |
| held-out, last step | {log["final_heldout_loss"]} |

The saved weights are those of the evaluation with the lowest held-out loss (early stopping), so the
held-out loss of the saved weights is also the number they were chosen by; there is no separate test split.

| step | held-out loss |
|---|---|
{curve}

Command:

```
{log["command"]}
```

`train_log.json` beside this file holds the whole record (loss curve included).

## Greedy samples

{samples}

## License

The training data is the Python standard library, Copyright (c) Python Software Foundation, distributed
under the PSF License Agreement (Python Software Foundation License Version 2). The model can reproduce
fragments of that code, so treat its weights and outputs as derived from PSF-licensed material.{extra_license}
"""


if __name__ == "__main__":
    main()
