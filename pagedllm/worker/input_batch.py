"""The persistent batch: per-request state the runner keeps across steps, in preallocated host arrays.

Rows are recycled: a request keeps its row from admission until it finishes or is preempted, so a step only
writes what changed (new block ids, the token sampled last step) instead of rebuilding everything. Sampling
settings live in per-row arrays too, so a step gathers them with one fancy index instead of a loop over requests.

Async scheduling: a row's last token may be a placeholder (its value 0 here) for a token sampled by the step still
in flight. ``pending_idx[row]`` says which entry of that step's sampled-ids tensor (on the device) holds it; the
runner scatters it into the next step's input on the device, and ``resolve`` writes the real id here later.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def needs_history(params: SamplingParams) -> bool:
    """Whether sampling this request reads its generated tokens on the host (penalties, bad words, min_tokens)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params._bad_words_token_ids)
        or params.min_tokens > 0
    )


def is_plain(params: SamplingParams) -> bool:
    """Whether the per-row arrays describe this request's sampling fully (no masks, biases or history)."""
    return not needs_history(params) and not params.logit_bias and params.allowed_token_ids is None


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        """``num_kv_groups``: block tables per row, one per KV cache group (core/kv_cache_manager.py)."""
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids_np = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)  # [rows, max_model_len]
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows] tokens, placeholders included
        self.num_prompt_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows]
        self.block_table_np = np.zeros(
            (num_kv_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32
        )  # [groups, rows, max_blocks]
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)  # [rows] (the same in every group)
        self.pending_idx = np.full(
            max_num_reqs, -1, dtype=np.int64
        )  # [rows] index into in-flight sampled ids
        self.pending_step = np.full(
            max_num_reqs, -1, dtype=np.int64
        )  # [rows] step that sampled the placeholder
        self.row_gen = np.zeros(max_num_reqs, dtype=np.int64)  # [rows] bumped when a row changes owner
        # Per-row sampling settings (greedy rows hold the "disabled" values).
        self.greedy_np = np.zeros(max_num_reqs, dtype=bool)  # [rows]
        self.temperature_np = np.ones(max_num_reqs, dtype=np.float32)  # [rows]
        self.top_k_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows] 0 = disabled
        self.top_p_np = np.ones(max_num_reqs, dtype=np.float32)  # [rows]
        self.min_p_np = np.zeros(max_num_reqs, dtype=np.float32)  # [rows]
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)  # [rows] -1 = no logprobs
        self.has_generator_np = np.zeros(max_num_reqs, dtype=bool)  # [rows]
        # LoRA: each row's adapter (id 0 / None: the base model); the runner maps ids to slots per step.
        self.lora_id_np = np.zeros(max_num_reqs, dtype=np.int64)  # [rows]
        self.lora_requests: list[LoRARequest | None] = [None] * max_num_reqs
        self.num_lora_rows = 0  # rows with an adapter (0: the step's slot map is all -1)
        self.req_id_to_row: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.num_prompt_logprob_rows = 0  # rows whose request wants prompt logprobs (0: skip that work)
        self.num_history_rows = 0  # rows for which needs_history() holds
        self.num_complex_rows = 0  # rows for which is_plain() does not hold
        # Generators of preempted requests, kept so that a resumed seeded request continues its random stream
        # (its output is then the same as if it had never been preempted).
        self.preempted_generators: dict[str, torch.Generator | None] = {}

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    @property
    def num_prompt_tokens(self) -> np.ndarray:
        return self.num_prompt_tokens_np

    def add(self, data: NewRequestData) -> int:
        if data.req_id in self.req_id_to_row:
            self.remove(data.req_id)
        row = self.free_rows.pop()
        self.req_id_to_row[data.req_id] = row
        self.req_ids[row] = data.req_id
        n = len(data.token_ids)
        self.token_ids_np[row, :n] = data.token_ids
        self.num_tokens_np[row] = n
        self.num_prompt_tokens_np[row] = data.num_prompt_tokens
        self.pending_idx[row] = -1
        assert len(data.block_ids) == len(self.block_table_np), "one block list per KV cache group"
        nb = len(data.block_ids[0])
        self.block_table_np[:, row, :nb] = data.block_ids
        self.num_blocks_np[row] = nb
        params = data.sampling_params
        self.params[row] = params
        self.num_prompt_logprob_rows += params.prompt_logprobs is not None
        self.num_history_rows += needs_history(params)
        self.num_complex_rows += not is_plain(params)
        greedy = params.sampling_type_greedy
        self.greedy_np[row] = greedy
        self.temperature_np[row] = 1.0 if greedy else params.temperature
        self.top_k_np[row] = 0 if greedy or params.top_k <= 0 else params.top_k
        self.top_p_np[row] = 1.0 if greedy else params.top_p
        self.min_p_np[row] = 0.0 if greedy else params.min_p
        self.num_logprobs_np[row] = -1 if params.logprobs is None else params.logprobs
        self.eos_token_ids[row] = data.eos_token_id
        lora = data.lora_request
        self.lora_requests[row] = lora
        self.lora_id_np[row] = 0 if lora is None else lora.lora_int_id
        self.num_lora_rows += lora is not None
        gen = None
        if data.req_id in self.preempted_generators:
            gen = self.preempted_generators.pop(data.req_id)
        elif params.seed is not None and not greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self.generators[row] = gen
        self.has_generator_np[row] = gen is not None and not greedy
        return row

    def update(self, data: CachedRequestData) -> None:
        row = self.req_id_to_row[data.req_id]
        nb = len(data.new_block_ids[0])
        if nb:
            start = int(self.num_blocks_np[row])
            self.block_table_np[:, row, start : start + nb] = data.new_block_ids
            self.num_blocks_np[row] = start + nb

    def remove(self, req_id: str, keep_generator: bool = False) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if not keep_generator:
            self.preempted_generators.pop(req_id, None)  # finished or aborted while preempted
        if row is None:
            return
        if keep_generator:
            self.preempted_generators[req_id] = self.generators[row]
        params = self.params[row]
        self.num_prompt_logprob_rows -= params.prompt_logprobs is not None
        self.num_history_rows -= needs_history(params)
        self.num_complex_rows -= not is_plain(params)
        self.params[row] = None
        self.num_lora_rows -= self.lora_requests[row] is not None
        self.lora_requests[row] = None
        self.lora_id_np[row] = 0
        self.req_ids[row] = None
        self.generators[row] = None
        self.has_generator_np[row] = False
        self.pending_idx[row] = -1
        self.row_gen[row] += 1
        self.free_rows.append(row)

    def set_token_ids(self, req_id: str, start: int, token_ids: list[int]) -> None:
        """Overwrite a row's tokens from ``start`` on with ``token_ids``; the row then ends after them (a draft
        model's batch learning which of its drafts the target kept)."""
        row = self.req_id_to_row[req_id]
        end = start + len(token_ids)
        self.token_ids_np[row, start:end] = token_ids
        self.num_tokens_np[row] = end

    def output_token_ids(self, row: int) -> list[int]:
        """Generated tokens of ``row`` (all known: call only when no placeholder is pending)."""
        return self.token_ids_np[row, self.num_prompt_tokens_np[row] : self.num_tokens_np[row]].tolist()

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids_np[row, : self.num_prompt_tokens_np[row]].tolist()
