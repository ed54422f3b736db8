"""`pagedllm serve` with a LLaVA model and the official openai client: images as data URLs (one and several per
message) give what the offline engine gives; bad images are 400s in OpenAI's error shape naming the field, and the
server keeps serving."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import RemoteServer, metric
from tests.utils import tiny_image


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _message(*images, text: str = "what is in the picture") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(img)}} for img in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def server(tiny_llava, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("mm_server") / "server.log"
    srv = RemoteServer(tiny_llava, log_path, extra_args=["--limit-mm-per-prompt", '{"image": 2}'])
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def test_chat_with_data_url_images_equals_offline(server, tiny_llava) -> None:
    client = server.openai_client()
    cases = [(tiny_image(41),), (tiny_image(42), tiny_image(43, (25, 60)))]
    with LLM(tiny_llava, device="cpu", dtype="float32", enforce_eager=True) as llm:
        expected = [
            llm.chat(_message(*imgs), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
            for imgs in cases
        ]
    for imgs, exp in zip(cases, expected):
        resp = client.chat.completions.create(
            model=tiny_llava, messages=_message(*imgs), max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert resp.choices[0].message.content == exp.outputs[0].text
        assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)


@pytest.mark.parametrize(
    "content, param",
    [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
         "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}],
         "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": data_url(tiny_image(i))}} for i in range(3)],
         "messages[0].content[2].image_url.url"),
    ],
)  # fmt: skip
def test_bad_images_are_400s_and_the_server_keeps_serving(server, tiny_llava, content, param) -> None:
    body = {"model": tiny_llava, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = server.openai_client().chat.completions.create(model=tiny_llava, messages=_message(tiny_image(1)), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_bench_serve_random_mm_against_the_server(server, tiny_llava, tmp_path) -> None:
    """`pagedllm bench serve --dataset-name random-mm` drives the chat endpoint with images: every request
    succeeds and returns its asked output length."""
    import json

    from tests.benchmarks.test_serve_bench import _bench

    result = tmp_path / "mm.json"
    _bench(
        server, tiny_llava, "--backend", "openai-chat", "--dataset-name", "random-mm", "--num-prompts", "4",
        "--random-input-len", "8", "--random-output-len", "3", "--random-mm-base-items-per-request", "1",
        "--random-mm-bucket-config", "{(28, 28, 1): 1.0}", "--random-mm-num-unique-images", "2",
        "--disable-tqdm", "--save-result", "--result-filename", str(result),
    )  # fmt: skip
    data = json.loads(result.read_text())
    assert data["completed"] == 4
    assert data["total_output_tokens"] == 12


def test_encoder_cache_counters_on_metrics(server, tiny_llava) -> None:
    """A chat request with an image not seen before is one encoder-cache query and no hit; the processor cache
    (`pagedllm:mm_cache_*`, vLLM's `vllm:mm_cache_*`) counts one query and no hit, then a hit when the same data URL
    comes again."""
    before = server.wait_idle()
    assert "pagedllm:encoder_cache_queries_total" in httpx.get(server.base_url + "/metrics", timeout=10).text
    server.openai_client().chat.completions.create(
        model=tiny_llava, messages=_message(tiny_image(77, (33, 21))), max_tokens=2
    )
    after = server.wait_idle()
    assert metric(after, "encoder_cache_queries_total") - metric(before, "encoder_cache_queries_total") == 1
    assert metric(after, "encoder_cache_hits_total") == metric(before, "encoder_cache_hits_total")
    assert metric(after, "mm_cache_queries_total") - metric(before, "mm_cache_queries_total") == 1
    assert metric(after, "mm_cache_hits_total") == metric(before, "mm_cache_hits_total")
    server.openai_client().chat.completions.create(
        model=tiny_llava, messages=_message(tiny_image(77, (33, 21))), max_tokens=2
    )
    again = server.wait_idle()
    assert metric(again, "mm_cache_queries_total") - metric(after, "mm_cache_queries_total") == 1
    assert metric(again, "mm_cache_hits_total") - metric(after, "mm_cache_hits_total") == 1
