"""Train an EAGLE-1 draft head for a Llama-family target (the bundled demo target), in the published layout.

The head (``pagedllm/models/eagle.py`` runs it): ``fc(cat(embed(token at p + 1), target hidden at p))`` ->
one Llama decoder layer without its input norm -> the target's LM head, predicting the token at p + 2. The
target's "hidden at p" is its last hidden state after the final norm (what its LM head reads). The head's
output is also the next draft step's hidden input, so training regresses it onto the target's hidden at p + 1
(EAGLE's feature loss) besides matching the target's next-token distribution at p + 1 (distillation: a greedy
draft is accepted when its argmax equals the target's).

Data: the same corpus and held-out split as ``tools/train_demo_model.py`` (imported from it), tokenized with
the target's own tokenizer. Saves ``model.safetensors`` (``fc.weight``, ``layers.0.*``), ``config.json``,
``train_log.json`` and a README with the measured numbers.

    python tools/train_eagle_head.py --target pagedllm/demo_model --out pagedllm/demo_model/eagle \\
        --extra-corpus torch --max-minutes 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent


def _demo_trainer():
    """tools/train_demo_model.py as a module (tools/ is not a package)."""
    name = "train_demo_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


# ---------------------------------------------------------------- the head (training twin of EagleLlamaHead)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for Llama's default rotary (halves rotated, not interleaved)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, h: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(h, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(h, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(h, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, H]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        h = config["hidden_size"]
        head_dim = config.get("head_dim") or h // config["num_attention_heads"]
        self.self_attn = Attention(h, config["num_attention_heads"], config["num_key_value_heads"], head_dim)
        self.post_attention_layernorm = RMSNorm(h, config["rms_norm_eps"])
        self.mlp = MLP(h, config["intermediate_size"])


class EagleHead(nn.Module):
    """EAGLE-1 head; parameter names are the checkpoint's (``fc.weight``, ``layers.0.*``)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        h = config["hidden_size"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Layer(config)])
        self.head_dim = config.get("head_dim") or h // config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds: [B, T, H] of the tokens at p + 1; hidden: [B, T, H] the target's at p (positions 0..T-1).
        Returns the head's hidden [B, T, H] (its LM-head logits predict the tokens at p + 2)."""
        layer = self.layers[0]
        positions = torch.arange(embeds.shape[1], device=embeds.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        x = x + layer.self_attn(x, cos, sin)  # no input norm before attention (EAGLE-1)
        return x + layer.mlp(layer.post_attention_layernorm(x))


def head_config(target_config: dict) -> dict:
    """The head's config.json: the target's, with one layer (as the published EAGLE-1 heads ship it)."""
    config = dict(target_config)
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
    config.pop("layer_types", None)
    return config


@torch.no_grad()
def greedy_drafts(target, head: EagleHead, token_ids: list[int], k: int) -> list[int]:
    """The k greedy drafts pagedllm's EAGLE proposer makes after the target has processed ``token_ids``
    (the last one just sampled): the head over positions 0..n-2 reads the tokens 1..n-1 and the target's
    hidden 0..n-2; each further draft feeds the head the previous draft and its own last hidden. Used to
    check the engine against this training code."""
    ids = torch.tensor([token_ids])
    hidden = target.model(input_ids=ids[:, :-1]).last_hidden_state  # [1, n-1, H]
    embed = target.get_input_embeddings()
    tokens, hiddens, drafts = ids[:, 1:], hidden, []
    for _ in range(k):
        out = head(embed(tokens), hiddens)  # [1, T, H]
        last = out[:, -1:]
        draft = int(target.lm_head(last)[0, -1].argmax())
        drafts.append(draft)
        tokens = torch.cat([tokens, torch.tensor([[draft]])], dim=1)
        hiddens = torch.cat([hiddens, last], dim=1)
    return drafts


# ---------------------------------------------------------------- training


def head_losses(target, head, inputs: torch.Tensor, autocast_dtype, noise: float) -> dict[str, torch.Tensor]:
    """inputs: [B, L] tokens. The head at p (0..L-2) reads token p + 1 and the target's hidden at p.
    Returns feature (smooth L1 to the target's hidden at p + 1), distillation (cross entropy to the target's
    next-token distribution at p + 1) and top-1 agreement with the target's argmax at p + 1."""
    dev = inputs.device
    with (
        torch.no_grad(),
        torch.autocast(dev.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None),
    ):
        feats = target.model(input_ids=inputs).last_hidden_state.float()  # [B, L, H], after the final norm
        target_logits = target.lm_head(feats[:, 1:].to(target.lm_head.weight.dtype)).float()  # [B, L-1, V]
        embeds = target.get_input_embeddings()(inputs[:, 1:]).float()  # [B, L-1, H]
    hidden_in = feats[:, :-1]
    if noise > 0 and head.training:
        hidden_in = hidden_in + (torch.rand_like(hidden_in) * 2 - 1) * noise
    with torch.autocast(dev.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = head(embeds, hidden_in)  # [B, L-1, H]
        logits = target.lm_head(out.to(target.lm_head.weight.dtype)).float()  # [B, L-1, V]
    feature = F.smooth_l1_loss(out.float(), feats[:, 1:])
    distill = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return {"feature": feature, "distill": distill, "agree": agree}


@torch.no_grad()
def evaluate(
    target, head, data: torch.Tensor, seq_len: int, batch_size: int, autocast_dtype, max_tokens: int
):
    head.eval()
    sums, count = {"feature": 0.0, "distill": 0.0, "agree": 0.0}, 0
    for window in _demo_trainer().heldout_windows(data, seq_len, batch_size, max_tokens):
        losses = head_losses(target, head, window, autocast_dtype, 0.0)
        for name in sums:
            sums[name] += losses[name].item() * window.shape[0]
        count += window.shape[0]
    head.train()
    return {name: round(total / count, 4) for name, total in sums.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target model directory (HF layout)")
    p.add_argument("--out", type=Path, required=True, help="where the head is written")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, help="stop after this much training time (LR follows it)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--feature-weight", type=float, default=1.0, help="weight of the feature loss")
    p.add_argument("--distill-weight", type=float, default=0.1, help="weight of the distillation loss")
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise on the target hidden input")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-corpus-mb", type=float)
    p.add_argument("--include-tests", action="store_true")
    p.add_argument("--extra-corpus", action="append", default=[], metavar="PACKAGE")
    p.add_argument("--max-extra-mb", type=float, default=200.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--max-eval-tokens", type=int, default=131072)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tdm = _demo_trainer()
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    device = tdm.pick_device(args.device)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    t_start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    target_config = json.loads((args.target / "config.json").read_text())
    _, train_data, heldout_data, corpus = tdm.prepare_data(
        args.max_corpus_mb, target_config["vocab_size"], args.include_tests, args.target, args.extra_corpus,
        args.max_extra_mb,
    )  # fmt: skip
    say(f"corpus: {train_data.numel():,} train / {heldout_data.numel():,} held-out tokens")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    torch.manual_seed(args.seed)
    config = head_config(target_config)
    head = EagleHead(config).to(device)
    for param in head.parameters():  # Llama's initialisation
        if param.dim() == 2:
            nn.init.normal_(param, std=0.02)
    num_params = sum(p.numel() for p in head.parameters())
    say(f"head: {num_params:,} parameters; target {args.target}, device {tdm.device_name(device)}")

    opt = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
        fused=device.type == "cuda",
    )  # fmt: skip
    sampler = tdm.WindowSampler(train_data, args.batch_size, args.seq_len, args.seed, device)
    heldout_data = heldout_data.to(device)
    max_seconds = None if args.max_minutes is None else args.max_minutes * 60.0
    history, evals = [], []
    best = {"agree": -1.0, "step": 0, "state": None, "eval": None}
    eval_seconds, t0, step, stopped_by = 0.0, time.perf_counter(), 0, "steps"

    def run_eval() -> None:
        nonlocal eval_seconds
        t_eval = time.perf_counter()
        result = evaluate(
            target, head, heldout_data, args.seq_len, args.batch_size, autocast_dtype, args.max_eval_tokens
        )
        evals.append({"step": step, **result})
        if result["agree"] > best["agree"]:
            state = {k: v.detach().clone() for k, v in head.state_dict().items()}
            best.update(agree=result["agree"], step=step, state=state, eval=result)
        say(f"step {step}: held-out {result} (best agreement {best['agree']} at step {best['step']})")
        eval_seconds += time.perf_counter() - t_eval

    while step < args.steps:
        train_s = time.perf_counter() - t0 - eval_seconds
        progress = step / args.steps
        if max_seconds is not None:
            if train_s >= max_seconds:
                stopped_by = "max_minutes"
                break
            progress = max(progress, train_s / max_seconds)
        lr = tdm.lr_at(progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, _ = sampler.next()  # [B, L]
        losses = head_losses(target, head, inputs, autocast_dtype, args.noise)
        loss = args.feature_weight * losses["feature"] + args.distill_weight * losses["distill"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 1 or step % args.log_every == 0:
            row = {
                "step": step,
                "lr": float(f"{lr:.4g}"),
                **{k: round(v.item(), 4) for k, v in losses.items()},
            }
            history.append(row)
            say(f"step {step}/{args.steps} {row}")
        if step % args.eval_every == 0:
            run_eval()
    if not evals or evals[-1]["step"] != step:
        run_eval()
    train_seconds = time.perf_counter() - t0 - eval_seconds
    head.load_state_dict(best["state"])

    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, str(target_config.get("dtype") or target_config.get("torch_dtype") or "float32"))
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(
        json.dumps({**config, "dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n"
    )
    log = {
        "command": shlex.join(["python", "tools/train_eagle_head.py", *argv]),
        "target": str(args.target),
        "num_params": num_params,
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "corpus": corpus,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "feature_weight": args.feature_weight,
        "distill_weight": args.distill_weight,
        "noise": args.noise,
        "seed": args.seed,
        "steps": step,
        "stopped_by": stopped_by,
        "best_step": best["step"],
        "heldout": best["eval"],
        "train_time_s": round(train_seconds, 1),
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "device": tdm.device_name(device),
        "torch_version": torch.__version__,
        "history": history,
        "evals": evals,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (args.out / "README.md").write_text(render_readme(log))
    say(
        f"saved to {args.out}: held-out top-1 agreement with the target {best['agree']} (step {best['step']})"
    )
    return log


def render_readme(log: dict) -> str:
    ev = log["heldout"]
    curve = "\n".join(
        f"| {e['step']} | {e['agree']} | {e['distill']} | {e['feature']} |" for e in log["evals"]
    )
    extra = ", ".join(f"`{e['package']}`" for e in log["corpus"].get("extra") or []) or "none"
    return f"""# EAGLE head for the pagedllm demo model

An EAGLE-1 draft head (published layout: `fc` over `cat(embed(token), hidden)`, one Llama decoder layer without
its input norm, the target's LM head) for the model one directory up, trained by `tools/train_eagle_head.py`
with the target frozen. Use it as vLLM users do:

```python
from pagedllm import LLM
from pagedllm.demo import default_model, demo_eagle_head

llm = LLM(model=default_model(), speculative_config={{"method": "eagle", "model": demo_eagle_head(),
                                                       "num_speculative_tokens": 3}})
```

| | |
|---|---|
| parameters | {log["num_params"]:,} ({log["weights_bytes"] / 1e6:.2f} MB on disk) |
| data | the target's corpus (stdlib train files; extra packages: {extra}); held-out: the stdlib's last {log["corpus"]["num_heldout_files"]} files |
| objective | smooth L1 to the target's next hidden state (weight {log["feature_weight"]}) + cross entropy to the target's next-token distribution (weight {log["distill_weight"]}); uniform noise ±{log["noise"]} on the hidden input |
| steps | {log["steps"]} (stopped by {log["stopped_by"]}), batch {log["batch_size"]} x {log["seq_len"]}, peak LR {log["lr"]} |
| device | {log["device"]}; training {log["train_time_s"]} s, whole run {log["wall_time_s"]} s |

Held-out, saved weights (step {log["best_step"]}): the head's first draft equals the target's greedy token
**{ev["agree"]:.1%}** of the time (teacher-forced: the head reads the target's own hidden state), distillation
loss {ev["distill"]}, feature loss {ev["feature"]}.

| step | top-1 agreement | distillation | feature |
|---|---|---|---|
{curve}

Command:

```
{log["command"]}
```
"""


if __name__ == "__main__":
    main()
