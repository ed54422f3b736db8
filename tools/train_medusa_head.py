"""Train Medusa heads for a Llama-family target (the bundled demo target), sharing the target's LM head.

Each head i (``pagedllm/models/medusa.py``) reads the target's final hidden state h at position p (after the final
norm: what its LM head reads) and predicts the token at p + 2 + i through ``h + silu(W_i h + b_i)`` and the
target's LM head (vLLM's ``original_lm_head``; the checkpoint holds the blocks only). The target is frozen. The
target runs once over a fixed set of training windows, keeping its final hidden states and greedy tokens; the
heads then train on those for many passes. The loss is cross entropy to the target's greedy token at p + 1 + i
(self-distillation: a greedy draft is accepted when it equals the target's greedy token).

Data: the corpus and held-out split of ``tools/train_demo_model.py``, tokenized with the target's tokenizer. Saves
``model.safetensors`` (``blocks.*``), ``config.json``, ``train_log.json`` and a README with the measured numbers.

    python tools/train_medusa_head.py --target pagedllm/demo_model --out pagedllm/demo_model/medusa --max-minutes 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_eagle_head import _demo_trainer  # noqa: E402  (tools/ is not a package)


class Heads(nn.Module):
    """Training twin of ``MedusaHeads`` with ``original_lm_head``: one residual block a head."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(hidden, hidden)])}) for _ in range(num_heads)]
        )
        for block in self.blocks:
            nn.init.zeros_(block["layers"][0].weight)  # start as the identity: head i predicts what the LM head does
            nn.init.zeros_(block["layers"][0].bias)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        return [hidden + F.silu(block["layers"][0](hidden)) for block in self.blocks]


@torch.no_grad()
def target_features(target, windows: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """windows [N, L] -> (final hidden states [N, L, H] after the final norm, the target's greedy token at each
    position [N, L] (its prediction for the token after it))."""
    feats, greedy = [], []
    for chunk in windows.split(batch_size):
        h = target.model(input_ids=chunk).last_hidden_state
        feats.append(h)
        greedy.append(target.lm_head(h).argmax(-1))
    return torch.cat(feats), torch.cat(greedy)


def losses(lm_head: nn.Module, heads: Heads, feats: torch.Tensor, greedy: torch.Tensor):
    """feats [B, L, H], greedy [B, L]: mean cross entropy of every head against the target's greedy token, and each
    head's top-1 agreement with it."""
    total, agree = 0.0, []
    for i, out in enumerate(heads(feats)):
        shift = i + 1  # head i at p predicts the token at p + 2 + i: the target's greedy token at p + 1 + i
        logits = lm_head(out[:, :-shift]).float()
        want = greedy[:, shift:]
        total = total + F.cross_entropy(logits.flatten(0, 1), want.flatten())
        agree.append((logits.argmax(-1) == want).float().mean().item())
    return total / len(agree), agree


def main(argv: list[str] | None = None) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--max-minutes", type=float, default=5.0, help="training time after the target's pass")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--train-tokens", type=int, default=65536, help="tokens the target runs over once")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-corpus-mb", type=float, default=20.0)
    p.add_argument("--eval-tokens", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    tdm = _demo_trainer()
    t_start = time.perf_counter()
    target_config = json.loads((args.target / "config.json").read_text())
    _, train_data, heldout_data, corpus = tdm.prepare_data(
        args.max_corpus_mb, target_config["vocab_size"], False, args.target, [], 0.0
    )
    device = tdm.pick_device(args.device)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    torch.manual_seed(args.seed)
    heads = Heads(target_config["hidden_size"], args.num_heads).to(device)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    n_windows = args.train_tokens // args.seq_len
    starts = torch.randint(0, train_data.numel() - args.seq_len, (n_windows,), generator=gen)
    windows = train_data[starts[:, None] + torch.arange(args.seq_len)].to(device)
    feats, greedy = target_features(target, windows, args.batch_size)
    held = list(tdm.heldout_windows(heldout_data, args.seq_len, args.batch_size, args.eval_tokens))
    held_feats, held_greedy = target_features(target, torch.cat(held).to(device), args.batch_size)
    print(f"[{time.perf_counter() - t_start:6.0f}s] target features: {feats.shape[0] * feats.shape[1]:,} train, "
          f"{held_feats.shape[0] * held_feats.shape[1]:,} held-out tokens", flush=True)  # fmt: skip
    step, history, t0 = 0, [], time.perf_counter()
    budget = args.max_minutes * 60.0
    while (elapsed := time.perf_counter() - t0) < budget and step < args.steps:
        for group in opt.param_groups:
            group["lr"] = tdm.lr_at(max(elapsed / budget, step / args.steps), args.lr, 0.03)
        rows = torch.randint(0, feats.shape[0], (args.batch_size,), generator=gen).to(device)
        loss, agree = losses(target.lm_head, heads, feats[rows], greedy[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 200 == 0 or step == 1:
            history.append({"step": step, "loss": round(loss.item(), 4), "agree": [round(a, 3) for a in agree]})
            print(f"[{time.perf_counter() - t_start:6.0f}s] {history[-1]}", flush=True)
    train_s = time.perf_counter() - t0
    heads.eval()
    with torch.no_grad():
        _, heldout = losses(target.lm_head, heads, held_feats, held_greedy)
    heldout = [round(a, 4) for a in heldout]
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, str(target_config.get("dtype") or "float32"))
    tensors = {
        f"blocks.{i}.layers.0.{kind}": getattr(block["layers"][0], kind).detach().to("cpu", dtype).contiguous()
        for i, block in enumerate(heads.blocks)
        for kind in ("weight", "bias")
    }
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["MedusaModel"],
        "hidden_size": target_config["hidden_size"],
        "vocab_size": target_config["vocab_size"],
        "num_heads": args.num_heads,
        "num_hidden_layers": 1,
        "original_lm_head": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log = {
        "command": shlex.join(["python", "tools/train_medusa_head.py", *argv]),
        "num_params": sum(t.numel() for t in tensors.values()),
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "corpus_files": corpus.get("num_train_files"),
        "steps": step,
        "train_tokens": feats.shape[0] * feats.shape[1],
        "heldout_tokens": held_feats.shape[0] * held_feats.shape[1],
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "train_time_s": round(train_s, 1),
        "device": tdm.device_name(device),
        "torch_version": torch.__version__,
        "heldout_agreement": heldout,
        "history": history,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"held-out top-1 agreement per head: {heldout}; saved to {args.out}", flush=True)
    return log


if __name__ == "__main__":
    main()
