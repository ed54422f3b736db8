"""Disaggregated prefill/decode over P2pConnector: two engines in this process, a producer and a consumer over
gloo. The consumer's greedy tokens and logprobs equal one engine's; faults (a dead producer, a transfer that breaks,
nobody pulling) recompute or free within their timeouts; no block leaks on either side."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv_transfer import p2p as p2p_module
from tests.entrypoints.server_utils import free_port

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
FAST = {"pull_timeout_s": 2.0, "transfer_timeout_s": 3.0, "send_timeout_s": 30.0}


def make_prompts() -> list[list[int]]:
    """Lengths around block boundaries (a multiple of the block size too), two sharing a prefix."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (3, 9, 16, 21, 30)]
    prompts.append(prompts[4][:24] + [7, 8, 9])
    return prompts


def make_llm(path: str, transfer: dict | None = None, **kw) -> LLM:
    return LLM(
        path, dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_model_len=64, enable_prefix_caching=True,
        num_gpu_blocks_override=64, kv_transfer_config=transfer, **kw,
    )  # fmt: skip


def p2p(role: str, **extra) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role, "kv_connector_extra_config": {**FAST, **extra}}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[dict]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for row, want_row in zip(logprobs, want_logprobs, strict=True):
            assert row.keys() == want_row.keys()
            for tok, lp in row.items():
                # reused KV was computed in another batch shape (as with a device prefix hit): float32 rounding
                assert lp.logprob == pytest.approx(want_row[tok].logprob, abs=1e-5)


def assert_no_leaks(llm: LLM, timeout_s: float = 60.0) -> None:
    """Integrity once the engine is idle (a producer frees its kept blocks when they are pulled or expire). The
    deadline only guards against a hang: a loaded CI machine may take seconds per step."""
    engine = llm.llm_engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not go idle"
        engine.step()
    core = engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


class Stepper:
    """Steps the producer's engine on a thread (a server's busy loop), so that its kept blocks are freed."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.stop = llm, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        engine = self.llm.llm_engine
        while not self.stop.is_set():
            if engine.has_unfinished_requests():
                engine.step()
            else:
                time.sleep(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture(scope="module")
def single(tiny_llama):
    llm = make_llm(tiny_llama)
    outs = tokens_and_logprobs(run(llm, make_prompts(), [PARAMS] * len(make_prompts())))
    llm.shutdown()
    return outs


@pytest.fixture(scope="module")
def pair(tiny_llama):
    producer = make_llm(tiny_llama, p2p("kv_producer", kv_port=free_port(), kv_store_port=free_port()))
    consumer = make_llm(tiny_llama, p2p("kv_consumer"))
    yield producer, consumer
    consumer.shutdown()
    producer.shutdown()


def prefill(producer: LLM, prompts: list[list[int]]) -> list[dict]:
    """The proxy's first leg: max_tokens=1 with do_remote_decode; returns the handles."""
    params = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    outs = run(producer, prompts, [params] * len(prompts))
    handles = [o.kv_transfer_params for o in outs]
    assert all(h is not None and h["do_remote_prefill"] for h in handles)
    return handles


def decode_params(handles: list[dict]) -> list[SamplingParams]:
    out = []
    for h in handles:
        p = PARAMS.clone()
        p.kv_transfer_params = h
        out.append(p)
    return out


def test_pd_equals_one_engine(pair, single):
    check_pd_equals_one_engine(*pair, single)


def test_pd_equals_one_engine_with_async_scheduling(tiny_llama, single, monkeypatch):
    """As on CUDA, where async scheduling is the default: the producer finishes a request one step late, the
    consumer's load results arrive while the next step is in flight. Shutting the engines down releases the
    transfer's process group on both sides (NCCL's communicator is not left to process exit)."""
    transfer = p2p("kv_producer", kv_port=free_port(), kv_store_port=free_port())
    producer = make_llm(tiny_llama, transfer, async_scheduling=True)
    consumer = make_llm(tiny_llama, p2p("kv_consumer"), async_scheduling=True)
    released = []
    real = p2p_module.shutdown_backend
    monkeypatch.setattr(p2p_module, "shutdown_backend", lambda group, what: (released.append(group), real(group, what)))
    try:
        check_pd_equals_one_engine(producer, consumer, single)
    finally:
        consumer.shutdown()
        assert len(released) == 1  # the consumer's side of the one producer it pulled from
        producer.shutdown()
    assert len(released) == 2 and released[0] is not released[1]


