"""Load and cancellation soak against a real server on 127.0.0.1, with a KV cache small enough to preempt.

For ``PAGEDLLM_SOAK_SECONDS`` (default 10) seconds, 24 concurrent clients send a random mix of streamed and
non-streamed completions and chat completions (random max_tokens, n=1 or 2, stop strings, logprobs, sampling or
greedy), and disconnect from some of them midway (closing the connection after a random delay or, streamed,
after a few events): a disconnect is how an HTTP client aborts. Every request ends
completed (and its response is checked to be well formed and its usage consistent with its tokens), deliberately
disconnected, or as an error; none may hang. Afterwards the engine must be idle with every block free, its
integrity check passing and its request tables empty (``GET /debug/integrity``). The figures go to one line:

    SOAK: requests=.. completed=.. disconnected=.. errors=.. preemptions=.. leaked_blocks=.. ...

``PAGEDLLM_SOAK_SEED`` changes the clients' random choices (timing varies from run to run anyway).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.entrypoints.server_utils import RemoteServer, metric

SOAK_SECONDS = float(os.environ.get("PAGEDLLM_SOAK_SECONDS", "10"))
SEED = int(os.environ.get("PAGEDLLM_SOAK_SEED", "0"))
NUM_CLIENTS = 24
REQUEST_TIMEOUT_S = 90.0  # a request still running after this long counts as a hang
MAX_TOKENS = 64
# 48 blocks of 16 tokens (768 tokens) for 24 clients each asking for up to 100-240 tokens (twice that with n=2).
SERVER_ARGS = [
    "--num-gpu-blocks-override", "48", "--block-size", "16", "--max-model-len", "256",
    "--max-num-seqs", "64", "--enable-debug-endpoints",
]  # fmt: skip

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n: int) -> int:\n",
    "Once upon a time there was a little robot who loved to count.",
    "A paged key-value cache splits each sequence into fixed-size blocks, so memory is allocated on demand",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Hello, how are you today?",
    "numbers = [3, 1, 4, 1, 5, 9, 2, 6]\nprint(",
    "The scheduler decides which requests run, how many tokens each one computes, and which ones must be",
]
STOPS = [None, None, ["e"], [" the", "\n"], ["o", "!"], ["."]]


@dataclass
class Plan:
    """One request, as chosen at random."""

    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    n: int
    stop: list[str] | None
    logprobs: bool
    include_usage: bool
    temperature: float
    seed: int
    # Give up after this many seconds (and, streamed, after ``disconnect_events`` events), whichever comes first.
    disconnect_s: float | None
    disconnect_events: int | None

    def body(self, model: str) -> dict:
        body: dict = {
            "model": model, "max_tokens": self.max_tokens, "n": self.n, "stream": self.stream,
            "temperature": self.temperature, "seed": self.seed,
        }  # fmt: skip
        if self.stop:
            body["stop"] = self.stop
        if self.disconnect_s is not None:
            body["ignore_eos"] = True
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=1)
        else:
            body["prompt"] = self.prompt
            if self.logprobs:
                body["logprobs"] = 1
        return body


def make_plan(rng: random.Random) -> Plan:
    # A quarter are given up midway: long ones (EOS ignored, no stop strings), so most are still running when the
    # client leaves. Leaving by time as well as by events read matters: a client that reads slower than the
    # server writes would otherwise leave only after the server has finished.
    disconnect = rng.random() < 0.25
    return Plan(
        chat=rng.random() < 0.5,
        stream=rng.random() < 0.8,
        prompt=rng.choice(PROMPTS),
        max_tokens=rng.randint(96, 160) if disconnect else rng.randint(1, MAX_TOKENS),
        n=2 if rng.random() < 0.25 else 1,
        stop=None if disconnect else rng.choice(STOPS),
        logprobs=rng.random() < 0.5,
        include_usage=rng.random() < 0.85,
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randrange(1 << 30),
        disconnect_s=rng.uniform(0.05, 0.6) if disconnect else None,
        disconnect_events=rng.randint(1, 6) if disconnect else None,
    )


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    completed_seqs: int = 0
    sent_seqs: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)


class Malformed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Malformed(what)


class ChoiceState:
    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0  # counted from logprobs, when asked for
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.got_role = False


def check_choice_end(plan: Plan, st: ChoiceState, index: int) -> None:
    check(st.finish_reason in ("stop", "length"), f"choice {index}: finish_reason {st.finish_reason!r}")
    if plan.logprobs:
        check(1 <= st.num_tokens <= plan.max_tokens, f"choice {index}: {st.num_tokens} tokens")
        if st.finish_reason == "length":
            check(st.num_tokens == plan.max_tokens, f"choice {index}: length after {st.num_tokens} tokens")
    if plan.stop:
        check(not any(s in st.text for s in plan.stop), f"choice {index}: stop string in {st.text!r}")
        if st.stop_reason is not None:
            check(st.stop_reason in plan.stop, f"choice {index}: stop_reason {st.stop_reason!r}")


def check_usage(plan: Plan, usage: dict, choices: list[ChoiceState], num_prompt_tokens: int) -> int:
    check(usage["prompt_tokens"] == num_prompt_tokens, f"usage {usage} != {num_prompt_tokens} prompt tokens")
    check(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage {usage}")
    completion = usage["completion_tokens"]
    if plan.logprobs:
        check(completion == sum(c.num_tokens for c in choices), f"usage {usage} vs logprob token counts")
    else:  # each choice made 1..max_tokens tokens, exactly max_tokens when it ended by length
        low = sum(plan.max_tokens if c.finish_reason == "length" else 1 for c in choices)
        check(low <= completion <= plan.max_tokens * plan.n, f"usage {usage} for {plan}")
    return completion


def count_logprob_tokens(plan: Plan, logprobs: dict | None) -> int:
    if not plan.logprobs:
        check(logprobs is None, "logprobs not asked for")
        return 0
    if logprobs is None:
        return 0
    if plan.chat:
        return len(logprobs["content"])
    check(len(logprobs["tokens"]) == len(logprobs["token_logprobs"]), "completion logprobs lengths differ")
    return len(logprobs["tokens"])


async def run_request(http: httpx.AsyncClient, srv: RemoteServer, model: str, plan: Plan, num_prompt: int):
    """Returns ("completed", completion tokens) or ("disconnected", 0); raises on anything malformed."""
    run = run_streamed if plan.stream else run_blocking
    if plan.disconnect_s is None:
        return await run(http, srv, model, plan, num_prompt)
    try:
        async with asyncio.timeout(plan.disconnect_s):
            return await run(http, srv, model, plan, num_prompt)
    except TimeoutError:
        return "disconnected", 0  # the cancelled request closes its connection


async def run_streamed(http: httpx.AsyncClient, srv: RemoteServer, model: str, plan: Plan, num_prompt: int):
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    obj = "chat.completion.chunk" if plan.chat else "text_completion"
    choices = [ChoiceState() for _ in range(plan.n)]
    usage = None
    request_id = None
    events = 0
    done = False
    async with http.stream("POST", srv.base_url + path, json=plan.body(model), headers=srv.headers) as r:
        check(r.status_code == 200, f"status {r.status_code}: {(await r.aread())[:300]!r}")
        check(r.headers["content-type"].startswith("text/event-stream"), r.headers["content-type"])
        async for line in r.aiter_lines():
            if not line:
                continue
            check(not done, f"data after [DONE]: {line!r}")
            check(line.startswith("data: "), f"not an SSE data line: {line!r}")
            events += 1
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            if plan.disconnect_events is not None and events >= plan.disconnect_events:
                return "disconnected", 0  # leaving the block closes the connection midway
            chunk = json.loads(payload)
            check("error" not in chunk, f"error event: {chunk}")
            check(chunk["object"] == obj and chunk["model"] == model, f"chunk {chunk}")
            request_id = request_id or chunk["id"]
            check(chunk["id"] == request_id, "the id changed within a stream")
            check(usage is None, "a chunk after the usage chunk")
            if not chunk["choices"]:
                check(plan.include_usage and chunk.get("usage") is not None, f"empty chunk {chunk}")
                check(all(c.finish_reason for c in choices), "usage before every choice finished")
                usage = chunk["usage"]
                continue
            check(len(chunk["choices"]) == 1, f"chunk {chunk}")
            choice = chunk["choices"][0]
            index = choice["index"]
            check(0 <= index < plan.n, f"index {index}")
            st = choices[index]
            check(st.finish_reason is None, f"choice {index}: a chunk after its finish_reason")
            if plan.chat:
                delta = choice["delta"]
                if not st.got_role:
                    check(delta == {"role": "assistant", "content": ""}, f"first delta {delta}")
                    st.got_role = True
                    continue
                check("role" not in delta, f"second role delta {delta}")
                st.text += delta.get("content", "")
            else:
                st.text += choice["text"]
            st.num_tokens += count_logprob_tokens(plan, choice["logprobs"])
            if choice["finish_reason"] is not None:
                st.finish_reason = choice["finish_reason"]
                st.stop_reason = choice.get("stop_reason")
    check(done, f"no [DONE] after {events} events")
    for index, st in enumerate(choices):
        check(st.got_role or not plan.chat, f"choice {index}: no role delta")
        check_choice_end(plan, st, index)
    if not plan.include_usage:
        check(usage is None, "usage chunk not asked for")
        return "completed", 0
    check(usage is not None, "no usage chunk")
    return "completed", check_usage(plan, usage, choices, num_prompt)


async def run_blocking(http: httpx.AsyncClient, srv: RemoteServer, model: str, plan: Plan, num_prompt: int):
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    r = await http.post(srv.base_url + path, json=plan.body(model), headers=srv.headers)
    check(r.status_code == 200, f"status {r.status_code}: {r.text[:300]}")
    body = r.json()
    check(body["object"] == ("chat.completion" if plan.chat else "text_completion"), f"object {body}")
    check(sorted(c["index"] for c in body["choices"]) == list(range(plan.n)), f"choices {body}")
    choices = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        st = ChoiceState()
        st.text = c["message"]["content"] if plan.chat else c["text"]
        st.num_tokens = count_logprob_tokens(plan, c["logprobs"])
        st.finish_reason, st.stop_reason = c["finish_reason"], c.get("stop_reason")
        check_choice_end(plan, st, c["index"])
        choices.append(st)
    return "completed", check_usage(plan, body["usage"], choices, num_prompt)


async def prompt_token_counts(http: httpx.AsyncClient, srv: RemoteServer, model: str) -> dict:
    counts = {}
    for prompt in PROMPTS:
        for chat in (False, True):
            body = {"model": model}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            r = await http.post(srv.base_url + "/tokenize", json=body, headers=srv.headers)
            assert r.status_code == 200, r.text
            counts[chat, prompt] = r.json()["count"]
    return counts


async def soak(srv: RemoteServer, model: str, tally: Tally) -> None:
    limits = httpx.Limits(max_connections=4 * NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as http:
        num_prompt_tokens = await prompt_token_counts(http, srv, model)
        deadline = time.monotonic() + SOAK_SECONDS

        async def client(worker: int) -> None:
            rng = random.Random(SEED * 1000 + worker)
            while time.monotonic() < deadline:
                plan = make_plan(rng)
                tally.requests += 1
                tally.sent_seqs += plan.n
                work = run_request(http, srv, model, plan, num_prompt_tokens[plan.chat, plan.prompt])
                try:
                    outcome, num_tokens = await asyncio.wait_for(work, REQUEST_TIMEOUT_S)
                except asyncio.TimeoutError:
                    tally.errors.append(f"hang: no end within {REQUEST_TIMEOUT_S} s: {plan}")
                    continue
                except Exception as e:  # noqa: BLE001 - every failure is tallied and reported
                    tally.errors.append(f"{type(e).__name__}: {e} ({plan})")
                    continue
                if outcome == "completed":
                    tally.completed += 1
                    tally.completed_seqs += plan.n
                    tally.completion_tokens += num_tokens
                else:
                    tally.disconnected += 1

        await asyncio.gather(*(client(i) for i in range(NUM_CLIENTS)))


@pytest.fixture
def soak_server(admit_while_blocks_last, tiny_llama, tmp_path):
    srv = RemoteServer(tiny_llama, tmp_path / "server.log", extra_args=SERVER_ARGS)
    yield srv
    srv.stop()


def test_soak(soak_server, tiny_llama):
    srv = soak_server
    tally = Tally()
    start = time.monotonic()
    asyncio.run(soak(srv, tiny_llama, tally))
    seconds = time.monotonic() - start
    m = srv.wait_idle()
    r = httpx.get(srv.base_url + "/debug/integrity", headers=srv.headers, timeout=30)
    assert r.status_code == 200, r.text
    state = r.json()
    leaked = state["num_blocks"] - state["num_free_blocks"]
    preemptions = int(metric(m, "num_preemptions_total"))
    finished = {
        reason: int(metric(m, "request_success_total", finished_reason=reason))
        for reason in ("stop", "length", "abort")
    }
    print(
        f"\nSOAK: requests={tally.requests} completed={tally.completed} disconnected={tally.disconnected} "
        f"errors={len(tally.errors)} preemptions={preemptions} leaked_blocks={leaked} "
        f"seconds={seconds:.1f} clients={NUM_CLIENTS} completion_tokens={tally.completion_tokens} "
        f"server_finished={finished} seed={SEED}"
    )
    assert not tally.errors, f"{len(tally.errors)} errors, the first ones:\n" + "\n".join(tally.errors[:10])
    assert tally.requests == tally.completed + tally.disconnected
    assert tally.completed > 0 and tally.disconnected > 0 and preemptions > 0
    # The engine: idle, every block free, the full integrity check passes, no request left in any table.
    assert leaked == 0 and metric(m, "kv_cache_usage_perc") == 0.0, state
    assert state["ok"], state
    assert state["num_requests"] == state["num_requests_holding_blocks"] == 0, state
    assert state["num_frontend_requests"] == state["num_output_processor_requests"] == 0, state
    assert state["num_integrity_failures"] == 0 and metric(m, "integrity_check_failures_total") == 0, state
    # Every sequence a client saw to its end finished normally in the engine; every finished sequence was sent.
    assert finished["stop"] + finished["length"] >= tally.completed_seqs
    assert sum(finished.values()) <= tally.sent_seqs
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()
