"""Images from users: chat parts (image_url data / http / file URLs, image_pil), the per-prompt limit, and every bad
input as a ValueError naming its field, leaving no KV block or encoder cache entry behind. Plus the encoder cache
manager's bookkeeping and the combinations a multimodal model refuses."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.media import MediaConnector
from tests.utils import tiny_image

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=96, enforce_eager=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def png_bytes(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(png_bytes(image, fmt)).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    payloads: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.payloads.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    _Images.payloads = {"/cat.png": png_bytes(tiny_image(31)), "/big.png": png_bytes(tiny_image(32, (300, 300)))}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("media")
    tiny_image(33).save(d / "local.png")
    return str(d)


@pytest.fixture(scope="module")
def llm(tiny_llava: str, media_dir: str):
    with LLM(tiny_llava, limit_mm_per_prompt={"image": 2}, allowed_local_media_path=media_dir, **ENGINE) as engine:
        yield engine


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def _url(u: str) -> dict:
    return {"type": "image_url", "image_url": {"url": u}}


def _assert_clean(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert not core.scheduler.requests
    core.scheduler.check_integrity()
    enc = core.scheduler.encoder_cache
    assert not enc.cached and enc.num_free_slots + enc.num_freeable_slots == enc.cache_size


def test_chat_image_parts_equal_generate(llm: LLM, image_server: str, media_dir: str) -> None:
    """image_url (data PNG / JPEG / WebP, http, file) and image_pil parts give what generate gives for the same
    image placed where vLLM places it (its placeholder before the message's text)."""
    img = tiny_image(31)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<image>\ndescribe it"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expected = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    expected_ids = expected[0].outputs[0].token_ids
    for part in (_url(data_url(img)), {"type": "image_pil", "image_pil": img}, _url(f"{image_server}/cat.png")):
        out = llm.chat(_user(part, _text("describe it")), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected_ids, part
    local = llm.chat(_user(_url(f"file://{media_dir}/local.png"), _text("describe it")), GREEDY, use_tqdm=False)
    assert local[0].prompt_token_ids == expected[0].prompt_token_ids  # another image, the same placeholders
    for fmt in ("JPEG", "WEBP"):  # lossy: decodes and runs
        llm.chat(_user(_url(data_url(img, fmt)), _text("describe it")), GREEDY, use_tqdm=False)
    two = llm.chat(_user(_url(data_url(tiny_image(1))), _url(data_url(tiny_image(2))), _text("compare")), GREEDY,
                   use_tqdm=False)[0]  # fmt: skip
    assert two.prompt_token_ids.count(tok.convert_tokens_to_ids("<image>")) == 32
    _assert_clean(llm)


def test_preprocessed_images_give_the_same_prompt_and_features(llm: LLM) -> None:
    """A server preprocesses chat images in a worker thread (``load_chat_images(..., preprocess=True)``):
    ``PreprocessedImage``s expand the prompt and key the caches exactly as the PIL images do, mixed with PIL images
    too, and generate the same tokens. A bad image fails there with its own field named."""
    from pagedllm.engine.input_processor import ChatImage
    from pagedllm.multimodal.processing import PreprocessedImage

    ip = llm.llm_engine.input_processor
    tok = llm.get_tokenizer()
    ids = tok("<image> and <image> compared", add_special_tokens=False)["input_ids"]
    images = [tiny_image(5), tiny_image(6, (25, 60))]
    parts = [ChatImage(f"messages[0].content[{i}].image_url.url", data_url(img)) for i, img in enumerate(images)]
    pre = ip.load_chat_images(parts, preprocess=True)
    assert all(isinstance(p, PreprocessedImage) for p in pre)
    want_ids, want = ip.process_multi_modal_data(ids, {"image": images})
    for given in (pre, [images[0], pre[1]]):
        got_ids, got = ip.process_multi_modal_data(ids, {"image": given})
        assert got_ids == want_ids
        assert [(f.mm_hash, f.offset, f.length) for f in got] == [(f.mm_hash, f.offset, f.length) for f in want]
    outs = [
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": given}}, GREEDY, use_tqdm=False)
        for given in (images, pre)
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    bad = [parts[0], ChatImage("messages[0].content[1].image_url.url", "data:image/png;base64,bm90IGFuIGltYWdl")]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.image_url\.url: .*cannot decode"):
        ip.load_chat_images(bad, preprocess=True)
    _assert_clean(llm)


def test_processor_cache_serves_a_repeated_data_url(llm: LLM, tiny_llava: str) -> None:
    """A data URL seen before skips the image processor (the same ``PreprocessedImage``); other images and fetched
    URLs are processed; the cache keeps at most ``mm_processor_cache_gb`` of arrays (least recently used out), and
    0 turns it off."""
    from pagedllm.engine.input_processor import ChatImage
    from pagedllm.multimodal.processing import PreprocessedImage, ProcessorCache

    ip = llm.llm_engine.input_processor
    cache = ip.processor_cache
    assert cache is not None and cache.max_bytes == 4 * 2**30  # vLLM's default, 4 GiB
    url = data_url(tiny_image(71))
    first = ip.load_chat_images([ChatImage("f", url)], preprocess=True)[0]
    queries, hits = cache.queries, cache.hits
    again, other = ip.load_chat_images([ChatImage("f", url), ChatImage("g", data_url(tiny_image(72)))], preprocess=True)
    assert again is first and other.mm_hash != first.mm_hash
    assert (cache.queries - queries, cache.hits - hits) == (2, 1)
    size = sum(v.nbytes for v in first.data.values())
    small = ProcessorCache(2 * size)
    items = {k: PreprocessedImage(first.data, k) for k in "abc"}
    for k in "ab":
        small.put(k, items[k])
    assert small.get("a") is items["a"]  # now b is the least recently used
    small.put("c", items["c"])
    assert small.get("b") is None and small.get("a") is items["a"] and len(small) == 2 and small.num_bytes == 2 * size
    ProcessorCache(size - 1).put("x", items["a"])  # larger than the whole cache: not kept (no error)
    with LLM(tiny_llava, mm_processor_cache_gb=0, **ENGINE) as off:
        assert off.llm_engine.input_processor.processor_cache is None
        assert off.chat(_user(_url(url), _text("x")), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        LLM(tiny_llava, mm_processor_cache_gb=-1, **ENGINE)
    import argparse

    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, gb in (([], 4.0), (["--mm-processor-cache-gb", "0.5"], 0.5)):  # `pagedllm serve`'s flag
        config = make_engine_config(tiny_llava, **{**engine_kwargs_from_args(parser.parse_args(argv)), "device": "cpu"})
        assert config.model_config.mm_processor_cache_gb == gb


@pytest.mark.parametrize(
    "parts, field, why",
    [
        ((_url("data:image/png;base64,bm90IGFuIGltYWdl"), _text("x")), "messages[0].content[0].image_url.url", "cannot decode"),
        ((_url("data:image/png;base64,%%%"), _text("x")), "messages[0].content[0].image_url.url", "not valid base64"),
        ((_text("x"), _url("http://127.0.0.1:9/nothing.png")), "messages[0].content[1].image_url.url", "could not fetch"),
        ((_url("file:///etc/hostname"),), "messages[0].content[0].image_url.url", "outside the allowed"),
        ((_url("ftp://host/x.png"),), "messages[0].content[0].image_url.url", "unsupported URL scheme"),
        (tuple(_url(data_url(tiny_image(i))) for i in range(3)), "messages[0].content[2].image_url.url", "limit_mm_per_prompt"),
        (({"type": "audio_url", "audio_url": {"url": "x"}},), "messages[0].content[0]", "must be"),
    ],
)  # fmt: skip
def test_bad_chat_images_are_value_errors(llm: LLM, parts, field: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(field)}.*{why}"):
        llm.chat(_user(*parts), GREEDY, use_tqdm=False)
    _assert_clean(llm)


def test_bad_prompts_are_value_errors(llm: LLM, image_server: str) -> None:
    img = tiny_image(1)
    cases = [
        ({"prompt": "no placeholder here", "multi_modal_data": {"image": img}}, "multi_modal_data.image: the prompt has 0"),
        ({"prompt": "<image> and <image>", "multi_modal_data": {"image": img}}, "multi_modal_data.image: the prompt has 2"),
        ({"prompt": "<image>" * 3, "multi_modal_data": {"image": [img] * 3}}, "multi_modal_data.image: 3 images"),
        ({"prompt": "<image>", "multi_modal_data": {"video": img}}, "multi_modal_data: unsupported modalities"),
        ({"prompt": "<image>", "multi_modal_data": {"image": f"{image_server}/missing.png"}},
         r"multi_modal_data.image\[0\]: could not fetch"),
        ({"prompt": "<image>", "multi_modal_data": {"image": 42}}, r"multi_modal_data.image\[0\] must be"),
    ]  # fmt: skip
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    # A good request still runs afterwards, and nothing leaked.
    llm.generate({"prompt": "<image> ok", "multi_modal_data": {"image": f"{image_server}/cat.png"}}, GREEDY,
                 use_tqdm=False)  # fmt: skip
    _assert_clean(llm)


def test_beam_search_refuses_images(llm: LLM) -> None:
    from pagedllm.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="^multi_modal_data: beam search"):
        llm.beam_search([{"prompt": "<image>", "multi_modal_data": {"image": tiny_image(1)}}], BeamSearchParams(beam_width=2, max_tokens=3))


def test_fetch_size_cap(image_server: str) -> None:
    small = MediaConnector(max_bytes=1000)
    with pytest.raises(ValueError, match=r"^f: the image is larger than the 1000-byte limit"):
        small.load_image(f"{image_server}/big.png", "f")
    with pytest.raises(ValueError, match=r"^f: the image is larger"):
        small.load_image(data_url(tiny_image(32, (300, 300))), "f")
    assert MediaConnector().load_image(f"{image_server}/big.png", "f").size == (300, 300)


def test_text_only_model_refuses_images(tiny_llama: str) -> None:
    with LLM(tiny_llama, **ENGINE) as text_llm:
        with pytest.raises(ValueError, match="^multi_modal_data: .* text-only"):
            text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": tiny_image(1)}}, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"^messages\[0\].content\[0\].image_url: this model is text-only"):
            text_llm.chat(_user(_url(data_url(tiny_image(1))), _text("x")), GREEDY, use_tqdm=False)
        assert not text_llm.llm_engine.engine_core.scheduler.requests


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(speculative_config={"model": "DRAFT", "num_speculative_tokens": 2}), "speculative_config"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
        (dict(kv_transfer_config={"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": 1}), "kv_transfer_config"),
    ],
)  # fmt: skip
def test_unsupported_combinations_are_refused(tiny_llava: str, kwargs: dict, name: str) -> None:
    if "speculative_config" in kwargs:  # a draft model (here the checkpoint itself): only n-gram drafts run
        kwargs = {"speculative_config": {**kwargs["speculative_config"], "model": tiny_llava}}
    with pytest.raises(ValueError, match=rf"^{name}.*multimodal"):
        make_engine_config(tiny_llava, device="cpu", **kwargs)


def test_limit_mm_per_prompt_is_checked(tiny_llava: str) -> None:
    with pytest.raises(ValueError, match="^limit_mm_per_prompt"):
        make_engine_config(tiny_llava, device="cpu", limit_mm_per_prompt={"video": 1})


def test_encoder_cache_manager_refs_and_frees() -> None:
    def feature(h: str, n: int, offset: int = 0) -> MultiModalFeature:
        return MultiModalFeature("image", h, offset, n)

    cache = EncoderCacheManager(10)
    a, b = feature("a", 6), feature("b", 6)
    cache.add_ref("r1", a)
    cache.add_ref("r2", a)  # shared: no more room taken
    assert cache.num_free_slots == 4 and not cache.can_allocate(b)
    cache.release_request("r1", [a])
    assert cache.has("a") and cache.take_freed() == []
    cache.release_computed("r2", [feature("a", 6, offset=0)], num_computed=5)  # not past it yet
    assert cache.has("a")
    cache.release_computed("r2", [a], num_computed=6)
    # unused now, but kept (freeable) until a new image needs its room
    assert cache.has("a") and cache.take_freed() == [] and cache.num_free_slots == 4 and cache.room() == 10
    cache.add_ref("r3", a)  # reused: a hit, nothing encoded
    assert cache.num_hits == 2 and cache.num_queries == 3 and cache.num_free_slots == 4
    cache.release_request("r3", [a])
    cache.add_ref("r3", b)  # needs a's room: a is evicted
    assert not cache.has("a") and cache.take_freed() == ["a"] and cache.num_free_slots == 4
    cache.check_integrity({"r3"})
    with pytest.raises(AssertionError):
        cache.check_integrity(set())


def test_encoder_cache_evicts_least_recently_released_and_never_a_pinned_entry() -> None:
    def feature(h: str, n: int = 4) -> MultiModalFeature:
        return MultiModalFeature("image", h, 0, n)

    cache = EncoderCacheManager(12)
    for h in "abc":
        cache.add_ref("r", feature(h))
    for h in "bac":  # released in this order: b is the least recently released
        cache.release("r", h)
    assert cache.room() == 12 and cache.num_free_slots == 0
    assert cache.lookup("b")  # this step's plan reuses b: pinned, so a new image evicts a instead
    assert cache.room() == 8
    cache.add_ref("s", feature("d"))
    assert cache.take_freed() == ["a"] and cache.has("b") and cache.has("c")
    cache.end_step()  # b was not taken after all: freeable again, as the most recently released
    cache.check_integrity({"s"})
    cache.add_ref("s", feature("e"))
    assert cache.take_freed() == ["c"]
    cache.add_ref("t", feature("b"))  # still there
    assert cache.num_hits == 1
    cache.check_integrity({"s", "t"})
