"""Scheduler tests with a fake runner: no model, no torch tensors."""

import random

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=256, policy="fcfs", caching=True, headroom=128
):
    cfg = SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        admission_headroom_tokens=headroom,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, caching))


def make_request(req_id, n_prompt, max_tokens=4, priority=0, arrival=0.0, prompt=None, **kw):
    tokens = prompt if prompt is not None else [hash((req_id, i)) % 1000 for i in range(n_prompt)]
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, **kw), 7, arrival, priority)


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 5) -> ModelRunnerOutput:
    """Every request that reaches the end of its known tokens produces ``token``."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        r = sched.requests[req_id]
        sampled[req_id] = [token] if r.num_computed_tokens == r.num_tokens else []
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched, token=5):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_run(sched, out, token))


def test_budget_shared_by_decodes_and_prefill_chunks():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 9))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}  # b's prompt is chunked
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}  # a decodes, b finishes its prompt
    assert {o.request_id for o in res.outputs} == {"a", "b"}
    assert out.total_num_scheduled_tokens <= 10


def test_no_chunking_waits_for_budget():
    cfg = SchedulerConfig(
        max_model_len=16, max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    s = Scheduler(cfg, KVCacheManager(64, 4))
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10}


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2)
    for i in range(4):
        s.add_request(make_request(str(i), 3))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["0", "1"]


def test_finish_by_length_eos_and_stop_token():
    s = make_scheduler()
    s.add_request(make_request("len", 3, max_tokens=2))
    s.add_request(make_request("stop", 3, max_tokens=5, stop_token_ids=[9]))
    _, res = step(s, token=9)
    by_id = {o.request_id: o for o in res.outputs}
    assert by_id["stop"].finish_reason == "stop" and by_id["stop"].stop_reason == 9
    assert by_id["len"].finish_reason is None
    _, res = step(s, token=7)  # eos
    assert res.outputs[0].finish_reason == "stop" and res.outputs[0].stop_reason is None
    assert not s.has_unfinished_requests()
    s.check_integrity()


def test_min_tokens_and_ignore_eos_suppress_eos_stop():
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=3, min_tokens=2))
    s.add_request(make_request("b", 3, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        _, res = step(s, token=7)
    fin = {o.request_id: o.finish_reason for o in res.outputs}
    assert fin == {"a": "stop", "b": None}
    _, res = step(s, token=7)
    assert res.outputs[0].finish_reason == "length"


def test_preemption_frees_blocks_and_resumes():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, headroom=0)  # vLLM's admission: b gets in
    s.add_request(make_request("a", 8, max_tokens=12))
    s.add_request(make_request("b", 8, max_tokens=12))
    preempted_seen = False
    for _ in range(60):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        s.check_integrity()
        if s.num_preemptions and not preempted_seen:
            preempted_seen = True
            assert "b" in out.finished_req_ids  # the latest admitted was the victim
            assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert preempted_seen and not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 6


def test_admission_headroom_avoids_the_preemption():
    """The same two requests as above: b waits until a's next tokens are covered, and nothing is recomputed."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    s.add_request(make_request("a", 8, max_tokens=12))
    s.add_request(make_request("b", 8, max_tokens=12))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a"]  # a holds 2 blocks and will need 3 more; 4 are free
    order = []
    for _ in range(60):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        s.check_integrity()
        order += [r for r in out.num_scheduled_tokens if r not in order]
    assert order == ["a", "b"] and s.num_preemptions == 0
    assert s.kv.num_free_blocks == 6


def test_admission_headroom_counts_only_what_a_request_may_still_emit():
    # a may emit 1 more token (max_tokens=1): it needs no block beyond its prompt's, so b is admitted at once.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    s.add_request(make_request("a", 8, max_tokens=1))
    s.add_request(make_request("b", 8, max_tokens=1))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    # A headroom smaller than what is left counts only the headroom: 4 tokens = 1 block for a, 3 stay free.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, headroom=4)
    s.add_request(make_request("a", 8, max_tokens=12))
    s.add_request(make_request("b", 8, max_tokens=12))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]


def test_priority_policy_orders_admission_and_preempts_lowest():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, max_seqs=8, policy="priority", headroom=0)
    s.add_request(make_request("low", 8, priority=5, arrival=0.0, max_tokens=10))
    s.add_request(make_request("high", 8, priority=0, arrival=1.0, max_tokens=10))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens)[0] == "high"
    for _ in range(6):
        step(s)
    assert s.requests["low"].num_preemptions >= 1
    assert s.requests.get("high") is None or s.requests["high"].num_preemptions == 0


def test_abort_anywhere_frees_everything():
    s = make_scheduler(budget=4)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    s.check_integrity()
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.total_num_scheduled_tokens == 0


