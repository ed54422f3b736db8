"""LoRA adapters through the OpenAI server (the official `openai` client): a request's ``model`` selects an
adapter by name, ``/v1/models`` lists adapters with their parent, runtime load/unload (allowed here, absent on
the shared server), unknown names 404, bad adapters 400.

One server for the module: tiny Llama, ``--enable-lora --max-loras 2`` with two adapters from
``--lora-modules`` and ``--allow-runtime-lora-updating``.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedllm import SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.entrypoints.server_utils import RemoteServer
from tests.lora.lora_utils import adapter_kwargs, make_peft_adapter

PROMPTS = ["def fibonacci(n):", "class Point:"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_loras")
    kwargs = adapter_kwargs("llama")
    return {
        name: make_peft_adapter(tiny_llama, root / name, seed=i + 1, **kwargs[name])
        for i, name in enumerate(("attn", "all", "rs"))
    }


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapters, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("lora_server") / "server.log"
    srv = RemoteServer(
        tiny_llama,
        log_path,
        extra_args=[
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
            "--lora-modules", f"attn={adapters['attn']}", f'{{"name": "all", "path": "{adapters["all"]}"}}',
        ],
    )  # fmt: skip
    yield srv
    code = srv.stop()
    log = srv.log()
    assert code == 0, log
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return lora_server.openai_client()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from pagedllm import LLM

    return LLM(
        tiny_llama,
        dtype="float32",
        device="cpu",
        block_size=16,
        kv_cache_memory_bytes=4 << 20,
        enable_lora=True,
        max_loras=3,
    )


def expected_texts(llm, adapters, name: str | None) -> list[str]:
    lora = None if name is None else LoRARequest(name, {"attn": 1, "all": 2, "rs": 3}[name], adapters[name])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)]


def complete(client, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert out.model == model
    return [c.text for c in out.choices]


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=60.0)


def test_models_lists_adapters_with_parent(lora_client, tiny_llama, adapters):
    data = {m.id: m for m in lora_client.models.list().data}
    assert list(data) == [tiny_llama, "attn", "all"]
    assert data[tiny_llama].model_extra["parent"] is None
    for name in ("attn", "all"):
        assert data[name].model_extra["parent"] == tiny_llama
        assert data[name].model_extra["root"] == adapters[name]


def test_model_name_selects_adapter(lora_client, tiny_llama, adapters, llm):
    base = complete(lora_client, tiny_llama)
    assert base == expected_texts(llm, adapters, None)
    outputs = {None: base}
    for name in ("attn", "all"):
        outputs[name] = complete(lora_client, name)
        assert outputs[name] == expected_texts(llm, adapters, name), name
    assert len({tuple(v) for v in outputs.values()}) == 3  # the adapters change the text
    # chat too, and streaming: the same tokens as the offline API with that adapter
    messages = [{"role": "user", "content": "a loop"}]
    lora = LoRARequest("attn", 1, adapters["attn"])
    exp = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), lora_request=lora, use_tqdm=False
    )
    out = lora_client.chat.completions.create(
        model="attn", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.model == "attn"
    assert out.choices[0].message.content == exp[0].outputs[0].text
    chunks = lora_client.completions.create(
        model="all", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(chunks)
    assert all(c.model == "all" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == outputs["all"][0]


def test_unknown_model_404(lora_server, lora_client):
    with pytest.raises(openai.NotFoundError) as e:
        lora_client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    r = post(lora_server, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "model"


def test_runtime_load_and_unload(lora_server, lora_client, tiny_llama, adapters, llm):
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": adapters["rs"]})
    assert r.status_code == 200, r.text
    assert [m.id for m in lora_client.models.list().data] == [tiny_llama, "attn", "all", "rs"]
    assert complete(lora_client, "rs") == expected_texts(llm, adapters, "rs")
    # three adapters over two slots, at once: each request still gets its own adapter's output
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {n: pool.submit(complete, lora_client, n) for n in ("attn", "all", "rs", tiny_llama)}
    for name, fut in futures.items():
        assert fut.result() == expected_texts(llm, adapters, None if name == tiny_llama else name), name

    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": adapters["rs"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs"})
    assert r.status_code == 200, r.text
    assert "rs" not in [m.id for m in lora_client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        lora_client.completions.create(model="rs", prompt="x", max_tokens=2)
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    # loaded again under the same name: a fresh id, the same output
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "rs", "lora_path": adapters["rs"]})
    assert r.status_code == 200, r.text
    assert complete(lora_client, "rs") == expected_texts(llm, adapters, "rs")
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rs"}).status_code == 200


def test_bad_adapter_400(lora_server, lora_client, tiny_llama, tmp_path):
    cases = [
        ({"lora_name": "missing", "lora_path": str(tmp_path / "nowhere")}, "lora_path", "not a directory"),
        ({"lora_name": "x"}, "lora_path", "lora_path"),
        ({"lora_path": str(tmp_path)}, "lora_name", "lora_name"),
        ({"lora_name": tiny_llama, "lora_path": str(tmp_path)}, "lora_name", "already been loaded"),
    ]
    embed = make_peft_adapter(
        tiny_llama, tmp_path / "embed", seed=9, r=4, lora_alpha=4, target_modules=["embed_tokens"]
    )
    cases.append(({"lora_name": "embed", "lora_path": embed}, "lora_path", "embedding LoRA is not supported"))
    for body, param, message in cases:
        r = post(lora_server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    assert [m.id for m in lora_client.models.list().data] == [tiny_llama, "attn", "all"]
    assert complete(lora_client, "attn")  # serving goes on


def test_runtime_updating_not_allowed(server):
    """The shared server (no --allow-runtime-lora-updating, no LoRA): the routes do not exist."""
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = post(server, path, {"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
