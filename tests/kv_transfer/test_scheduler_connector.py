"""The scheduler with the CPU offloading connector's scheduler side and a fake worker: no model, no tensors.
Loads park a request until they are reported, failed blocks are recomputed, aborts while loading free
everything, and seeded random runs keep the pool's invariants every step."""

from __future__ import annotations

import random
from types import SimpleNamespace

from pagedllm.config import KVTransferConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.kv_transfer.base import KVConnectorOutput, KVConnectorRole
from pagedllm.kv_transfer.cpu_offloading import OffloadingConnector
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=24, num_cpu_blocks=64, budget=16, headroom=0) -> Scheduler:
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            "OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks}
        ),
        cache_config=SimpleNamespace(block_size=BS),
    )
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_block_bytes=1)
    cfg = SchedulerConfig(
        max_model_len=64, max_num_seqs=8, max_num_batched_tokens=budget, admission_headroom_tokens=headroom
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), connector=connector)


def make_request(req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 7, 0.0)


def fake_run(sched: Scheduler, out: SchedulerOutput, fail: set[int] = frozenset()) -> ModelRunnerOutput:
    """Requests level with their tokens sample 5; every load is reported done, blocks in ``fail`` as failed."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        r = sched.requests[req_id]
        sampled[req_id] = [5] if r.num_computed_tokens == r.num_tokens else []
    meta = out.kv_connector_metadata
    loaded = {block_id for _, block_id in meta.loads}
    report = KVConnectorOutput(finished_recving=set(meta.load_req_ids), invalid_block_ids=loaded & set(fail))
    return ModelRunnerOutput(sampled_token_ids=sampled, kv_connector_output=report)


def run_to_end(sched: Scheduler, fail: set[int] = frozenset()) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < 500, "no progress"
        out = sched.schedule()
        sched.update_from_output(out, fake_run(sched, out, fail))
        sched.check_integrity()
        outs.append(out)
    return outs


def test_a_cpu_hit_parks_the_request_then_skips_its_prefix():
    s = make_scheduler()
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks offered (the 5th holds the last token)
    s.add_request(make_request("a", prompt))
    run_to_end(s)
    assert s.connector.num_stored_blocks >= 4
    assert s.kv.reset_prefix_cache()  # the device forgets; the CPU tier remembers
    s.add_request(make_request("b", prompt))
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and "b" in s.loading
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(out.kv_connector_metadata.loads) == 4
    s.update_from_output(out, fake_run(s, out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 4} and out.num_computed_tokens == {"b": 16}
    assert s.external_prefix_cache_hits == 16
    s.update_from_output(out, fake_run(s, out))
    run_to_end(s)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_a_failed_block_is_recomputed_from_there():
    s = make_scheduler()
    prompt = list(range(10, 30))
    s.add_request(make_request("a", prompt))
    run_to_end(s)
    s.kv.reset_prefix_cache()
    s.add_request(make_request("b", prompt))
    out = s.schedule()
    third = out.kv_connector_metadata.loads[2][1]  # the device block of the third loaded block
    s.update_from_output(out, fake_run(s, out, fail={third}))
    out = s.schedule()
    assert out.num_computed_tokens == {"b": 8} and out.num_scheduled_tokens == {"b": 12}
    assert s.external_prefix_cache_hits == 8
    s.update_from_output(out, fake_run(s, out))
    run_to_end(s)
    # The failed blocks left the CPU tier and came back with the recompute.
    assert s.connector.get_stats()["cpu_used_blocks"] >= 4


def test_abort_while_loading_frees_everything():
    s = make_scheduler()
    prompt = list(range(10, 30))
    s.add_request(make_request("a", prompt))
    run_to_end(s)
    s.kv.reset_prefix_cache()
    s.add_request(make_request("b", prompt))
    out = s.schedule()
    assert "b" in s.loading
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, fake_run(s, out))  # the load's report comes after the abort
    s.check_integrity()
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_random_runs_keep_pool_invariants():
    num_hit = num_failed = 0
    for seed in range(12):
        rng = random.Random(seed)
        s = make_scheduler(num_blocks=rng.choice([12, 18, 24, 40]), num_cpu_blocks=rng.choice([6, 16, 64]))
        prefixes = [[rng.randrange(100) for _ in range(rng.choice([8, 12, 20]))] for _ in range(3)]
        n = 0
        for _ in range(120):
            if rng.random() < 0.3:
                tail = [rng.randrange(100) for _ in range(rng.randint(1, 10))]
                s.add_request(make_request(f"r{n}", rng.choice(prefixes) + tail, rng.randint(1, 8)))
                n += 1
            if rng.random() < 0.05 and s.requests:
                s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
            if rng.random() < 0.2:
                s.kv.reset_prefix_cache()  # (only when no block is in use) the next hits come from the CPU tier
            out = s.schedule()
            loaded = [b for _, b in out.kv_connector_metadata.loads]
            fail = {b for b in loaded if rng.random() < 0.2}
            num_failed += len(fail)
            s.update_from_output(out, fake_run(s, out, fail))
            s.check_integrity()
            for r in s.requests.values():
                assert r.num_computed_tokens <= r.num_tokens
        run_to_end(s)
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks
        num_hit += s.external_prefix_cache_hits
    assert num_hit > 0 and num_failed > 0


def test_a_parked_request_gives_its_blocks_to_a_running_one():
    """b's load comes back but b cannot be admitted (max_num_seqs=1 while r runs); r must grow into b's blocks
    instead of preempting itself and then waiting forever behind them."""
    s = make_scheduler(num_blocks=10)
    s.config.max_num_seqs = 1
    prompt = list(range(10, 30))
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_to_end(s)
    s.kv.reset_prefix_cache()
    s.add_request(make_request("b", prompt, max_tokens=1))
    s.add_request(make_request("r", list(range(50, 58)), max_tokens=30))
    out = s.schedule()
    assert "b" in s.loading and out.num_scheduled_tokens == {"r": 8}
    s.update_from_output(out, fake_run(s, out))
    assert s.parked == {"b"}
    run_to_end(s)
    assert s.num_preemptions == 0
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
