"""Tensor parallelism on CPU: every tiny architecture split over 2 gloo ranks gives the one-rank logits.

Also: KV heads replicated (1 KV head, 2 ranks), a vocabulary that does not split evenly (padded, trimmed
after the gather), biases on row-parallel layers (added once), what each rank loads, and start-up errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.distributed import TPGroup
from pagedllm.model_loader import get_model
from tests.distributed import workers
from tests.distributed.launch import run_ranks
from tests.utils import TINY_ARCHS, make_tiny_model

# float32; only the order of the all-reduce's sums differs. Gemma's logits (up to ~5, after an embedding scaled by
# sqrt(hidden)) differ by up to 1.4e-5 with torch 2.13 + transformers 5.24's tiny weights.
ATOL, RTOL = 3e-5, 1e-5
VARIANTS = {  # name -> (arch, make_tiny_model options, vocab size to cut the checkpoint to or None)
    "llama-kv1": ("llama", {"num_key_value_heads": 1}, None),  # 1 KV head on both ranks
    "llama-kv1-bias-vocab399": (
        "llama",
        {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
        399,
    ),
    "qwen3-tied-vocab399": ("qwen3", {"tie_word_embeddings": True}, 399),
}
CASES = [*TINY_ARCHS, *VARIANTS]


def _cut_vocab(path: str, vocab_size: int) -> None:
    """Shrink the checkpoint's vocabulary to ``vocab_size`` rows (the tokenizer keeps its ids; none are used)."""
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config["vocab_size"] = vocab_size
    config_path.write_text(json.dumps(config))
    tensors = load_file(Path(path) / "model.safetensors")
    for name in tensors:
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensors[name] = tensors[name][:vocab_size].clone()
    save_file(tensors, Path(path) / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def case_dirs(tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = dict(tiny_model_dirs)
    for name, (arch, options, vocab_size) in VARIANTS.items():
        dirs[name] = make_tiny_model(arch, tmp_path_factory.mktemp(name), **options)
        if vocab_size is not None:
            _cut_vocab(dirs[name], vocab_size)
    return dirs


@pytest.fixture(scope="module")
def tp2_logits(case_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case's logits on each of 2 ranks (one spawn for all cases: starting ranks is the slow part)."""
    out = tmp_path_factory.mktemp("tp2_logits")
    run_ranks(workers.tp_logits, 2, {c: case_dirs[c] for c in CASES}, str(out), timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_tp2_logits_match_tp1(case: str, case_dirs: dict[str, str], tp2_logits: list[dict]) -> None:
    expected = workers.prefill_then_decode(case_dirs[case], tp=None)  # [num_tokens, vocab]
    assert expected.shape[1] == ModelConfig(model=case_dirs[case]).vocab_size
    for rank in range(2):  # every rank gets the gathered, trimmed logits
        torch.testing.assert_close(tp2_logits[rank][case], expected, atol=ATOL, rtol=RTOL)


# --- what each rank loads (built without a process group: loading needs no collectives) -------------------
def _load_rank(path: str, rank: int, size: int = 2) -> torch.nn.Module:
    model_config = ModelConfig(model=path, dtype="float32")
    return get_model(
        model_config, torch.device("cpu"), TorchAttentionBackend(), tp=TPGroup(rank=rank, size=size)
    )


def test_each_rank_loads_its_slices(case_dirs: dict[str, str]) -> None:
    path = case_dirs["llama-kv1-bias-vocab399"]  # 4 heads of 16, 1 KV head, intermediate 128, vocab 399
    ckpt = load_file(Path(path) / "model.safetensors")
    layer = "model.layers.0"
    for rank in range(2):
        model = _load_rank(path, rank)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        q, k, v = attn.qkv_proj.weight.split([32, 16, 16])
        torch.testing.assert_close(q, ckpt[f"{layer}.self_attn.q_proj.weight"][32 * rank : 32 * (rank + 1)])
        torch.testing.assert_close(k, ckpt[f"{layer}.self_attn.k_proj.weight"])  # replicated
        torch.testing.assert_close(v, ckpt[f"{layer}.self_attn.v_proj.weight"])
        q_bias = attn.qkv_proj.bias[:32]
        torch.testing.assert_close(
            q_bias, ckpt[f"{layer}.self_attn.q_proj.bias"][32 * rank : 32 * (rank + 1)]
        )
        o_cols = ckpt[f"{layer}.self_attn.o_proj.weight"][:, 32 * rank : 32 * (rank + 1)]
        torch.testing.assert_close(attn.o_proj.weight, o_cols)
        o_bias = ckpt[f"{layer}.self_attn.o_proj.bias"]
        torch.testing.assert_close(attn.o_proj.bias, o_bias if rank == 0 else torch.zeros_like(o_bias))
        gate, up = mlp.gate_up_proj.weight.split(64)
        torch.testing.assert_close(gate, ckpt[f"{layer}.mlp.gate_proj.weight"][64 * rank : 64 * (rank + 1)])
        torch.testing.assert_close(up, ckpt[f"{layer}.mlp.up_proj.weight"][64 * rank : 64 * (rank + 1)])
        torch.testing.assert_close(
            mlp.down_proj.weight, ckpt[f"{layer}.mlp.down_proj.weight"][:, 64 * rank : 64 * (rank + 1)]
        )
        # vocabulary 399 -> 400: rank 0 ids [0, 200), rank 1 ids [200, 399) + one zero padding row
        embed = model.model.embed_tokens.weight
        assert embed.shape == (200, 64)
        torch.testing.assert_close(
            embed[: 200 - rank], ckpt["model.embed_tokens.weight"][200 * rank : 200 * (rank + 1)]
        )
        assert rank == 0 or not embed[-1].any()
        torch.testing.assert_close(
            model.lm_head.weight[: 200 - rank], ckpt["lm_head.weight"][200 * rank : 200 * (rank + 1)]
        )


def test_fused_checkpoint_is_sliced(case_dirs: dict[str, str]) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank still gets its q, k, v (gate, up) rows."""
    path = case_dirs["phi3"]  # 4 heads of 16, 2 KV heads
    ckpt = load_file(Path(path) / "model.safetensors")
    fused = ckpt["model.layers.1.self_attn.qkv_proj.weight"]  # [64 + 32 + 32, 64]
    q, k, v = fused.split([64, 32, 32])
    model = _load_rank(path, 1)
    expected = torch.cat([q[32:], k[16:], v[16:]])
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight, expected)
    gate, up = ckpt["model.layers.1.mlp.gate_up_proj.weight"].split(128)
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate[64:], up[64:]]))


# --- start-up errors -------------------------------------------------------------------------------------------
def test_heads_not_divisible_fails_at_startup(tiny_llama: str) -> None:
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"
    ):
        _load_rank(tiny_llama, 0, size=3)


def test_kv_heads_not_divisible_fails_at_startup(tmp_path: Path) -> None:
    # 12 heads, 6 KV heads over 4 ranks: the heads split, the KV heads (>= 4) do not
    path = make_tiny_model(
        "llama", tmp_path / "m", hidden_size=96, num_attention_heads=12, num_key_value_heads=6
    )
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(6\) must be divisible by tensor_parallel_size \(4\)"
    ):
        _load_rank(path, 0, size=4)


