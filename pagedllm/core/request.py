"""A request as the scheduler sees it: token ids and the counters that drive scheduling."""

from __future__ import annotations

import enum
from typing import Any

from pagedllm.core.sched_output import EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # holds blocks a KV connector is loading; computes nothing meanwhile
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Scheduling state of one sequence.

    The one rule: ``num_computed_tokens`` catches up to ``num_tokens``. A prompt, a resumed (preempted) request
    and a decode differ only in how far behind it is; a step that brings it level produces one new token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_features: list[Any] | None = None,
    ) -> None:
        self.request_id = request_id
        # Images (MultiModalFeature) in prompt order: their placeholder spans and content hashes; [] for text only.
        self.mm_features: list[Any] = list(mm_features or ())
        self.lora_request = lora_request  # None: the base model
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps still in flight, whose ids the host does not know yet. Each
        # stands in for one token after ``all_token_ids``; the scheduler counts them as known tokens.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.queue_time: float | None = None  # arrival -> first scheduling (monotonic seconds), once known
        self.queue_time_sent = False
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0  # prompt positions whose logprobs were already returned
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        # LongRoPE models: whether the KV this request computes is rotated with the long frequencies (it had more
        # than original_max_position_embeddings tokens when it last started; the scheduler sets it).
        self.rope_long = False
        # Structured outputs: the request's GrammarState (structured_output/manager.py), set by the engine core.
        self.grammar: Any = None
        # Speculative decoding: draft tokens proposed for the next step (the scheduler sends them to be verified).
        self.spec_token_ids: list[int] = []
        # Speculative decoding under async scheduling: draft slots counted in ``num_computed_tokens`` by steps whose
        # verification the scheduler has not processed yet (``num_computed_tokens`` less these is what is certain).
        self.num_reserved_drafts = 0
        max_tokens = sampling_params.max_tokens
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 62

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            list(req.prompt_token_ids),
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.priority,
            req.lora_request,
            req.mm_features,
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model); part of every block hash (adapters never share KV)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