def test_prefix_hit_counts_and_shares_blocks():
    s = make_scheduler(block_size=4)
    prompt = list(range(13))
    s.add_request(make_request("a", 0, prompt=prompt, max_tokens=1))
    step(s)
    s.add_request(make_request("b", 0, prompt=prompt[:12] + [50], max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.kv.prefix_cache_hits == 12
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12


def test_random_runs_keep_pool_invariants():
    rng = random.Random(0)
    for trial in range(8):
        block_size = rng.choice([1, 2, 4, 8])
        min_blocks = 64 // block_size  # the engine guarantees one max_model_len sequence fits
        s = make_scheduler(
            num_blocks=rng.randint(min_blocks, 3 * min_blocks),
            block_size=block_size,
            budget=rng.randint(4, 40),
            max_seqs=rng.randint(1, 6),
            max_len=64,
            policy=rng.choice(["fcfs", "priority"]),
        )
        shared = [rng.randrange(50) for _ in range(16)]
        next_id = 0
        for _ in range(150):
            action = rng.random()
            if action < 0.3:
                n = rng.randint(1, 30)
                prompt = shared[: rng.randint(0, 16)] + [rng.randrange(50) for _ in range(n)]
                prompt = prompt[:60] or [1]
                s.add_request(
                    make_request(
                        f"{trial}-{next_id}",
                        0,
                        prompt=prompt,
                        max_tokens=rng.randint(1, 8),
                        priority=rng.randint(0, 3),
                        arrival=float(next_id),
                    )
                )
                next_id += 1
            elif action < 0.4 and s.requests:
                s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
            else:
                out, _ = step(s, token=rng.randrange(50))
                assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
                assert len(out.num_scheduled_tokens) <= s.config.max_num_seqs
            s.check_integrity()
        for _ in range(500):
            if not s.has_unfinished_requests():
                break
            step(s)
            s.check_integrity()
        assert not s.has_unfinished_requests()
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def make_async_spec_scheduler(k=3, **kw):
    s = make_scheduler(**kw)
    s.config.async_scheduling = True
    return Scheduler(s.config, s.kv, num_spec_tokens=k)


def test_async_speculation_reserves_draft_slots_and_rolls_them_back():
    """Async speculative decoding: the step scheduled while the previous one is in flight reserves draft slots
    (counted as computed until processed); the launch fills fewer; processing the steps in order takes back the
    reserved slots less the accepted drafts, leaving the synchronous scheduler's counts."""
    s = make_async_spec_scheduler(k=3)
    r = make_request("a", 5, max_tokens=20)
    s.add_request(r)
    first = s.schedule()  # the prompt; it samples a token the host learns later
    assert first.num_scheduled_tokens == {"a": 5} and not first.spec_reserved
    assert r.num_output_placeholders == 1
    second = s.schedule()  # before the first is processed: a decode with 3 draft slots reserved
    assert second.num_scheduled_tokens == {"a": 4} and second.spec_reserved == {"a": 3}
    assert r.num_computed_tokens == 9 and r.num_reserved_drafts == 3 and r.num_output_placeholders == 2
    assert second.num_computed_tokens == {"a": 5}
    # The launch proposes 2 drafts (the engine core shrinks the step to its last token plus those).
    second.scheduled_spec_decode_tokens["a"] = [11, 12]
    second.num_scheduled_tokens["a"] = 3
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": [10]}))
    assert r.num_tokens == 6 and r.num_computed_tokens == 9 and r.num_output_placeholders == 1
    third = s.schedule()  # the second is in flight: again one certain token and 3 reserved slots
    assert third.num_scheduled_tokens == {"a": 4} and third.spec_reserved == {"a": 3}
    assert r.num_reserved_drafts == 6 and r.num_computed_tokens == 13
    s.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": [11, 13]}))  # one draft accepted
    assert r.num_tokens == 8 and r.num_reserved_drafts == 3
    assert r.num_computed_tokens - r.num_reserved_drafts == 8  # positions 0..7: the third computes position 7
    stats = s.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 2, 1)
    s.update_from_output(third, ModelRunnerOutput(sampled_token_ids={"a": [14]}))  # no drafts filled
    assert r.num_tokens == 9 and r.num_computed_tokens == 8 and r.num_reserved_drafts == 0
    assert r.num_output_placeholders == 0
    assert s.make_stats().spec_num_drafts == 1
    s.check_integrity()


def test_async_speculation_reserves_within_limits_and_preemption_resets():
    """Reserved slots assume the step in flight emits one token: no more than max_tokens or max_model_len leave
    then; penalties reserve none; a preempted request restarts with nothing reserved and no rollback."""
    s = make_async_spec_scheduler(k=3, max_len=12)
    short = make_request("short", 4, max_tokens=3)
    near = make_request("near", 8, max_tokens=20)
    penalized = make_request("pen", 4, max_tokens=20, repetition_penalty=1.2)
    for r in (short, near, penalized):
        s.add_request(r)
    first = s.schedule()
    second = s.schedule()
    # short: 3 - (0 + 1) - 1 = 1 draft; near: 12 - 9 - 1 = 2 drafts; the penalized request: none.
    assert second.spec_reserved == {"short": 1, "near": 2}
    assert second.num_scheduled_tokens == {"short": 2, "near": 3, "pen": 1}
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"short": [1], "near": [1], "pen": [1]}))
    s._preempt_one()  # the latest admitted: pen (no reservation)
    s._requeue(near)
    assert near.num_computed_tokens == 0 and near.num_reserved_drafts == 0
    s.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"short": [2], "near": [2], "pen": [2]}))
    assert near.num_computed_tokens == 0 and near.num_tokens == 10 and near.num_output_placeholders == 0
    assert short.num_computed_tokens == 5 and short.num_reserved_drafts == 0
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        step(s)
        s.check_integrity()
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.kv.pool.num_blocks
