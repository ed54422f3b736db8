"""Scheduling policy under a burst of requests arriving at once: the Scheduler driven step by step with a fake
runner (every request that reaches the end of its known tokens samples one token). Checks who starts in the first
step, time-to-first-token order, that long prompts are not starved, the priority policy, and vLLM's burst knobs
(``long_prefill_token_threshold``, ``max_num_partial_prefills``, ``max_long_partial_prefills``)."""

from __future__ import annotations

import argparse
import math
import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make_scheduler(
    budget: int, max_seqs: int = 64, num_blocks: int = 1024, policy: str = "fcfs", max_len: int = 512, **knobs
) -> Scheduler:
    """Block size 4, no prefix caching (random prompts would not hit anyway), no admission headroom."""
    cfg = SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        admission_headroom_tokens=0,
        **knobs,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, False))


class Driver:
    """Adds requests, runs steps, and records what each step did: chunks scheduled, the step at which each
    request got its first token (steps count from 0), and which requests were mid-prefill after it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.reqs: dict[str, Request] = {}
        self.num_steps = 0
        self.first_token_step: dict[str, int] = {}
        self.chunks: list[dict[str, int]] = []  # per step: req_id -> tokens scheduled
        self.mid_prefill: list[list[str]] = []  # per step: requests left with part of their prompt to compute
        self.long_mid_prefill: list[list[str]] = []  # per step: those of them with more than T left before it

    def add(self, req_id: str, num_prompt: int, max_tokens: int = 4, priority: int = 0) -> Request:
        rng = random.Random(req_id)
        tokens = [rng.randrange(10, 1000) for _ in range(num_prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, tokens, params, None, float(len(self.reqs)), priority)
        self.reqs[req_id] = request
        self.sched.add_request(request)
        return request

    def step(self, threshold: int = 0) -> dict[str, int]:
        left_before = {rid: r.num_prompt_tokens - r.num_computed_tokens for rid, r in self.reqs.items()}
        out = self.sched.schedule()
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            r = self.sched.requests[req_id]
            sampled[req_id] = [5] if r.num_computed_tokens == r.num_tokens else []
        result = self.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        for o in result.outputs:
            if o.new_token_ids:
                self.first_token_step.setdefault(o.request_id, self.num_steps)
        mid = [
            rid for rid, r in self.reqs.items()
            if r.status == RequestStatus.RUNNING and 0 < r.num_computed_tokens < r.num_prompt_tokens
        ]  # fmt: skip
        self.mid_prefill.append(mid)
        self.long_mid_prefill.append([rid for rid in mid if left_before[rid] > threshold])
        self.chunks.append(dict(out.num_scheduled_tokens))
        self.num_steps += 1
        self.sched.check_integrity()
        return out.num_scheduled_tokens

    def run(self, max_steps: int = 500, threshold: int = 0, may_preempt: bool = False) -> None:
        """Step until every request finished; unless ``may_preempt``, none was preempted (so "mid-prefill" above,
        read off the prompt, is exact)."""
        while self.sched.has_unfinished_requests():
            assert self.num_steps < max_steps, "the burst did not drain"
            self.step(threshold)
        assert may_preempt or all(r.num_preemptions == 0 for r in self.reqs.values())


# ---------------------------------------------------------------------------------------------- who starts first


@pytest.mark.parametrize(
    "budget, max_seqs, expected",
    [
        (100, 64, 7),  # budget-bound: 6 whole 16-token prompts + a 4-token chunk of the 7th
        (100, 4, 4),  # seat-bound: max_num_seqs
        (16 * 20, 64, 20),  # everyone fits
        (10, 64, 1),  # a single chunk
    ],
)
def test_burst_first_step_starts_as_many_as_budget_and_seats_allow(budget, max_seqs, expected):
    d = Driver(make_scheduler(budget, max_seqs))
    for i in range(20):
        d.add(f"r{i}", 16)
    chunks = d.step()
    assert list(chunks) == [f"r{i}" for i in range(expected)]  # the first arrivals, in arrival order
    assert sum(chunks.values()) == min(budget, 16 * expected)
    assert all(n == 16 for n in list(chunks.values())[:-1])  # only the last one started may be a chunk
    assert len(d.sched.running) == expected and len(d.sched.waiting) == 20 - expected


def test_burst_seats_free_up_in_arrival_order():
    """max_num_seqs=3: a request starts only when one finishes, and the next to start is the earliest arrival."""
    d = Driver(make_scheduler(budget=256, max_seqs=3))
    for i in range(9):
        d.add(f"r{i}", 8, max_tokens=2)
    d.run()
    starts = [d.first_token_step[f"r{i}"] for i in range(9)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4]


# ---------------------------------------------------------------------------------------------- TTFT order


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fcfs_first_tokens_come_in_arrival_order(seed):
    rng = random.Random(seed)
    d = Driver(make_scheduler(budget=32, max_seqs=8))
    for i in range(24):
        d.add(f"r{i:02d}", rng.choice([3, 8, 20, 50, 90]), max_tokens=rng.randint(1, 6))
    d.run()
    ttft = [d.first_token_step[f"r{i:02d}"] for i in range(24)]
    assert ttft == sorted(ttft), ttft
    assert all(sum(c.values()) <= 32 for c in d.chunks)


# ---------------------------------------------------------------------------------------------- no starvation


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"long_prefill_token_threshold": 8},
        {"long_prefill_token_threshold": 8, "max_num_partial_prefills": 3, "max_long_partial_prefills": 1},
    ],
    ids=["plain", "threshold", "partial-limits"],
)
def test_long_prompts_finish_their_prefill_while_short_ones_keep_coming(knobs):
    """Two 160-token prompts among 5 short ones, with 2 more short prompts arriving every step: each long prompt
    gets its first token within a bound set by the tokens ahead of it, and the shorts keep being served."""
    budget, threshold = 32, knobs.get("long_prefill_token_threshold", 0)
    d = Driver(make_scheduler(budget, max_seqs=16, **knobs))
    for i in range(5):
        d.add(f"s{i}", 6, max_tokens=2)
    d.add("long0", 160, max_tokens=2)
    d.add("long1", 160, max_tokens=2)
    n = 5
    for _ in range(60):
        d.step(threshold)
        for _ in range(2):
            d.add(f"s{n}", 6, max_tokens=2)
            n += 1
    # Each step spends at least (chunk per long prompt) on it once it is first among the prompts left; both
    # together need 320 tokens at 8 (threshold) or up to 32 - decodes per step: 2 * 160 / 8 = 40 steps plus
    # the few steps the shorts ahead of them take.
    bound = 2 * math.ceil(160 / 8) + 6
    assert d.first_token_step["long0"] <= bound and d.first_token_step["long1"] <= bound, d.first_token_step
    served = [d.first_token_step.get(f"s{i}") for i in range(5, n)]
    assert sum(s is not None for s in served) >= n - 5 - 8  # all but the last few arrivals got a first token


# ---------------------------------------------------------------------------------------------- priority


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_arrival_goes_first_and_lowest_priority_is_preempted(policy):
    """Room for about two requests; two low-priority ones run, then a low-priority and a high-priority request
    arrive (the high one last). Under priority the high one starts first, is never preempted, and a low one is
    the victim when decodes run out of blocks; under fcfs arrival order wins."""
    d = Driver(make_scheduler(budget=64, max_seqs=8, num_blocks=12, policy=policy))
    d.add("low0", 16, max_tokens=12, priority=5)
    d.add("low1", 16, max_tokens=12, priority=5)
    d.step()
    d.add("low2", 16, max_tokens=4, priority=5)
    d.add("high", 16, max_tokens=4, priority=0)
    d.run(max_steps=200, may_preempt=True)
    ttft = d.first_token_step
    if policy == "priority":
        assert ttft["high"] < ttft["low2"]
        assert d.reqs["high"].num_preemptions == 0
        assert d.sched.num_preemptions >= 1  # the cache is too small for everyone: lows made room
    else:
        assert ttft["low2"] < ttft["high"]


def test_priority_orders_a_burst_by_priority_then_arrival():
    d = Driver(make_scheduler(budget=16, max_seqs=64, policy="priority"))
    prios = [3, 1, 2, 1, 0, 3, 2, 0]
    for i, p in enumerate(prios):
        d.add(f"r{i}", 16, max_tokens=1, priority=p)
    d.run()
    order = sorted(d.first_token_step, key=lambda rid: d.first_token_step[rid])
    assert order == sorted(order, key=lambda rid: (prios[int(rid[1:])], int(rid[1:])))


# ---------------------------------------------------------------------------------------------- burst knobs


def _long_then_shorts(threshold: int, **knobs) -> Driver:
    d = Driver(make_scheduler(budget=32, max_seqs=16, long_prefill_token_threshold=threshold, **knobs))
    d.add("long", 128, max_tokens=2)
    for i in range(6):
        d.add(f"s{i}", 8, max_tokens=2)
    d.run(threshold=threshold)
    return d


def test_threshold_caps_chunks_and_short_prompts_get_their_first_token_sooner():
    plain, capped = _long_then_shorts(0), _long_then_shorts(8)
    assert max(n for c in plain.chunks for n in c.values()) == 32
    assert max(n for c in capped.chunks for n in c.values()) == 8  # no chunk over the threshold
    assert [c["long"] for c in capped.chunks if "long" in c][:16] == [8] * 16  # 128 = 16 chunks of 8
    shorts = [f"s{i}" for i in range(6)]
    plain_ttft = [plain.first_token_step[s] for s in shorts]
    capped_ttft = [capped.first_token_step[s] for s in shorts]
    assert max(capped_ttft) < min(plain_ttft)  # every short beats the earliest short without the cap
    assert capped.first_token_step["long"] > plain.first_token_step["long"]  # the cost: the long one takes longer


def test_threshold_caps_running_and_newly_admitted_requests_alike():
    d = Driver(make_scheduler(budget=64, long_prefill_token_threshold=10))
    d.add("a", 25)
    assert d.step() == {"a": 10}
    d.add("b", 30)
    assert d.step() == {"a": 10, "b": 10}
    assert d.step() == {"a": 5, "b": 10}
    assert d.step() == {"a": 1, "b": 10}  # a decodes; b's last chunk


@pytest.mark.parametrize("k, k_long", [(2, 1), (2, 2), (3, 1), (4, 2)])
def test_at_most_k_requests_are_mid_prefill(k, k_long):
    """A burst of long and short prompts with a small threshold: after every step at most k requests are
    mid-prefill, at most k_long of them long. Without the limit (k = 1, vLLM's default) more than k are."""
    rng = random.Random(k * 10 + k_long)
    lengths = [rng.choice([6, 12, 40, 100]) for _ in range(30)]

    def burst(**knobs) -> Driver:
        d = Driver(make_scheduler(budget=128, max_seqs=32, long_prefill_token_threshold=16, **knobs))
        for i, n in enumerate(lengths):
            d.add(f"r{i}", n, max_tokens=3)
        d.run(threshold=16)
        return d

    limited = burst(max_num_partial_prefills=k, max_long_partial_prefills=k_long)
    assert max(len(m) for m in limited.mid_prefill) <= k
    assert max(len(m) for m in limited.long_mid_prefill) <= k_long
    assert max(len(m) for m in limited.mid_prefill) >= min(k, 2)  # the limit is reached, not merely respected
    unlimited = burst()
    assert max(len(m) for m in unlimited.mid_prefill) > k


def test_short_prompts_overtake_long_ones_when_long_places_are_taken():
    """Two long prompts at the head of the queue, shorts behind: with max_long_partial_prefills=1 the second
    long prompt waits while the shorts behind it start; without the knobs it starts in the first step."""
    def burst(**knobs) -> Driver:
        d = Driver(make_scheduler(budget=48, max_seqs=16, long_prefill_token_threshold=16, **knobs))
        d.add("long0", 64, max_tokens=2)
        d.add("long1", 64, max_tokens=2)
        for i in range(4):
            d.add(f"s{i}", 8, max_tokens=2)
        d.run(threshold=16)
        return d

    limited = burst(max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert limited.chunks[0] == {"long0": 16, "s0": 8, "s1": 8, "s2": 8, "s3": 8}
    # long1 starts in the step that computes long0's last chunk (long0 then ends it no longer mid-prefill)
    assert [i for i, c in enumerate(limited.chunks) if "long0" in c][:4] == [0, 1, 2, 3]
    assert min(i for i, c in enumerate(limited.chunks) if "long1" in c) == 3
    assert max(limited.first_token_step[f"s{i}"] for i in range(4)) == 0
    plain = burst()
    assert plain.chunks[0] == {"long0": 16, "long1": 16, "s0": 8, "s1": 8}


# ---------------------------------------------------------------------------------------------- config and flags


def test_burst_knobs_default_and_derived_as_vllm():
    cfg = SchedulerConfig(max_model_len=4096)
    assert (cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills, cfg.max_long_partial_prefills) == (0, 1, 1)
    cfg = SchedulerConfig(max_model_len=4096, max_num_partial_prefills=4)
    assert cfg.long_prefill_token_threshold == int(4096 * 0.04)  # derived when concurrent partial prefills are on
    cfg = SchedulerConfig(max_model_len=4096, max_num_partial_prefills=4, long_prefill_token_threshold=300)
    assert cfg.long_prefill_token_threshold == 300


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        ({"max_long_partial_prefills": 0}, "max_long_partial_prefills"),
        ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills"),
        ({"max_num_partial_prefills": 2, "long_prefill_token_threshold": 5000}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 2, "enable_chunked_prefill": False}, "max_num_partial_prefills"),
        ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False}, "long_prefill_token_threshold"),
    ],
)
def test_bad_burst_knobs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(max_model_len=4096, max_num_batched_tokens=4096, **kw)


