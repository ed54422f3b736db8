"""Bad input, access control and a schema-driven fuzz run against the shared server (see conftest.py).

Every bad request gets a 400 in OpenAI's shape naming the field; nothing gets a 5xx; the server keeps serving.
"""

from __future__ import annotations

import collections
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.server_utils import API_KEY

# --------------------------------------------------------------------------------- auth, model, errors


def test_api_key(server, model):
    url = server.base_url + "/v1/completions"
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Bearer {API_KEY}x"},
    ):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.post(url, json=body, headers=server.headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()
    # Health, version and metrics stay open.
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.base_url + path).status_code == 200


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


_COMPLETION_BAD = [
    (b"{not json", None),
    (b'{"prompt": "a", "max_tokens": 3', None),
    (b'{"prompt": "\xff\xfe"}', None),
    (b"[1, 2]", None),
    (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": [1, 400]}', "prompt"),
    (b'{"prompt": [1, -1]}', "prompt"),
    (b'{"prompt": [[1, 2], [3, 100000]]}', "prompt[1]"),
    (b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": -5}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 100000}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "a", "n": 0}', "n"),
    (b'{"prompt": "a", "n": "two"}', "n"),
    (b'{"prompt": "a", "temperature": -0.5}', "temperature"),
    (b'{"prompt": "a", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "a", "top_p": 0}', "top_p"),
    (b'{"prompt": "a", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "a", "top_k": -2}', "top_k"),
    (b'{"prompt": "a", "min_p": 2}', "min_p"),
    (b'{"prompt": "a", "presence_penalty": 3}', "presence_penalty"),
    (b'{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
    (b'{"prompt": "a", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "a", "logprobs": -1}', "logprobs"),
    (b'{"prompt": "a", "stop": [1, 2]}', "stop"),
    (b'{"prompt": "a", "stop": ""}', "stop"),
    (
        b'{"prompt": "a", "stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}',
        "stop",
    ),
    (b'{"prompt": "a", "seed": "x"}', "seed"),
    (b'{"prompt": "a", "logit_bias": {"x": 1}}', "logit_bias"),
    (b'{"prompt": "a", "logit_bias": {"100000": 1}}', "logit_bias"),
    (b'{"prompt": "a", "stream": "yes please"}', "stream"),
    (b'{"prompt": "a", "suffix": "b"}', "suffix"),
    (b'{"prompt": "a", "stream_options": {"include_usage": true}}', "stream_options"),
]

_CHAT_BAD = [
    (b'{"messages": []}', "messages"),
    (b"{}", "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (
        # an image sent to a text-only model
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        "messages[0].content[0].image_url",
    ),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 50}',
        "top_logprobs",
    ),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
        "max_completion_tokens",
    ),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": -1}', "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [null]}', "stop"),
]


