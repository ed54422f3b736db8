"""`pagedllm bench serve`: each dataset's lengths and prefix structure, the metrics (goodput, percentiles, peaks)
against hand-computed values on synthetic per-request results, the arrival schedule, the result JSON and its file
name, the plot's data; and one run against a live tiny server."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pagedllm.benchmarks import datasets, serve
from pagedllm.benchmarks.serve import RequestResult
from tests.entrypoints.server_utils import API_KEY, REPO_ROOT, RemoteServer
from tests.utils import train_tiny_tokenizer


class WordTokenizer:
    """One token per whitespace-separated word; the chat template adds one word ("USER:")."""

    chat_template = "USER: {content}"

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=text.split())

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize and len(messages) == 1
        return "USER: " + messages[0]["content"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    serve._resolve_args(args)
    return args


# ------------------------------------------------------------------------------------------ datasets


def test_random_dataset_lengths_and_shared_prefix() -> None:
    reqs = datasets.random_token_prompts(1000, 8, 20, 5, 0.0, seed=3, prefix_len=7)
    assert [r.prompt_len for r in reqs] == [27] * 8
    assert all(len(r.prompt_token_ids) == 27 and r.expected_output_len == 5 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:7]) for r in reqs}) == 1  # one prefix for all
    assert len({tuple(r.prompt_token_ids[7:]) for r in reqs}) == 8  # then each its own tokens
    # Input lengths in [floor(10 * 0.75), ceil(10 * 1.25)] = [7, 13], output in [floor(3), ceil(5)] = [3, 5].
    reqs = datasets.random_token_prompts(1000, 400, 10, 4, 0.25, seed=0)
    assert {r.prompt_len for r in reqs} == set(range(7, 14))
    assert {r.expected_output_len for r in reqs} == {3, 4, 5}


def test_random_mm_dataset_images_counts_sizes_and_repeats() -> None:
    import base64
    import io

    from PIL import Image

    tokenizer = train_tiny_tokenizer()
    buckets = datasets.parse_bucket_config("{(16, 24, 1): 1, (8, 8, 1): 3, (720, 1280, 16): 0}")
    assert buckets == {(16, 24, 1): 0.25, (8, 8, 1): 0.75}
    reqs = datasets.random_mm_prompts(
        tokenizer, 40, 6, 4, seed=2, base_items_per_request=2, num_mm_items_range_ratio=0.5,
        limit_mm_per_prompt={"image": 2}, bucket_config=buckets,
    )  # fmt: skip
    counts = [len(r.mm_content) for r in reqs]
    assert set(counts) == {1, 2}  # 2 +- 1, capped at the limit of 2
    sizes = set()
    for r in reqs:
        assert r.prompt and r.expected_output_len == 4
        for part in r.mm_content:
            url = part["image_url"]["url"]
            assert part["type"] == "image_url" and url.startswith("data:image/jpeg;base64,")
            sizes.add(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size)
    assert sizes == {(24, 16), (8, 8)}  # PIL gives (width, height)
    pooled = datasets.random_mm_prompts(tokenizer, 30, 6, 4, seed=2, bucket_config=buckets, num_unique_images=3)
    assert len({r.mm_content[0]["image_url"]["url"] for r in pooled}) <= 3
    args = SimpleNamespace(temperature=0.0, ignore_eos=True, prompt_type="token_ids")
    payload = serve.build_payload(args, "m", pooled[0], chat=True)
    assert payload["messages"][0]["content"][0] == {"type": "text", "text": pooled[0].prompt}
    assert payload["messages"][0]["content"][1] == pooled[0].mm_content[0]


@pytest.mark.parametrize(
    ("value", "why"),
    [("{(8, 8, 4): 1.0}", "video"), ("[1, 2]", "non-empty dict"), ("{(8, 8): 1}", "frames"),
     ("{(8, 8, 1): 0}", "every probability is 0"), ("{(8, 8, 1): -1}", ">= 0"), ("{", "dict literal")],
)  # fmt: skip
def test_random_mm_bucket_config_errors(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        datasets.parse_bucket_config(value)


def test_prefix_repetition_dataset_groups_requests_by_prefix() -> None:
    reqs = datasets.prefix_repetition_prompts(1000, 10, 6, 4, 3, 9, seed=1, shuffle=False)
    assert len(reqs) == 9  # 3 prefixes x (10 // 3) prompts; vLLM drops the remainder
    assert all(
        r.prompt_len == 10 and len(r.prompt_token_ids) == 10 and r.expected_output_len == 9 for r in reqs
    )
    prefixes = [tuple(r.prompt_token_ids[:6]) for r in reqs]
    assert prefixes == [prefixes[0]] * 3 + [prefixes[3]] * 3 + [prefixes[6]] * 3
    assert len(set(prefixes)) == 3
    assert len({tuple(r.prompt_token_ids[6:]) for r in reqs}) == 9
    shuffled = datasets.prefix_repetition_prompts(1000, 10, 6, 4, 3, 9, seed=1)
    assert sorted(r.prompt_token_ids for r in shuffled) == sorted(r.prompt_token_ids for r in reqs)
    with pytest.raises(ValueError, match="num_prefixes"):
        datasets.prefix_repetition_prompts(1000, 2, 6, 4, 3, 9)


def test_sonnet_dataset_shares_its_prefix_lines(tmp_path: Path) -> None:
    poem = tmp_path / "poem.txt"
    lines = [f"line{i} of three\n" for i in range(20)]  # 3 words each
    poem.write_text("".join(lines))
    tok = WordTokenizer()
    # base = "USER:" + 11 words of SONNET_BASE_PROMPT = 12 tokens; input lines round((42 - 12) / 3) = 10,
    # prefix lines round((21 - 12) / 3) = 3; every prompt is 12 + 10 * 3 = 42 tokens.
    reqs = datasets.sonnet_prompts(tok, 6, input_len=42, output_len=16, prefix_len=21, seed=0, path=poem)
    head = "USER: " + datasets.SONNET_BASE_PROMPT + "".join(lines[:3])
    for r in reqs:
        assert r.prompt_token_ids is None and r.prompt_len == 42 and r.expected_output_len == 16
        assert r.prompt.startswith(head)
        assert r.prompt.count("\n") == 1 + 10
    assert len({r.prompt for r in reqs}) > 1
    raw = datasets.sonnet_prompts(
        tok, 2, input_len=42, output_len=16, prefix_len=21, path=poem, return_formatted=False
    )
    assert all(
        r.prompt.startswith(datasets.SONNET_BASE_PROMPT + lines[0]) and r.prompt_len == 42 for r in raw
    )
    with pytest.raises(ValueError, match="base prompt"):
        datasets.sonnet_prompts(tok, 1, input_len=12, path=poem)


def test_sonnet_dataset_with_the_bundled_sonnets_and_a_real_template() -> None:
    tok = train_tiny_tokenizer()
    reqs = datasets.sonnet_prompts(tok, 4, input_len=462, output_len=256, prefix_len=200, seed=0)
    lines = datasets.SONNET_PATH.read_text().splitlines(keepends=True)
    for r in reqs:
        assert r.prompt_len <= 462 and r.prompt_len == len(tok(r.prompt).input_ids)
        assert r.expected_output_len == 256
        assert r.prompt.startswith("<s><|user|>")  # through the tokenizer's chat template
    common = os.path.commonprefix([r.prompt for r in reqs])
    assert (datasets.SONNET_BASE_PROMPT + lines[0] + lines[1]) in common  # the shared prefix lines
    assert len(datasets.SONNET_PATH.read_text().splitlines()) >= 100


def test_sharegpt_dataset_takes_first_human_turn_and_filters(tmp_path: Path) -> None:
    tok = WordTokenizer()
    path = datasets.write_sharegpt_file(
        tmp_path / "sg.json",
        [
            ("a b c d e", "r r r r r r"),  # 5 in, 6 out: kept
            ("a b", "r r r r r"),  # prompt under 4 tokens: dropped
            ("a b c d", "r r"),  # reply under 4 tokens: dropped unless the output length is fixed
            (" ".join(["w"] * 1025), "r r r r"),  # prompt over 1024: dropped
            (" ".join(["w"] * 1000), " ".join(["r"] * 1100)),  # over 2048 in all: dropped
        ],
    )
    data = json.loads(path.read_text())
    data.append({"conversations": [{"from": "human", "value": "one turn only"}]})
    data.append(
        {
            "conversations": [
                {"from": "system", "value": "s s s s s"},
                {"from": "human", "value": "x y z w"},
                {"from": "gpt", "value": "1 2 3 4 5 6 7"},
            ]
        }
    )
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_prompts(tok, path, 10, seed=0, oversample=False)
    assert sorted((r.prompt, r.prompt_len, r.expected_output_len) for r in reqs) == [
        ("a b c d e", 5, 6),
        ("x y z w", 4, 7),
    ]
    fixed = datasets.sharegpt_prompts(tok, path, 10, output_len=3, oversample=False)
    assert sorted(r.prompt_len for r in fixed) == [4, 4, 5, 1000]
    assert {r.expected_output_len for r in fixed} == {3}
    more = datasets.sharegpt_prompts(tok, path, 5, seed=1)
    assert len(more) == 5 and {r.prompt for r in more} <= {"a b c d e", "x y z w"}


class WordVocab(WordTokenizer):
    """WordTokenizer with a 1000-word vocabulary to decode from: ``decode`` gives one word per id."""

    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 1000

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_sharegpt_shaped_file_follows_sharegpt_lengths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = WordVocab()
    monkeypatch.setattr("pagedllm.tokenizer.get_tokenizer", lambda name: tok)
    path = tmp_path / "sg.json"
    datasets.main(["sharegpt-file", str(path), "--tokenizer", "words", "--num", "2000", "--seed", "3"])
    reqs = datasets.sharegpt_prompts(tok, path, 2000, oversample=False)
    assert len(reqs) == 2000  # every generated pair already passes vLLM's filter
    prompt = np.array([r.prompt_len for r in reqs])
    reply = np.array([r.expected_output_len for r in reqs])
    # ShareGPT's shape: means near 200 prompt / 250 reply tokens, medians well below them (long tails).
    assert 170 < prompt.mean() < 230 and 200 < reply.mean() < 270
    assert np.median(prompt) < 0.8 * prompt.mean() and np.median(reply) < 0.8 * reply.mean()
    assert prompt.max() > 700 and prompt.min() >= 4 and (prompt + reply).max() <= 2048
    again = datasets.sharegpt_like_exchanges(tok, 5, seed=3)
    assert again == datasets.sharegpt_like_exchanges(tok, 5, seed=3)  # seeded
    with pytest.raises(ValueError, match="num"):
        datasets.sharegpt_like_exchanges(tok, 0)


def test_custom_dataset_reads_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n{"prompt": "four five", "output_tokens": 7}\n')
    tok = WordTokenizer()
    reqs = datasets.custom_prompts(tok, path, 2, output_len=256, shuffle=False)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [
        ("USER: one two three", 4, 256),
        ("USER: four five", 3, 7),
    ]
    raw = datasets.custom_prompts(tok, path, 0, apply_chat_template=False, shuffle=False)
    assert [(r.prompt, r.prompt_len) for r in raw] == [("one two three", 3), ("four five", 2)]
    with pytest.raises(ValueError, match=".jsonl"):
        datasets.custom_prompts(tok, tmp_path / "prompts.json", 2)


# ------------------------------------------------------------------------------------------- metrics


def _results() -> list[RequestResult]:
    return [
        RequestResult(True, 10, 5, ttft=0.1, itl=[0.05] * 4, latency=0.3, start_time=0.0),  # tpot 0.05
        RequestResult(True, 20, 3, ttft=0.4, itl=[0.1, 0.1], latency=0.6, start_time=0.2),  # tpot 0.1
        RequestResult(True, 5, 1, ttft=0.2, itl=[], latency=0.2, start_time=1.2),  # no tpot (0 for goodput)
        RequestResult(False, 7, 0, error="HTTP 500"),
    ]


def test_metrics_against_hand_computed_values() -> None:
    m = serve.calculate_metrics(_results(), 2.0, [50, 90, 99, 99.9])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["request_goodput"] is None
    # TTFT ms [100, 400, 200]: linear-interpolated p90 at rank 1.8 of [100, 200, 400] = 360.
    assert m["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(
        math.sqrt(((100 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2) / 3)
    )
    assert m["p90_ttft_ms"] == pytest.approx(360)
    assert m["p99.9_ttft_ms"] == pytest.approx(200 + 0.998 * 200)
    # TPOT ms [50, 100] (the one-token request has none); ITL ms [50]*4 + [100]*2; E2EL ms [300, 600, 200].
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["p99_tpot_ms"] == pytest.approx(99.5)
    assert m["mean_itl_ms"] == pytest.approx(400 / 6) and m["median_itl_ms"] == pytest.approx(50)
    assert m["mean_e2el_ms"] == pytest.approx(1100 / 3) and m["p50_e2el_ms"] == pytest.approx(300)
    # Output chunks per second from t=0: 5 + 3 in [0, 1), 1 at 1.4; requests [0, .3) and [.2, .8) overlap.
    assert m["max_output_tokens_per_s"] == 8
    assert m["max_concurrent_requests"] == 2
    only = serve.calculate_metrics(_results(), 2.0, [99], percentile_metrics=["ttft"])
    assert "p99_ttft_ms" in only and not any(k.endswith(("_itl_ms", "_tpot_ms", "_e2el_ms")) for k in only)


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 250}, 2),  # 100 and 200 ms meet it; 400 does not
        ({"ttft": 250, "tpot": 60}, 2),  # tpot 50 ms, and 0 for the one-token request
        ({"ttft": 250, "tpot": 40}, 1),  # only the one-token request
        ({"e2el": 300}, 2),  # the bound is inclusive: 300 ms meets it
        ({"ttft": 150, "e2el": 500}, 1),
        ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),  # the failed request never counts
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos: dict[str, float], good: int) -> None:
    m = serve.calculate_metrics(_results(), 2.0, [99], slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_parse_goodput() -> None:
    assert serve.parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500, "tpot": 50.5, "e2el": 0}
    assert serve.parse_goodput(None) == {}
    for bad, why in [
        (["itl:5"], "not one of"),
        (["ttft:-1"], "negative"),
        (["ttft"], "KEY:VALUE"),
        (["ttft:x"], "KEY:VALUE"),
    ]:
        with pytest.raises(ValueError, match=why):
            serve.parse_goodput(bad)


def test_throughput_timeline_and_plot_data() -> None:
    data = serve.plot_data(_results())
    assert data["ttfts_ms"] == pytest.approx([100, 400, 200])
    assert data["tpots_ms"] == pytest.approx([50, 100])
    assert data["seconds"] == [0, 1, 2]  # last end at 1.4 s: ceil(1.4) + 1 buckets
    assert data["output_tokens_per_s"] == [8, 1, 0]
    assert data["concurrent_requests"] == [2, 1, 0]
    assert serve.throughput_timeline([RequestResult(False)])["max_concurrent_requests"] == 0


def test_plot_needs_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="matplotlib"):
        serve.require_matplotlib()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    serve.save_plot(path, _results(), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -------------------------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate(burstiness: float) -> None:
    rate = 4.0
    gaps = serve.interarrival_gaps(200_000, rate, burstiness, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.01)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.03)  # gamma: k * theta^2


def test_arrival_times() -> None:
    times = serve.arrival_times(50, 10.0, 0.5, np.random.default_rng(7))
    again = serve.arrival_times(50, 10.0, 0.5, np.random.default_rng(7))
    assert np.array_equal(times, again)
    assert np.all(np.diff(times) >= 0) and times[0] > 0
    assert times[-1] == pytest.approx(5.0)  # rescaled: the last request goes at num_requests / rate
    assert np.all(serve.arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)) == 0)
    assert serve.arrival_times(4, 2.0, float("inf"), np.random.default_rng(0)) == pytest.approx(
        [0.5, 1, 1.5, 2]
    )
    with pytest.raises(ValueError, match="burstiness"):
        serve.arrival_times(4, 2.0, 0.0, np.random.default_rng(0))


# ----------------------------------------------------------------------------------------- result JSON

VLLM_RESULT_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
    "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
    "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "std_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
]  # fmt: skip


def test_result_json_has_vllms_keys(tmp_path: Path) -> None:
    args = _parse(
        ["--model", "org/tiny", "--num-prompts", "4", "--goodput", "ttft:250", "--metadata", "gpu=none"]
    )
    metrics = serve.calculate_metrics(_results(), 2.0, [99], serve.parse_goodput(args.goodput))
    result = serve.build_result(args, "org/tiny", "tok-dir", _results(), metrics, "20250101-000000")
    assert [k for k in result if k in VLLM_RESULT_KEYS] == [k for k in VLLM_RESULT_KEYS if k in result]
    assert set(VLLM_RESULT_KEYS) <= set(result)
    assert (
        result["backend"] == "openai"
        and result["model_id"] == "org/tiny"
        and result["tokenizer_id"] == "tok-dir"
    )
    assert result["request_rate"] == "inf" and result["gpu"] == "none" and result["dataset_name"] == "random"
    assert result["request_goodput"] == pytest.approx(1.0)
    assert result["output_lens"] == [5, 3, 1, 0] and result["errors"][3] == "HTTP 500"
    json.dumps(result)  # serializable


def test_result_file_name(tmp_path: Path) -> None:
    date = "20250101-000000"
    args = _parse(["--save-result", "--max-concurrency", "4", "--result-dir", str(tmp_path / "out")])
    assert (
        serve.result_path(args, "org/tiny", date)
        == tmp_path / "out" / f"openai-infqps-concurrency4-tiny-{date}.json"
    )
    assert (tmp_path / "out").is_dir()
    args = _parse(["--save-result", "--request-rate", "2", "--backend", "openai-chat", "--label", "x"])
    assert args.endpoint == "/v1/chat/completions"
    assert serve.result_path(args, "tiny", date) == Path(f"x-2.0qps-tiny-{date}.json")
    assert serve.result_path(_parse(["--save-result", "--result-filename", "r.json"]), "m", date) == Path(
        "r.json"
    )
    assert serve.result_path(_parse(["--save-result", "given.json"]), "m", date) == Path("given.json")
    assert serve.result_path(_parse([]), "m", date) is None


def test_flag_checks() -> None:
    assert _parse(["--dataset-name", "random"]).ignore_eos  # vLLM: random prompts run to their length
    assert not _parse(["--dataset-name", "sonnet"]).ignore_eos
    args = _parse(["--output-len", "9", "--input-len", "11"])
    assert (args.random_input_len, args.random_output_len, args.sharegpt_output_len) == (11, 9, 9)
    assert (args.custom_output_len, args.prefix_repetition_output_len) == (9, 9)
    for argv, why in [
        (["--max-concurrency", "0"], "max-concurrency"),
        (["--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["--dataset-path", "x.json"], "takes no --dataset-path"),
        (["--metadata", "novalue"], "KEY=VALUE"),
        (["--dataset-name", "random-mm"], "needs --backend openai-chat"),
        (["--dataset-name", "random-mm", "--backend", "openai-chat", "--random-mm-bucket-config", "{(8, 8, 2): 1}"],
         "video"),
    ]:
        with pytest.raises(ValueError, match=why):
            _parse(argv)
    with pytest.raises(ValueError, match="not among"):
        serve.parse_percentile_metrics("ttft,foo")


# ------------------------------------------------------------------------------------------ live server


@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> RemoteServer:
    srv = RemoteServer(tiny_llama, tmp_path_factory.mktemp("bench_server") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


def _bench(server: RemoteServer, model: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.base_url,
        "--model", model, "--api-key", API_KEY, *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bench_serve_datasets_against_a_live_server(
    server: RemoteServer, tiny_llama: str, tmp_path: Path
) -> None:
    out_dir = tmp_path / "results"
    proc = _bench(
        server, tiny_llama, "--dataset-name", "prefix_repetition", "--num-prompts", "6",
        "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4", "--ignore-eos",
        "--request-rate", "50", "--burstiness", "0.5", "--max-concurrency", "2", "--goodput", "ttft:600000",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--save-result",
        "--result-dir", str(out_dir),
    )  # fmt: skip
    assert "Request goodput (req/s):" in proc.stdout and "P50 TTFT (ms):" in proc.stdout
    assert "Mean ITL (ms):" not in proc.stdout
    (path,) = out_dir.glob("openai-50.0qps-concurrency2-*.json")
    result = json.loads(path.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 20 and result["total_output_tokens"] == 6 * 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["p50_ttft_ms"] > 0 and result["p99_e2el_ms"] > 0 and "mean_itl_ms" not in result
    assert 1 <= result["max_concurrent_requests"] <= 2
    assert result["burstiness"] == 0.5 and result["max_concurrency"] == 2
    # The text path: sonnet prompts through the chat template, sent as completions text, on the other client
    # library (the first run used aiohttp, the default when installed).
    saved = tmp_path / "sonnet.json"
    _bench(
        server, tiny_llama, "--dataset-name", "sonnet", "--num-prompts", "2", "--sonnet-input-len", "200",
        "--sonnet-prefix-len", "100", "--sonnet-output-len", "3", "--ignore-eos", "--save-result", str(saved),
        "--http-client", "httpx",
    )  # fmt: skip
    result = json.loads(saved.read_text())
    assert result["completed"] == 2 and result["total_output_tokens"] == 6
    assert all(0 < n <= 200 for n in result["input_lens"])