def test_scheduler_flags_reach_the_config_from_the_command_line_and_llm(tiny_llama):
    from pagedllm import LLM
    from pagedllm.config import make_engine_config
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = make_engine_config(tiny_llama, **engine_kwargs_from_args(parser.parse_args([]))).scheduler_config
    assert (defaults.policy, defaults.long_prefill_token_threshold) == ("fcfs", 0)
    assert (defaults.max_num_partial_prefills, defaults.max_long_partial_prefills) == (1, 1)
    args = parser.parse_args(
        ["--scheduling-policy", "priority", "--long-prefill-token-threshold", "24", "--max-num-partial-prefills",
         "4", "--max-long-partial-prefills", "2"]
    )  # fmt: skip
    cfg = make_engine_config(tiny_llama, **engine_kwargs_from_args(args)).scheduler_config
    assert (cfg.policy, cfg.long_prefill_token_threshold) == ("priority", 24)
    assert (cfg.max_num_partial_prefills, cfg.max_long_partial_prefills) == (4, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    bad = parser.parse_args(["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"])
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        make_engine_config(tiny_llama, **engine_kwargs_from_args(bad))

    llm = LLM(
        tiny_llama, device="cpu", dtype="float32", scheduling_policy="priority", long_prefill_token_threshold=8,
        max_num_partial_prefills=2, max_long_partial_prefills=1,
    )  # fmt: skip
    try:
        cfg = llm.llm_engine.config.scheduler_config
        assert (cfg.policy, cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills) == ("priority", 8, 2)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(range(3, 40))}] * 3, params, priority=[2, 0, 1], use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    finally:
        llm.shutdown()
