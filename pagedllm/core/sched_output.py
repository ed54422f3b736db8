"""Plain data crossing boundaries: front-end <-> engine core, and scheduler <-> model runner.

Everything here is picklable plain data (lists, ints, floats, strings) so the engine core can run in its own
process. Tensors never cross the front-end <-> core boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# ---------------------------------------------------------------- front-end <-> engine core


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request, as the engine core receives it (one per sampled sequence; n>1 fans out)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # A pooling model's request (sampling_params is then None): its task and settings, and BERT segment ids of a
    # text pair (None: all 0).
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    # Images of a multimodal prompt (pagedllm/multimodal/inputs.py), in prompt order; None: text only.
    mm_features: list[Any] | None = None


@dataclass
class LogprobsLists:
    """Top-k logprobs for a run of positions. Row i: ``token_ids[i][0]`` is the sampled (or prompt) token,
    the rest are the top-k candidates in descending order; ``ranks[i]`` is the 1-based rank of token 0."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None  # one row per new token, when logprobs were asked for
    new_prompt_logprobs: LogprobsLists | None = None  # rows for prompt positions 1.. computed this step
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds from arrival to first scheduling; on the first output only
    # a pooling request's result (pagedllm/pooling/pooler.py): a float32 numpy row (or a list of floats)
    pooling_output: Any = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's handle, on the finished output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative prompt tokens scheduled (first time only)
    num_generation_tokens: int = 0  # cumulative tokens generated
    num_integrity_failures: int = 0  # cumulative failed idle-time integrity checks (0 unless there is a bug)
    # Speculative decoding (cumulative): verification steps with drafts, draft tokens, accepted drafts, and
    # accepted drafts by position (index i counts drafts accepted at position i).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # A KV connector's prefix tier (cumulative): prompt tokens looked up past the device prefix hit, and tokens
    # it served (loads that succeeded); its own counters by name (KVConnectorBase.get_stats).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_connector_stats: dict[str, int] = field(default_factory=dict)
    # The encoder cache (cumulative): images a request first needed embeddings of, and those whose embeddings were
    # already cached (or being computed) for another request, so not encoded again (encoder_cache.py).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # When an engine core process added requests to its scheduler since its last message (core request id ->
    # time.monotonic(); vLLM's queued_ts). Empty in-process, where arrival and queueing are one moment.
    queued_times: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- scheduler <-> model runner


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption): sent in full, once."""

    req_id: str
    token_ids: list[int]  # prompt + any output so far (a resumed request recomputes all of it)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # one list per KV cache group (core/kv_cache_manager.py), all equally long
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int  # before this step (prefix-cache hits included)
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)  # for penalties after a resume
    lora_request: LoRARequest | None = None  # the adapter its tokens run through (None: the base model)
    mm_features: list[Any] | None = None  # its images (MultiModalFeature, pixels included); None: text only


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # appended to each KV cache group's list (equally many per group)
    num_computed_tokens: int  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]  # known requests that got new blocks this step
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step; iteration order = batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished/aborted/preempted since the last step: the runner drops them
    preempted_req_ids: set[str] = field(
        default_factory=set
    )  # the subset that will come back (keep their RNG)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> computed before this step
    # req_id -> draft tokens to verify this step (speculative decoding). Such a request's scheduled tokens are
    # its last token plus these drafts; the runner returns 1..len(drafts)+1 tokens for it.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding under async scheduling: req_id -> draft slots reserved (scheduled and given blocks)
    # before the previous step's accepted drafts are known. The engine core fills ``scheduled_spec_decode_tokens``
    # with at most that many drafts just before the launch, and shrinks ``num_scheduled_tokens`` to match.
    spec_reserved: dict[str, int] = field(default_factory=dict)
    # Async speculation launched ahead of the host (worker/spec_step.py SpecAhead): the previous step's tokens and
    # drafts on the device, which the launch reads there (None otherwise; the engine core sets it, in-process only).
    spec_ahead: Any = None
    # The KV connector's KVConnectorMetadata for this step (None without a connector).
    kv_connector_metadata: Any = None
    # Images (multimodal models): req_id -> indices into its mm_features to encode this step, before the forward;
    # and the content hashes of encoder outputs no running request needs any more (dropped before encoding).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (keyed by req_id): sampled tokens (empty for a partial prefill chunk) and logprobs."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(
        default_factory=dict
    )  # rows for positions 1.. this chunk
    kv_connector_output: Any = None  # the KV connector's KVConnectorOutput (None without a connector)