@pytest.mark.parametrize(
    "path,body,param",
    [("/v1/completions", b, p) for b, p in _COMPLETION_BAD]
    + [("/v1/chat/completions", b, p) for b, p in _CHAT_BAD],
)
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    r = httpx.post(
        server.base_url + path, content=body, headers={**server.headers, "content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_prompt_over_context(client, model):
    long_prompt = [5] * 600  # 600 tokens > max_model_len 512
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=long_prompt, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    assert "512" in e.value.body["message"] and "600" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5] * 500, max_tokens=20)
    message = e.value.body["message"]
    assert (
        e.value.body["param"] == "max_tokens" and "512" in message and "520" in message and "500" in message
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.body["param"] == "messages"


def test_oversize_body(server):
    body = json.dumps({"prompt": "x" * 70000}).encode()  # the server allows 65536 bytes
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={**server.headers, "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "65536" in r.json()["error"]["message"]
    # The server keeps serving.
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_unknown_route(server):
    r = httpx.get(server.base_url + "/v1/nothing-here", headers=server.headers)
    assert r.status_code == 404 and "error" in r.json()
    # Debug endpoints exist only with --enable-debug-endpoints.
    assert httpx.get(server.base_url + "/debug/integrity", headers=server.headers).status_code == 404
    for path in ("/sleep", "/wake_up", "/reset_prefix_cache", "/collective_rpc"):
        assert httpx.post(server.base_url + path, headers=server.headers).status_code == 404, path
    assert httpx.get(server.base_url + "/is_sleeping", headers=server.headers).status_code == 404


# ------------------------------------------------------------------------------------------- fuzzing

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_ANY_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_SMALL_TOKENS = st.integers(-3, 6)
_PLAUSIBLE = {
    "prompt": st.one_of(
        st.text(max_size=24),
        st.lists(st.integers(-3, 420), max_size=8),
        st.lists(st.text(max_size=8), max_size=3),
        st.lists(st.lists(st.integers(0, 399), min_size=1, max_size=4), max_size=3),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                "content": st.one_of(
                    st.text(max_size=16),
                    st.lists(
                        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                        max_size=2,
                    ),
                    _ANY_JSON,
                ),
            }
        ),
        max_size=3,
    ),
    "max_tokens": _SMALL_TOKENS,
    "max_completion_tokens": _SMALL_TOKENS,
    "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 50),
    "min_p": st.floats(-0.5, 1.5),
    "logprobs": st.one_of(st.integers(-2, 25), st.booleans()),
    "top_logprobs": st.integers(-2, 25),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20)),
    "seed": st.integers(-10, 2**63),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(
        st.text(max_size=4) | st.integers(-5, 500).map(str), st.floats(-150, 150), max_size=3
    ),
    "stop_token_ids": st.lists(st.integers(-5, 500), max_size=3),
    "min_tokens": st.integers(-2, 8),
}
# Fields whose JSON null or absence would let a request generate up to the whole context: always bounded.
_BOUNDED = {"max_tokens", "max_completion_tokens"}


def _fields(openapi: dict, schema_name: str) -> list[str]:
    return sorted(set(openapi["components"]["schemas"][schema_name]["properties"]) - {"model"})


def _value(name: str):
    plausible = _PLAUSIBLE.get(name, _ANY_JSON)
    if name in _BOUNDED:
        return st.one_of(plausible, st.text(max_size=4), st.floats(allow_nan=False, allow_infinity=False))
    return st.one_of(plausible, plausible, _ANY_JSON)


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    return httpx.get(server.base_url + "/openapi.json").json()


def _check_response(r: httpx.Response, body: dict | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body)
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if body is not None and body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
        for event in r.text.split("\n\n")[:-2]:
            payload = json.loads(event[len("data: ") :])
            assert "error" not in payload, payload
    else:
        assert r.json()["choices"]


FUZZ_STATS: collections.Counter = collections.Counter()


@pytest.mark.parametrize(
    "path,schema",
    [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")],
)
def test_fuzz_from_openapi_schema(server, openapi, path, schema):
    fields = _fields(openapi, schema)
    required = set(openapi["components"]["schemas"][schema].get("required", []))
    assert required <= set(fields) | {"model"}
    # A valid base request, then up to 4 fields (from the schema) set to plausible or arbitrary JSON values.
    if schema == "ChatCompletionRequest":
        message = st.fixed_dictionaries(
            {"role": st.just("user"), "content": st.text(min_size=1, max_size=16)}
        )
        base = st.fixed_dictionaries(
            {"messages": st.lists(message, min_size=1, max_size=2), "max_tokens": st.integers(1, 6)}
        )
    else:
        prompt = st.text(min_size=1, max_size=24) | st.lists(st.integers(0, 399), min_size=1, max_size=8)
        base = st.fixed_dictionaries({"prompt": prompt, "max_tokens": st.integers(1, 6)})
    field = st.sampled_from(fields).flatmap(lambda name: st.tuples(st.just(name), _value(name)))
    bodies = st.tuples(base, st.lists(field, max_size=4)).map(lambda t: {**t[0], **dict(t[1])})

    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies)
        def run(body: dict) -> None:
            r = http.post(path, json=body)
            FUZZ_STATS[(path, r.status_code)] += 1
            _check_response(r, body)

        run()

        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(raw=st.binary(max_size=64))
        def run_raw(raw: bytes) -> None:
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            FUZZ_STATS[(path, "raw", r.status_code)] += 1
            _check_response(r, None)

        run_raw()
    print(f"\nfuzz {path}: {dict(sorted((str(k), v) for k, v in FUZZ_STATS.items() if k[0] == path))}")
    assert httpx.get(server.base_url + "/health").status_code == 200