def check_pd_equals_one_engine(producer: LLM, consumer: LLM, single) -> None:
    prompts = make_prompts()
    for _ in range(2):  # the second pass hits the consumer's prefix cache: it releases the producer's blocks
        handles = prefill(producer, prompts)
        assert [h["remote_num_tokens"] for h in handles] == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        stepper = Stepper(producer)
        try:
            hits = consumer.llm_engine.engine_core.scheduler.external_prefix_cache_hits
            got = tokens_and_logprobs(run(consumer, prompts, decode_params(handles)))
            assert_same(got, single)
            loaded = consumer.llm_engine.engine_core.scheduler.external_prefix_cache_hits - hits
            if _ == 0:
                assert loaded > 0  # really loaded, not recomputed
            deadline = time.monotonic() + 10
            while producer.llm_engine.engine_core.scheduler.delayed_free:  # pulled or released: freed
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            stepper.close()
        assert_no_leaks(producer)
        assert_no_leaks(consumer)
        consumer.llm_engine.engine_core.reset_prefix_cache()


def test_a_consumer_short_of_blocks_still_loads_every_request(pair, tiny_llama):
    """Requests the consumer cannot admit at once (few blocks) keep their handles until they are admitted."""
    producer, _ = pair
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(30)] for _ in range(3)]
    handles = prefill(producer, prompts)
    consumer = LLM(
        tiny_llama, dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_model_len=64,
        num_gpu_blocks_override=16, kv_transfer_config=p2p("kv_consumer"),
    )  # fmt: skip
    stepper = Stepper(producer)
    try:
        run(consumer, prompts, decode_params(handles))
        assert consumer.llm_engine.engine_core.scheduler.external_prefix_cache_hits == sum(
            h["remote_num_tokens"] for h in handles
        )
        assert_no_leaks(consumer)
    finally:
        stepper.close()
        consumer.shutdown()
    assert_no_leaks(producer)


def test_dead_producer_recomputes(pair, single):
    _, consumer = pair
    prompts = make_prompts()[3:5]
    handles = [
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
         "remote_request_id": "gone", "remote_num_tokens": (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE,
         "remote_block_size": BLOCK_SIZE, "remote_tokens_digest": _digest(p, (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE)}
        for p in prompts
    ]  # fmt: skip
    t0 = time.monotonic()
    got = tokens_and_logprobs(run(consumer, prompts, decode_params(handles)))
    assert time.monotonic() - t0 < 2 * FAST["pull_timeout_s"] + 5
    assert_same(got, single[3:5])
    assert_no_leaks(consumer)


def test_handle_for_another_prompt_is_not_loaded(pair, single):
    producer, consumer = pair
    prompts = make_prompts()
    handles = prefill(producer, prompts[3:4])
    other = list(prompts[3])
    other[0] += 1  # same length, different tokens: the digest differs
    stepper = Stepper(producer)
    try:
        run(consumer, [other], decode_params(handles))
        assert consumer.llm_engine.engine_core.scheduler.connector.num_refused_handles >= 1
        deadline = time.monotonic() + 10
        while producer.llm_engine.engine_core.scheduler.delayed_free:  # released by the consumer
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        stepper.close()
    assert_no_leaks(producer)
    assert_no_leaks(consumer)
    consumer.llm_engine.engine_core.reset_prefix_cache()


def test_role_mismatch_is_ignored_not_wrong(pair, single):
    """do_remote_decode sent to a consumer, a handle sent to a producer, a malformed handle: no handle, no load, the
    right tokens."""
    producer, consumer = pair
    prompts = make_prompts()[3:4]
    params = PARAMS.clone()
    params.kv_transfer_params = {"do_remote_decode": True}
    outs = run(consumer, prompts, [params])
    assert outs[0].kv_transfer_params is None
    assert_same(tokens_and_logprobs(outs), single[3:4])
    params.kv_transfer_params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                                 "remote_request_id": "x", "remote_num_tokens": 16, "remote_block_size": BLOCK_SIZE}
    assert_same(tokens_and_logprobs(run(producer, prompts, [params])), single[3:4])
    params.kv_transfer_params = {**params.kv_transfer_params, "remote_port": "not a port"}  # malformed: refused
    assert_same(tokens_and_logprobs(run(consumer, prompts, [params])), single[3:4])
    assert_no_leaks(producer)
    assert_no_leaks(consumer)
    for llm in pair:
        llm.llm_engine.engine_core.reset_prefix_cache()


