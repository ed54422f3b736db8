"""Embedding throughput, pagedllm against sentence-transformers on the same GPU and the same texts.

    python benchmarks/embed_bench.py --shape bge-base|qwen3-embedding-0.6b [--num-texts 20000] [--dtype bfloat16]

On a machine without a GPU, ``--shape bert-tiny --dtype float32 --skip-st --host-only`` measures pagedllm's host
work for the same texts: the model is replaced by one that returns zeros at no cost, and the pass prints its wall
time, its number of steps and the calling thread's CPU time per step and per 1,000 texts (pass
``--max-num-batched-tokens 16384`` for the step size of an H100/H200, whose default it is).

Writes a sentence-transformers checkpoint of the shape with random weights (bge-base-en-v1.5: BERT-base, CLS pooling,
normalized; Qwen3-Embedding-0.6B: Qwen3 body, last-token pooling, normalized) and a word-level tokenizer (one token
per word, so a text of n words is n tokens plus the specials). The texts have 32-256 words, uniformly. Both engines
embed all of them once after a warm-up; sentence-transformers runs at batch sizes 128 and 256 (its default, 32, was slower than both), and the
better of the two is its number. Prints one JSON line per engine (sequences/s, tokens/s) and the ratio, and checks the
two engines' embeddings agree (cosine similarity) on a sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

SHAPES = {
    "bge-base": dict(
        arch="bert",
        config=dict(
            architectures=["BertModel"],
            model_type="bert",
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
            type_vocab_size=2,
            vocab_size=30522,
            layer_norm_eps=1e-12,
            hidden_act="gelu",
            pad_token_id=0,
        ),
        pooling="cls",
    ),
    "qwen3-embedding-0.6b": dict(
        arch="qwen3",
        config=dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            max_position_embeddings=32768,
            vocab_size=151669,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            hidden_act="silu",
            bos_token_id=151643,
            eos_token_id=151643,
            pad_token_id=151643,
        ),
        pooling="lasttoken",
    ),
}
# bge-base's tokenizer and pooling over a 2-layer, 32-wide body: on a CPU the model costs little, so a pass measures
# the engine's host work (tokenizing, scheduling, input and output building) for the same texts.
SHAPES["bert-tiny"] = dict(
    SHAPES["bge-base"],
    config=dict(
        SHAPES["bge-base"]["config"], hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    ),
)


def _tokenizer(arch: str, vocab_size: int):
    """A word-level fast tokenizer over words w0..wN: BERT's [CLS] text [SEP], or Qwen3-Embedding's text + EOS with
    left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if arch == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    else:
        specials = ["<|endoftext|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if arch == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
            model_max_length=512,
        )
    eos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token=eos, eos_token=eos, padding_side="left",
        model_max_length=32768,
    )


def build_checkpoint(shape: str, root: Path) -> Path:
    """A sentence-transformers directory: the HF model at the root, 1_Pooling, 2_Normalize, modules.json."""
    from transformers import AutoConfig, AutoModel

    spec = SHAPES[shape]
    path = root / shape
    if (path / "modules.json").exists():
        return path
    cfg = dict(spec["config"])
    tokenizer = _tokenizer(spec["arch"], cfg["vocab_size"])
    if spec["arch"] == "qwen3":  # the specials sit at ids 0/1 in this tokenizer
        cfg.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # the default init's 0.02 std keeps activations tame; norms stay at 1
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": cfg["hidden_size"],
        "pooling_mode_cls_token": spec["pooling"] == "cls",
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": spec["pooling"] == "lasttoken",
        "include_prompt": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    max_len = 512 if spec["arch"] == "bert" else 32768
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def make_texts(n: int, vocab_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(rng.randint(32, 256))) for _ in range(n)
    ]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script itself


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> tuple[float, object]:
    _sync()
    t0 = time.perf_counter()
    result = fn()
    _sync()
    return time.perf_counter() - t0, result


def _release() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


