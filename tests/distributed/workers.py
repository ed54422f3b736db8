"""Per-rank functions for tests/distributed (spawned processes import them by name), plus the paged forward
they share with the single-process reference."""

from __future__ import annotations

import time

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.distributed import TPGroup, all_gather, all_reduce, local_num_kv_heads

BLOCK_SIZE = 4


# --- the model forward --------------------------------------------------------------------------------------
def prompts_for(vocab_size: int) -> list[list[int]]:
    """Two ragged prompts covering both ends of the vocabulary (so every rank's vocab slice is looked up)."""
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(3, vocab_size, (6,), generator=gen).tolist() + [vocab_size - 1, 0]
    second = torch.randint(3, vocab_size, (11,), generator=gen).tolist() + [vocab_size - 2]
    return [first, second]


def _metadata(query_lens: list[int], seq_lens: list[int], blocks_per_req: int) -> AttentionMetadata:
    """Request i owns blocks [i * blocks_per_req, (i + 1) * blocks_per_req); its new tokens are its last
    ``query_lens[i]`` positions."""
    query_start_loc = [0]
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        query_start_loc.append(query_start_loc[-1] + q)
        slots += [i * blocks_per_req * BLOCK_SIZE + pos for pos in range(s - q, s)]
    num_reqs = len(query_lens)
    block_table = torch.arange(num_reqs * blocks_per_req, dtype=torch.int32).view(num_reqs, blocks_per_req)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,  # [num_reqs, blocks_per_req]
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        is_pure_decode=all(q == 1 for q in query_lens),
    )


@torch.inference_mode()
def prefill_then_decode(model_path: str, tp: TPGroup | None) -> torch.Tensor:
    """Load ``model_path`` (float32, torch backend) as rank ``tp``, run a ragged prefill of ``prompts_for``,
    then one decode step per request. Returns the float32 logits of every token of both steps
    ``[num_prefill_tokens + num_reqs, vocab]``."""
    from pagedllm.attention.torch_ref import TorchAttentionBackend
    from pagedllm.config import ModelConfig
    from pagedllm.model_loader import get_model

    model_config = ModelConfig(model=model_path, dtype="float32")
    model = get_model(model_config, torch.device("cpu"), TorchAttentionBackend(), tp=tp)
    tp_size = 1 if tp is None else tp.size
    num_kv_heads = local_num_kv_heads(model_config.num_kv_heads, tp_size)
    blocks_per_req = 8
    prompts = prompts_for(model_config.vocab_size)
    kv_caches = [  # each [2, num_blocks, block_size, num_kv_heads / T, head_dim]
        torch.zeros(2, len(prompts) * blocks_per_req, BLOCK_SIZE, num_kv_heads, model_config.head_dim)
        for _ in range(model_config.num_layers)
    ]
    lens = [len(p) for p in prompts]
    ids = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(ids, positions, kv_caches, _metadata(lens, lens, blocks_per_req))
    prefill_logits = model.compute_logits(hidden)  # [num_tokens, vocab]
    next_ids = torch.tensor([5, model_config.vocab_size - 1])  # [num_reqs], fixed: the same on every run
    hidden = model(
        next_ids, torch.tensor(lens), kv_caches, _metadata([1, 1], [n + 1 for n in lens], blocks_per_req)
    )
    return torch.cat([prefill_logits, model.compute_logits(hidden)])


# --- rank functions (run_ranks calls fn(tp, *args)) --------------------------------------------------------
def tp_logits(tp: TPGroup, cases: dict[str, str], out_dir: str) -> None:
    """Each case's ``prefill_then_decode`` logits on this rank, saved to ``out_dir/rank{r}.pt``."""
    results = {name: prefill_then_decode(path, tp) for name, path in cases.items()}
    torch.save(results, f"{out_dir}/rank{tp.rank}.pt")


def check_collectives(tp: TPGroup) -> None:
    r, n = tp.rank, tp.size
    x = torch.full((2, 3), float(r + 1))
    torch.testing.assert_close(all_reduce(x.clone(), tp), torch.full((2, 3), float(n * (n + 1) // 2)))
    t = all_reduce(x.t(), tp)  # non-contiguous input
    torch.testing.assert_close(t, torch.full((3, 2), float(n * (n + 1) // 2)))
    y = torch.arange(6.0).view(2, 3) + 10 * r
    gathered = all_gather(y, tp, dim=-1)  # [2, 3 * n]
    expected = torch.cat([torch.arange(6.0).view(2, 3) + 10 * k for k in range(n)], dim=-1)
    torch.testing.assert_close(gathered, expected)
    torch.testing.assert_close(
        all_gather(y, tp, dim=0), expected.view(2, n, 3).transpose(0, 1).reshape(2 * n, 3)
    )


def raise_on_rank1(tp: TPGroup) -> None:
    if tp.rank == 1:
        raise RuntimeError("boom from rank 1")
    all_reduce(torch.ones(1), tp)  # rank 0 waits for a peer that never comes


def hang_on_rank1(tp: TPGroup) -> None:
    if tp.rank == 1:
        time.sleep(600)
    all_reduce(torch.ones(1), tp)
