"""InputProcessor (validation, fan-out, chat templates) and OutputProcessor (hand-made core outputs)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from transformers import PreTrainedTokenizerFast

from pagedllm.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import get_tokenizer
from tests.utils import train_tiny_tokenizer

MAX_MODEL_LEN = 64


@dataclass
class FakeModelConfig:
    max_model_len: int = MAX_MODEL_LEN
    vocab_size: int = 400
    model_path: str = ""


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tiny_tokenizer()


@pytest.fixture
def inputs(tokenizer: PreTrainedTokenizerFast) -> InputProcessor:
    return InputProcessor(FakeModelConfig(vocab_size=len(tokenizer)), tokenizer)


# ------------------------------------------------------------------------------------------ tokenizer loading


def test_get_tokenizer_round_trip_and_error(tokenizer: PreTrainedTokenizerFast, tmp_path) -> None:
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = get_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("Hello world") == tokenizer.encode("Hello world")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        get_tokenizer(str(tmp_path / "empty"))


# ------------------------------------------------------------------------------------------ input processor


def test_prompt_forms(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.bos_token_id  # str prompts get the tokenizer's BOS
    for prompt, text in [
        ("Hello world", "Hello world"),
        ({"prompt": "Hello world"}, "Hello world"),
        (ids, None),
        ({"prompt_token_ids": ids}, None),
    ]:
        req = inputs.process("r", prompt, SamplingParams(max_tokens=None))
        assert req.prompt == text
        assert req.prompt_token_ids == ids
        assert req.params.max_tokens == MAX_MODEL_LEN - len(ids)
        [core] = req.core_requests
        assert core.request_id == "r"
        assert core.eos_token_id == tokenizer.eos_token_id
        assert core.prompt_token_ids == ids


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"text": "hi"}, SamplingParams(), "prompt"),
        (3, SamplingParams(), "prompt"),
        ([1, "2"], SamplingParams(), "prompt_token_ids"),
        ([1, 2.0], SamplingParams(), "prompt_token_ids"),
        ([1, 400], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ("hi", SamplingParams(stop_token_ids=[400]), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={1000: 1.0}), "logit_bias"),
        ("hi", SamplingParams(logprobs=21), "logprobs"),
        ("hi", SamplingParams(stop=["x"], detokenize=False), "stop"),
    ],
)
def test_validation_errors_name_the_field(inputs: InputProcessor, prompt, params, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        inputs.process("r", prompt, params)


def test_prompt_too_long(inputs: InputProcessor) -> None:
    inputs.process("ok", [5] * (MAX_MODEL_LEN - 1), SamplingParams())
    with pytest.raises(
        ValueError, match=rf"prompt \(length {MAX_MODEL_LEN}\).*maximum model length of {MAX_MODEL_LEN}"
    ):
        inputs.process("r", [5] * MAX_MODEL_LEN, SamplingParams())


def test_fan_out_with_seeds(inputs: InputProcessor) -> None:
    user_params = SamplingParams(n=3, seed=7, max_tokens=None, temperature=0.8)
    req = inputs.process("req", "Hello", user_params)
    assert [c.request_id for c in req.core_requests] == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.seed for c in req.core_requests] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 for c in req.core_requests)
    assert all(
        c.sampling_params.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids) for c in req.core_requests
    )
    assert req.params.n == 3
    assert user_params.max_tokens is None  # the caller's params are not modified
    unseeded = inputs.process("u", "Hello", SamplingParams(n=2))
    assert [c.sampling_params.seed for c in unseeded.core_requests] == [None, None]


def test_bad_words_with_and_without_space(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    req = inputs.process("r", "Hello", SamplingParams(bad_words=["world", " the cat"]))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert req.params._bad_words_token_ids == [enc("world"), enc(" world"), enc("the cat"), enc(" the cat")]
    assert enc("world") != enc(" world")


def test_generation_config_eos_ids_become_stop_tokens(tokenizer: PreTrainedTokenizerFast, tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    processor = InputProcessor(
        FakeModelConfig(vocab_size=len(tokenizer), model_path=str(tmp_path)), tokenizer
    )
    req = processor.process("r", "Hi", SamplingParams(stop_token_ids=[5]))
    assert req.core_requests[0].eos_token_id == 1
    assert req.params.stop_token_ids == [5, 2]
    assert processor.process("r", "Hi", SamplingParams(ignore_eos=True)).params.stop_token_ids == []


def test_with_real_model_config(tokenizer: PreTrainedTokenizerFast, tmp_path) -> None:
    from transformers import LlamaConfig

    from pagedllm.config import ModelConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    processor = InputProcessor(ModelConfig(str(tmp_path)), tokenizer)
    req = processor.process("r", "Hello", SamplingParams(max_tokens=None))
    assert req.params.max_tokens == 128 - len(req.prompt_token_ids)


def test_chat_template(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]
    text = inputs.apply_chat_template(messages, None)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello\nthere</s>\n<|assistant|>\n"
    ids = inputs.tokenize(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS only
    assert not inputs.apply_chat_template(messages, None, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    custom = inputs.apply_chat_template(
        messages[:1], "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    assert custom == "[Be brief.]"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        ["hi"],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "tool", "content": "x"}],  # the tiny template raises on roles it does not know
    ],
)
def test_chat_template_errors_name_messages(inputs: InputProcessor, messages) -> None:
    with pytest.raises(ValueError, match=r"^messages"):
        inputs.apply_chat_template(messages, None)


# ------------------------------------------------------------------------------------------ output processor


def _process(inputs: InputProcessor, request_id: str, prompt: str, **params) -> ProcessedRequest:
    return inputs.process(request_id, prompt, SamplingParams(**params))


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _feed_one_by_one(outputs: OutputProcessor, request_id: str, token_ids: list[int], last_finish=None):
    """One core output per token; the last carries ``last_finish``; returns every ProcessedOutputs."""
    results = []
    for i, t in enumerate(token_ids):
        finish = last_finish if i == len(token_ids) - 1 else None
        results.append(outputs.process_outputs([EngineCoreOutput(request_id, [t], finish_reason=finish)]))
    return results


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(
    inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast, kind: RequestOutputKind
) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(_process(inputs, "r", "Hello", output_kind=kind))
    token_ids = _ids(tokenizer, "The cat was happy") + [tokenizer.eos_token_id]
    results = _feed_one_by_one(outputs, "r", token_ids, last_finish="stop")
    request_outputs = [ro for res in results for ro in res.request_outputs]
    final = request_outputs[-1]
    assert (
        final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason is None
    )
    assert [ro.finished for ro in request_outputs] == [False] * (len(request_outputs) - 1) + [True]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(request_outputs) == 1
    else:
        assert len(request_outputs) == len(token_ids)
    if kind == RequestOutputKind.DELTA:
        assert "".join(ro.outputs[0].text for ro in request_outputs) == "The cat was happy"
        assert [t for ro in request_outputs for t in ro.outputs[0].token_ids] == token_ids
        assert all(len(ro.outputs[0].token_ids) == 1 for ro in request_outputs)
    else:
        assert final.outputs[0].text == "The cat was happy"  # no eos text
        assert final.outputs[0].token_ids == token_ids  # the eos id is kept
    assert final.outputs[0].cumulative_logprob is None and final.outputs[0].logprobs is None
    m = final.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert not outputs.has_unfinished_requests()


def test_logprobs_shape_and_cumulative(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(_process(inputs, "r", "Hello", logprobs=1, prompt_logprobs=2))
    prompt_len = len(tokenizer.encode("Hello"))
    # The prompt's logprob rows come in two prefill chunks (nothing to report yet), then the first token.
    num_rows = prompt_len - 1
    rows = LogprobsLists([[10, 10, 11, 12]] * num_rows, [[-1.0, -1.0, -2.0, -3.0]] * num_rows, [1] * num_rows)
    first = LogprobsLists(rows.token_ids[:1], rows.logprobs[:1], rows.ranks[:1])
    rest = LogprobsLists(rows.token_ids[1:], rows.logprobs[1:], rows.ranks[1:])
    assert (
        outputs.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=first)]).request_outputs == []
    )
    sampled = LogprobsLists(token_ids=[[20, 21, 20, 22]], logprobs=[[-0.5, -0.1, -0.5, -0.9]], ranks=[2])
    [ro] = outputs.process_outputs(
        [EngineCoreOutput("r", [20], new_logprobs=sampled, new_prompt_logprobs=rest)]
    ).request_outputs
    out = ro.outputs[0]
    assert list(out.logprobs[0]) == [20, 21]  # sampled token first, then the top-1 candidate
    assert out.logprobs[0][20].rank == 2 and out.logprobs[0][20].logprob == -0.5
    assert out.logprobs[0][21].rank == 1 and out.logprobs[0][21].decoded_token == tokenizer.decode([21])
    assert out.cumulative_logprob == -0.5
    assert ro.prompt_logprobs[0] is None and len(ro.prompt_logprobs) == prompt_len
    assert list(ro.prompt_logprobs[1]) == [10, 11]  # the prompt token already in the top-2 appears once
    sampled2 = LogprobsLists(token_ids=[[30, 31]], logprobs=[[-0.25, -0.2]], ranks=[2])
    [ro] = outputs.process_outputs(
        [EngineCoreOutput("r", [30], new_logprobs=sampled2, finish_reason="length")]
    ).request_outputs
    assert ro.outputs[0].cumulative_logprob == -0.75 and len(ro.outputs[0].logprobs) == 2


def test_n2_aggregation_and_delta_prompt_logprobs(
    inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast
) -> None:
    for kind in RequestOutputKind:
        outputs = OutputProcessor(tokenizer)
        outputs.add_request(_process(inputs, "r", "Hi", n=2, seed=1, output_kind=kind))
        a, b = _ids(tokenizer, " one"), _ids(tokenizer, " two three")
        res1 = outputs.process_outputs(
            [EngineCoreOutput("1_r", b[:1]), EngineCoreOutput("0_r", a, finish_reason="length")]
        )
        res2 = outputs.process_outputs([EngineCoreOutput("1_r", b[1:], finish_reason="length")])
        ros = res1.request_outputs + res2.request_outputs
        if kind == RequestOutputKind.FINAL_ONLY:
            [final] = ros
        else:
            assert len(ros) == 2 and not ros[0].finished
            first_indices = [o.index for o in ros[0].outputs]
            assert first_indices == [0, 1]  # ordered by index, whatever order the core reported them in
            # DELTA: only the sequence that changed; CUMULATIVE: all of them.
            assert [o.index for o in ros[1].outputs] == ([1] if kind == RequestOutputKind.DELTA else [0, 1])
            final = ros[1]
        assert final.finished
        if kind != RequestOutputKind.DELTA:
            assert [o.text for o in final.outputs] == [" one", " two three"]
            assert all(o.finish_reason == "length" for o in final.outputs)
        assert not outputs.has_unfinished_requests()
        assert [f.request_id for f in res1.stats.finished_requests + res2.stats.finished_requests] == [
            "0_r",
            "1_r",
        ]


def test_stop_string_across_tokens_aborts_and_truncates(
    inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast
) -> None:
    token_ids = _ids(tokenizer, "Hello world. The end")
    for include, kind in [(False, RequestOutputKind.DELTA), (True, RequestOutputKind.CUMULATIVE)]:
        outputs = OutputProcessor(tokenizer)
        outputs.add_request(
            _process(inputs, "r", "Hi", stop=["o w"], include_stop_str_in_output=include, output_kind=kind)
        )
        results = _feed_one_by_one(outputs, "r", token_ids)
        aborted = [res.reqs_to_abort for res in results if res.reqs_to_abort]
        assert aborted == [["r"]]
        request_outputs = [ro for res in results for ro in res.request_outputs]
        final = request_outputs[-1]
        assert (
            final.finished
            and final.outputs[0].finish_reason == "stop"
            and final.outputs[0].stop_reason == "o w"
        )
        expected = "Hello w" if include else "Hell"
        if kind == RequestOutputKind.DELTA:
            # Held-back characters mean no delta ever showed part of the stop string.
            assert "".join(ro.outputs[0].text for ro in request_outputs) == expected
        else:
            assert final.outputs[0].text == expected
        assert not outputs.has_unfinished_requests()
        # A late core output for the stopped sequence is ignored.
        assert outputs.process_outputs([EngineCoreOutput("r", [5])]).request_outputs == []


def test_stop_token_id_and_min_tokens(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    outputs = OutputProcessor(tokenizer)
    stop_id = _ids(tokenizer, ".")[0]
    outputs.add_request(_process(inputs, "r", "Hi", stop_token_ids=[stop_id], stop=["a"], min_tokens=3))
    first = _ids(tokenizer, "a") + _ids(tokenizer, "b")
    res = outputs.process_outputs([EngineCoreOutput("r", first)])  # "a" within min_tokens: not a stop
    assert res.reqs_to_abort == [] and res.request_outputs[0].outputs[0].text == "ab"
    res = outputs.process_outputs(
        [EngineCoreOutput("r", [stop_id], finish_reason="stop", stop_reason=stop_id)]
    )
    out = res.request_outputs[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop_id, "ab")


def test_queue_abort_and_stats(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    class ListQueue(list):
        def put_nowait(self, item) -> None:
            self.append(item)

    outputs = OutputProcessor(tokenizer)
    queue = ListQueue()
    outputs.add_request(_process(inputs, "q", "Hi", output_kind=RequestOutputKind.DELTA), queue=queue)
    outputs.add_request(_process(inputs, "p", "Hi", n=2))
    with pytest.raises(ValueError, match="already in flight"):
        outputs.add_request(_process(inputs, "q", "Hi"))
    assert outputs.get_num_unfinished_requests() == 2
    res = outputs.process_outputs([EngineCoreOutput("q", [50]), EngineCoreOutput("0_p", [51])])
    assert [ro.request_id for ro in res.request_outputs] == ["p"]
    assert [ro.request_id for ro in queue] == ["q"]
    assert res.stats.num_generation_tokens == 2 and len(res.stats.time_to_first_tokens) == 2
    assert res.stats.num_prompt_tokens == 2 * len(tokenizer.encode("Hi"))
    res = outputs.process_outputs([EngineCoreOutput("q", [52, 53], finish_reason="length")])
    assert len(res.stats.inter_token_latencies) == 1 and res.stats.num_generation_tokens == 2
    [done] = res.stats.finished_requests
    assert (done.request_id, done.finish_reason, done.num_generation_tokens) == ("q", "length", 3)
    assert done.ttft is not None and done.e2e_latency >= done.ttft
    assert queue[-1].finished and res.request_outputs == []
    # Abort by parent id: both children still running in the core.
    assert outputs.abort_requests(["p", "unknown"]) == ["0_p", "1_p"]
    assert not outputs.has_unfinished_requests()
    assert outputs.process_outputs([EngineCoreOutput("1_p", [5])]).request_outputs == []


def test_abort_one_child(inputs: InputProcessor, tokenizer: PreTrainedTokenizerFast) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(_process(inputs, "p", "Hi", n=2))
    assert outputs.abort_requests(["1_p"]) == ["1_p"]
    [ro] = outputs.process_outputs([EngineCoreOutput("0_p", [50], finish_reason="length")]).request_outputs
    assert ro.finished and [o.finish_reason for o in ro.outputs] == ["length", "abort"]
    assert not outputs.has_unfinished_requests()