def test_broken_transfer_recomputes(pair, single, monkeypatch):
    """The producer agrees to send, then its side of the transfer dies: the consumer's receive times out and the
    request recomputes its prompt; both sides free everything."""
    from pagedllm.kv_transfer import p2p as p2p_module

    def dying_pull(self, ident, msg):
        with self.lock:
            self.busy.add(msg["req_id"])
        self._reply(ident, {"ok": True})
        self.groups.pop(msg["consumer_id"], None)  # sends nothing
        with self.lock:
            self.busy.discard(msg["req_id"])
            self._finish(msg["req_id"])

    producer, consumer = pair
    prompts = make_prompts()[4:5]
    handles = prefill(producer, prompts)
    monkeypatch.setattr(p2p_module._Producer, "_pull", dying_pull)
    stepper = Stepper(producer)
    try:
        t0 = time.monotonic()
        got = tokens_and_logprobs(run(consumer, prompts, decode_params(handles)))
        assert time.monotonic() - t0 < FAST["transfer_timeout_s"] + FAST["pull_timeout_s"] + 5
    finally:
        stepper.close()
    assert_same(got, single[4:5])
    assert_no_leaks(producer)
    assert_no_leaks(consumer)
    consumer.llm_engine.engine_core.reset_prefix_cache()


def test_unpulled_blocks_are_freed_after_the_send_timeout(tiny_llama):
    producer = make_llm(tiny_llama, p2p("kv_producer", kv_port=free_port(), kv_store_port=free_port(), send_timeout_s=0.3))
    try:
        prefill(producer, make_prompts()[3:5])
        assert producer.llm_engine.engine_core.scheduler.delayed_free
        assert_no_leaks(producer, timeout_s=5)
    finally:
        producer.shutdown()


@pytest.mark.parametrize(
    "transfer, field",
    [
        (p2p("kv_producer"), "kv_port"),
        (p2p("kv_consumer", remote_host="127.0.0.1"), "remote_host and remote_port"),
        (p2p("kv_consumer", proxy_ip="1.2.3.4"), "proxy_ip"),
        (p2p("kv_consumer", pull_timeout_s="soon"), "pull_timeout_s"),
        ({"kv_connector": "P2pNcclConnectr", "kv_role": "kv_producer"}, "kv_connector"),
    ],
)
def test_bad_config_is_refused_at_start_up(tiny_llama, transfer, field):
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_llama, transfer)


def test_unreachable_producer_and_taken_port_are_refused_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="remote_port"):
        make_llm(tiny_llama, p2p("kv_consumer", remote_host="127.0.0.1", remote_port=free_port(), connect_timeout_s=0.5))
    port = free_port()
    producer = make_llm(tiny_llama, {**p2p("kv_producer"), "kv_port": port, "kv_connector": "P2pNcclConnector"})
    try:
        with pytest.raises(ValueError, match="kv_port"):
            make_llm(tiny_llama, p2p("kv_producer", kv_port=port, kv_store_port=free_port()))
        # a consumer that names a live producer starts
        make_llm(tiny_llama, p2p("kv_consumer", remote_host="127.0.0.1", remote_port=port)).shutdown()
    finally:
        producer.shutdown()


def _digest(prompt: list[int], n: int) -> str:
    from pagedllm.kv_transfer.p2p import tokens_digest

    return tokens_digest(prompt[:n])