class _ZeroModel(torch.nn.Module):
    """A pooling model that costs nothing: zeros for every token (``--host-only``)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: object) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size, device=input_ids.device)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled


def run_pagedllm(
    path: Path,
    texts: list[str],
    dtype: str,
    profile: bool,
    torch_profile: bool = False,
    host_only: bool = False,
    max_num_batched_tokens: int | None = None,
) -> tuple[dict, torch.Tensor]:
    from pagedllm import LLM

    with LLM(
        str(path),
        runner="pooling",
        dtype=dtype,
        max_model_len=512,
        seed=0,
        max_num_batched_tokens=max_num_batched_tokens,
    ) as llm:
        if host_only:
            runner = llm.llm_engine.engine_core.runner
            runner.model = _ZeroModel(runner.model.config.hidden_size)
        llm.embed(texts[:256], use_tqdm=False)  # warm-up
        core = llm.llm_engine.engine_core
        step, ran = core.step, []

        def counted_step():  # a step that runs a batch adds its prompt tokens to the core's stats
            before = core.stats.num_prompt_tokens
            out = step()
            ran.append(core.stats.num_prompt_tokens > before)
            return out

        core.step = counted_step
        thread_cpu = time.thread_time()
        seconds, outs = _timed(lambda: llm.embed(texts, use_tqdm=False))
        thread_cpu = time.thread_time() - thread_cpu
        core.step = step
        steps = sum(ran)
        # The calling thread's CPU time: the host work on the critical path (stepping, input and output
        # building), without the tokenizer's own threads; per step and per 1,000 texts.
        print(json.dumps({
            "pagedllm_steps": steps,
            "host_thread_cpu_s": round(thread_cpu, 3),
            "host_thread_cpu_ms_per_step": round(1e3 * thread_cpu / max(steps, 1), 2),
            "host_thread_cpu_ms_per_1000_texts": round(1e6 * thread_cpu / len(texts), 1),
        }))
        if profile:  # where the host time goes: the top functions of a second, profiled pass
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            llm.embed(texts, use_tqdm=False)
            _sync()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if torch_profile and DEVICE == "cuda":  # where the device time goes, and how much of the wall it fills
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profiler

            with torch_profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                wall, _ = _timed(lambda: llm.embed(texts, use_tqdm=False))
            events = tp.key_averages()
            device_us = sum(e.self_device_time_total for e in events)
            print(json.dumps({"profiled_wall_s": round(wall, 3), "device_busy_s": round(device_us / 1e6, 3)}))
            print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    emb = torch.tensor([o.outputs.embedding for o in outs[:64]])
    _release()
    return {"seconds": seconds, "steps": steps}, emb


def run_st(path: Path, texts: list[str], dtype: str, batch_size: int) -> tuple[dict, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device=DEVICE, model_kwargs={"dtype": getattr(torch, dtype)})
    model.encode(texts[:256], batch_size=batch_size)  # warm-up
    seconds, emb = _timed(lambda: model.encode(texts, batch_size=batch_size, convert_to_tensor=True))
    emb = emb[:64].float().cpu()
    model.to("cpu")
    _release()
    return {"seconds": seconds, "batch_size": batch_size}, emb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--num-texts", type=int, default=20000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-dir", default="/tmp/embed-bench")
    ap.add_argument("--st-batch-sizes", default="128,256")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of pagedllm's pass")
    ap.add_argument(
        "--torch-profile", action="store_true", help="also print the device time of a profiled pass, by kernel"
    )
    ap.add_argument("--skip-st", action="store_true", help="pagedllm only (no sentence-transformers rows)")
    ap.add_argument(
        "--host-only", action="store_true", help="pagedllm's host work only: a model that returns zeros (implies --skip-st)"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagedllm's token budget per step")
    args = ap.parse_args()
    args.skip_st = args.skip_st or args.host_only

    path = build_checkpoint(args.shape, Path(args.model_dir))
    vocab_words = SHAPES[args.shape]["config"]["vocab_size"] - 4
    texts = make_texts(args.num_texts, vocab_words)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    t0 = time.perf_counter()
    num_tokens = sum(len(ids) for ids in tokenizer(texts)["input_ids"])
    print(json.dumps({"tokenize_all_seconds": round(time.perf_counter() - t0, 3)}))
    ours, ours_emb = run_pagedllm(
        path, texts, args.dtype, args.profile, args.torch_profile, args.host_only, args.max_num_batched_tokens
    )
    best_st, st_emb = None, None
    if args.skip_st:
        print(json.dumps({"engine": "pagedllm", "seqs_per_s": round(len(texts) / ours["seconds"], 1)}))
        return

    def report(name: str, row: dict) -> None:  # each row as soon as it is measured (a timeout keeps the rest)
        row.update(
            engine=name,
            shape=args.shape,
            num_texts=len(texts),
            num_tokens=num_tokens,
            seqs_per_s=round(len(texts) / row["seconds"], 1),
            tokens_per_s=round(num_tokens / row["seconds"]),
        )
        print(json.dumps(row), flush=True)

    report("pagedllm", ours)
    for bs in (int(b) for b in args.st_batch_sizes.split(",")):
        row, emb = run_st(path, texts, args.dtype, bs)
        report(f"sentence-transformers bs={bs}", row)
        if best_st is None or row["seconds"] < best_st["seconds"]:
            best_st, st_emb = row, emb
    cos = torch.nn.functional.cosine_similarity(ours_emb, st_emb, dim=-1)
    print(json.dumps({
        "shape": args.shape,
        "speedup_vs_best_st": round(best_st["seconds"] / ours["seconds"], 2),
        "cosine_min_on_64": round(cos.min().item(), 5),
    }))


if __name__ == "__main__":
    main()
