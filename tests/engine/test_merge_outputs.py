"""merge_request_outputs: two consecutive outputs of one request as one (what a stream that fell behind gets)."""

from __future__ import annotations

from pagedllm.engine.async_llm import merge_request_outputs
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


def _out(completions, finished=False, prompt_logprobs=None):
    return RequestOutput("r", "p", [1, 2], prompt_logprobs, completions, finished)


def _c(index, text, ids, finish=None, logprobs=True):
    lps = [{t: Logprob(-0.5)} for t in ids] if logprobs else None
    return CompletionOutput(index, text, ids, -float(len(ids)), lps, finish)


def test_deltas_concatenate_per_sequence():
    first = _out([_c(0, "ab", [1, 2]), _c(1, "x", [7])], prompt_logprobs=[None, {2: Logprob(-1.0)}])
    then = _out([_c(1, "yz", [8, 9], finish="stop")], prompt_logprobs=None)
    merged = merge_request_outputs(first, then, RequestOutputKind.DELTA)
    assert [c.index for c in merged.outputs] == [0, 1]
    zero, one = merged.outputs
    assert (zero.text, zero.token_ids, zero.finish_reason) == ("ab", [1, 2], None)  # only in the first: as it was
    assert (one.text, one.token_ids, one.finish_reason) == ("xyz", [7, 8, 9], "stop")
    assert [list(d) for d in one.logprobs] == [[7], [8], [9]]
    assert one.cumulative_logprob == -2.0  # the later one's
    assert merged.prompt_logprobs == [None, {2: Logprob(-1.0)}]
    assert not merged.finished


def test_delta_prompt_logprobs_concatenate_and_finished_carries():
    first = _out([_c(0, "", [], logprobs=False)], prompt_logprobs=[None])
    then = _out([_c(0, "a", [3], finish="length", logprobs=False)], finished=True, prompt_logprobs=[{2: Logprob(-2.0)}])
    merged = merge_request_outputs(first, then, RequestOutputKind.DELTA)
    assert merged.prompt_logprobs == [None, {2: Logprob(-2.0)}]
    assert merged.finished and merged.outputs[0].token_ids == [3] and merged.outputs[0].logprobs is None


def test_cumulative_takes_the_later():
    first = _out([_c(0, "ab", [1, 2]), _c(1, "x", [7])])
    then = _out([_c(0, "abc", [1, 2, 3]), _c(1, "xy", [7, 8])], finished=True)
    merged = merge_request_outputs(first, then, RequestOutputKind.CUMULATIVE)
    assert [c.text for c in merged.outputs] == ["abc", "xy"] and merged.finished
