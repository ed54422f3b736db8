"""Pooling endpoints of `pagedllm serve` against sentence-transformers / transformers: /v1/embeddings (the
official openai client), /pooling, /classify, /score, /rerank (httpx); bad input is a 400 in OpenAI's shape
naming the field; generation endpoints refuse a pooling model and /v1/embeddings a generator."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.server_utils import RemoteServer
from tests.pooling.pooling_utils import (
    TEXTS,
    assert_close,
    hf_classifier_logits,
    make_classifier,
    make_st_embedder,
    st_embed_ref,
)

BUDGET = "80"


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool_server")
    path = make_st_embedder("bert", root / "bert", "mean")
    srv = RemoteServer(path, root / "embed.log", extra_args=["--max-num-batched-tokens", BUDGET])
    srv.model_path = path
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank_server")
    path = make_classifier("xlm-roberta", root / "xlmr", num_labels=1)
    srv = RemoteServer(path, root / "rerank.log", extra_args=["--max-num-batched-tokens", BUDGET])
    srv.model_path = path
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def _post(srv: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=srv.headers, timeout=60.0)


def _bad(srv: RemoteServer, path: str, body: dict, param: str | None) -> str:
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


def test_embeddings_openai_client(embed_server) -> None:
    client = embed_server.openai_client()
    model = embed_server.model_path
    ref = st_embed_ref(model, TEXTS)
    for encoding_format in ("float", "base64"):
        resp = client.embeddings.create(model=model, input=TEXTS, encoding_format=encoding_format)
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        if encoding_format == "base64":  # asked for explicitly, the client hands the string over as it is
            rows = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").copy() for d in resp.data]
        else:
            rows = [d.embedding for d in resp.data]
        assert_close(torch.tensor(np.array(rows)), ref)
    tok = httpx.post(
        embed_server.base_url + "/tokenize", json={"prompt": TEXTS[1]}, headers=embed_server.headers
    )
    ids = tok.json()["tokens"]
    one = client.embeddings.create(model=model, input=TEXTS[1])  # the client's default: base64
    assert_close(torch.tensor([one.data[0].embedding]), ref[1:2])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert_close(torch.tensor([by_ids.data[0].embedding]), ref[1:2])
    by_lists = client.embeddings.create(model=model, input=[ids, ids[:5]], encoding_format="float")
    assert len(by_lists.data) == 2 and by_lists.usage.prompt_tokens == len(ids) + 5
    raw = _post(embed_server, "/v1/embeddings", {"model": model, "input": TEXTS[0]}).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == model


def test_embeddings_bad_input(embed_server) -> None:
    client = embed_server.openai_client()
    model = embed_server.model_path
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input=TEXTS[0], dimensions=16)
    assert e.value.body["param"] == "dimensions" and "Matryoshka" in e.value.body["message"]
    for bad in ("", [], [""], [[]], ["a", [1, 2]], ["a", 5], [[1, 2], 3], {"x": 1}, [1, 10**6]):
        message = _bad(embed_server, "/v1/embeddings", {"model": model, "input": bad}, "input")
        if bad in (["a", [1, 2]], ["a", 5], [[1, 2], 3]):
            assert "mix" in message
    _bad(embed_server, "/v1/embeddings", {"model": model}, "input")
    long_text = " ".join(TEXTS * 2)
    message = _bad(embed_server, "/v1/embeddings", {"model": model, "input": [TEXTS[0], long_text]}, "input")
    assert "truncate_prompt_tokens" in message
    resp = client.embeddings.create(
        model=model, input=long_text, encoding_format="float", extra_body={"truncate_prompt_tokens": 12}
    )
    assert resp.usage.prompt_tokens == 12
    _bad(
        embed_server,
        "/v1/embeddings",
        {"model": model, "input": "a", "truncate_prompt_tokens": 0},
        "truncate_prompt_tokens",
    )
    _bad(
        embed_server,
        "/v1/embeddings",
        {"model": model, "input": "a", "encoding_format": "int8"},
        "encoding_format",
    )
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")


def test_pooling_and_score_on_embedder(embed_server) -> None:
    model = embed_server.model_path
    ref = st_embed_ref(model, TEXTS[:3])
    r = _post(embed_server, "/pooling", {"model": model, "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["object"] == "pooling" and len(r.json()["data"][1]["data"]) == 64
    for path in ("/score", "/v1/score"):
        r = _post(embed_server, path, {"model": model, "text_1": TEXTS[0], "text_2": TEXTS[1:3]})
        assert r.status_code == 200, r.text
        scores = torch.tensor([d["score"] for d in r.json()["data"]])
        expected = torch.nn.functional.cosine_similarity(ref[:1], ref[1:3], dim=-1)
        assert torch.allclose(scores, expected, atol=1e-5, rtol=0)
    _bad(embed_server, "/score", {"model": model, "text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "text_1")
    _bad(embed_server, "/score", {"model": model, "text_1": "a"}, "text_2")
    _bad(embed_server, "/classify", {"model": model, "input": "a"}, "model")
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "a"}]}),
    ):
        assert "pooling model" in _bad(embed_server, path, body, "model")


def test_rerank_and_classify(rerank_server) -> None:
    model = rerank_server.model_path
    query, docs = TEXTS[1], [TEXTS[0], TEXTS[2], TEXTS[4], TEXTS[5]]
    ref = torch.sigmoid(hf_classifier_logits(model, [query] * len(docs), docs))[:, 0]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(rerank_server, path, {"model": model, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == torch.argsort(ref, descending=True).tolist()
        for x in results:
            assert abs(x["relevance_score"] - ref[x["index"]].item()) < 1e-5
            assert x["document"]["text"] == docs[x["index"]]
        assert r.json()["usage"]["total_tokens"] > 0
    r = _post(
        rerank_server,
        "/rerank",
        {"model": model, "query": query, "documents": docs, "top_n": 2, "return_documents": False},
    )
    results = r.json()["results"]
    assert len(results) == 2 and "document" not in results[0]
    r = _post(rerank_server, "/score", {"model": model, "text_1": query, "text_2": docs})
    scores = torch.tensor([d["score"] for d in r.json()["data"]])
    assert torch.allclose(scores, ref, atol=1e-5, rtol=0)
    r = _post(rerank_server, "/classify", {"model": model, "input": TEXTS[:3]})
    assert r.status_code == 200, r.text
    probs = torch.tensor([d["probs"] for d in r.json()["data"]])
    assert torch.allclose(probs, torch.sigmoid(hf_classifier_logits(model, TEXTS[:3])), atol=1e-5, rtol=0)
    _bad(rerank_server, "/rerank", {"model": model, "query": query, "documents": []}, "documents")
    _bad(rerank_server, "/rerank", {"model": model, "query": "", "documents": docs}, "query")
    _bad(rerank_server, "/rerank", {"model": model, "query": query, "documents": docs, "top_n": -1}, "top_n")
    _bad(rerank_server, "/v1/embeddings", {"model": model, "input": "a"}, "model")
    message = _bad(
        rerank_server, "/rerank", {"model": model, "query": query, "documents": [TEXTS[3] * 2]}, "documents"
    )
    assert "truncate_prompt_tokens" in message
    r = _post(
        rerank_server,
        "/rerank",
        {"model": model, "query": query, "documents": [TEXTS[3] * 2], "truncate_prompt_tokens": 40},
    )
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 40, r.text


def test_embeddings_on_generator_is_400(server, model) -> None:
    message = _bad(server, "/v1/embeddings", {"model": model, "input": "a"}, "model")
    assert "generates text" in message
    _bad(server, "/rerank", {"model": model, "query": "a", "documents": ["b"]}, "model")


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 500)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(params=["embed", "rerank"])
def any_server(request):
    return request.getfixturevalue(f"{request.param}_server")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/embeddings", "/pooling", "/classify", "/score", "/rerank"]),
    body=st.dictionaries(
        st.sampled_from(
            [
                "input",
                "text_1",
                "text_2",
                "query",
                "documents",
                "top_n",
                "dimensions",
                "encoding_format",
                "truncate_prompt_tokens",
                "normalize",
            ]
        ),
        _JSON,
        max_size=4,
    ),
)
def test_fuzzed_bodies_never_5xx(any_server, path, body) -> None:
    """Whatever the fields hold, the answer is a 200 or a 400 in OpenAI's shape, never a server error."""
    r = _post(any_server, path, body)
    assert r.status_code in (200, 400), (body, r.text)
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
