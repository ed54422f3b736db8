"""The persistent batch: per-request state the runner keeps across steps, in preallocated host arrays.

Rows are recycled: a request keeps its row from admission until it finishes or is preempted, so a step only
writes what changed (new block ids, the token sampled last step) instead of rebuilding everything.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData
from pagedllm.sampling_params import SamplingParams


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids_np = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)  # [rows, max_model_len]
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows] known tokens per row
        self.block_table_np = np.zeros(
            (max_num_reqs, max_blocks_per_req), dtype=np.int32
        )  # [rows, max_blocks]
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [rows]
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Per-row Python state, used only when building sampling metadata.
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.num_prompt_tokens: list[int] = [0] * max_num_reqs
        self.output_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.num_prompt_logprob_rows = 0  # rows whose request wants prompt logprobs (0: skip that work)
        # Generators of preempted requests, kept so that a resumed seeded request continues its random stream
        # (its output is then the same as if it had never been preempted).
        self.preempted_generators: dict[str, torch.Generator | None] = {}

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add(self, data: NewRequestData) -> int:
        if data.req_id in self.req_id_to_row:
            self.remove(data.req_id)
        row = self.free_rows.pop()
        self.req_id_to_row[data.req_id] = row
        n = len(data.token_ids)
        self.token_ids_np[row, :n] = data.token_ids
        self.num_tokens_np[row] = n
        nb = len(data.block_ids)
        self.block_table_np[row, :nb] = data.block_ids
        self.num_blocks_np[row] = nb
        params = data.sampling_params
        self.params[row] = params
        self.num_prompt_logprob_rows += params.prompt_logprobs is not None
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.output_token_ids[row] = list(data.output_token_ids)
        self.eos_token_ids[row] = data.eos_token_id
        gen = None
        if data.req_id in self.preempted_generators:
            gen = self.preempted_generators.pop(data.req_id)
        elif params.seed is not None and not params.sampling_type_greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self.generators[row] = gen
        return row

    def update(self, data: CachedRequestData) -> None:
        row = self.req_id_to_row[data.req_id]
        if data.new_block_ids:
            start = int(self.num_blocks_np[row])
            self.block_table_np[row, start : start + len(data.new_block_ids)] = data.new_block_ids
            self.num_blocks_np[row] = start + len(data.new_block_ids)

    def remove(self, req_id: str, keep_generator: bool = False) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if not keep_generator:
            self.preempted_generators.pop(req_id, None)  # finished or aborted while preempted
        if row is None:
            return
        if keep_generator:
            self.preempted_generators[req_id] = self.generators[row]
        self.num_prompt_logprob_rows -= self.params[row].prompt_logprobs is not None
        self.params[row] = None
        self.generators[row] = None
        self.output_token_ids[row] = []
        self.free_rows.append(row)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens_np[row])
        self.token_ids_np[row, n] = token_id
        self.num_tokens_np[row] = n + 1
        self.output_token_ids[row].append(token_id)

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids_np[row, : self.num_prompt_tokens[row]].tolist()
