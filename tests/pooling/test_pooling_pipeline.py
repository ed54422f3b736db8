"""The pooling loop with one step in flight and texts tokenized in chunks between steps: outputs in input order
and exact (against one-text-at-a-time and sentence-transformers), errors and aborts mid-run, the core's step
protocol, and lazy embedding lists. CPU, float32."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch

from pagedllm import LLM, PoolingParams
from pagedllm.core.sched_output import EngineCoreRequest
from pagedllm.outputs import EmbeddingOutput, PoolingOutput
from tests.pooling.pooling_utils import TEXTS, assert_close, make_st_embedder, st_embed_ref

BUDGET = 80  # tokens per step: many steps for the batches below


def _texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 1 to 8 words (a few to ~40 tokens), built from the shared test texts."""
    rng = random.Random(seed)
    words = " ".join(TEXTS).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(n)]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_st_embedder("bert", tmp_path_factory.mktemp("pipeline") / "bert", "mean")


@pytest.fixture(scope="module")
def llm(embedder: str):
    with LLM(embedder, max_model_len=64, max_num_batched_tokens=BUDGET, max_num_seqs=8) as llm:
        yield llm


def _one_request(rid: str, ids: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling_params=None,
        eos_token_id=None,
        arrival_time=0.0,
        pooling_params=PoolingParams().with_task("embed"),
    )


@pytest.fixture(params=[False, True], ids=["inline", "thread"])
def tokenizer_thread(llm, request: pytest.FixtureRequest):
    """Texts after the first chunk tokenized between steps (the CPU's way) or by the tokenizer thread (a GPU's)."""
    llm._pooling_tokenizer_thread = request.param
    yield request.param
    llm._pooling_tokenizer_thread = None


def test_many_texts_in_order_and_exact(llm, embedder: str, tokenizer_thread: bool) -> None:
    """More texts than the first tokenized chunk (256), token-id prompts mixed in: each output is its own
    prompt's, equal to sentence-transformers' embedding and to embedding the prompt alone."""
    texts = _texts(700)
    tokenizer = llm.get_tokenizer()
    prompts: list = list(texts)
    for i in (3, 300, 650):  # the same text as token ids
        prompts[i] = {"prompt_token_ids": tokenizer(texts[i])["input_ids"]}
    steps_before = llm.llm_engine.engine_core.num_steps
    outs = llm.embed(prompts, use_tqdm=False)
    assert llm.llm_engine.engine_core.num_steps - steps_before > 30
    assert [o.prompt_token_ids for o in outs] == tokenizer(texts)["input_ids"]
    ours = torch.stack([o.outputs.data for o in outs])
    assert_close(ours, st_embed_ref(embedder, texts))
    for i in (0, 299, 699):
        alone = llm.embed(texts[i], use_tqdm=False)[0]
        assert_close(alone.outputs.data[None], outs[i].outputs.data[None], atol=1e-6)
    assert not llm.llm_engine.has_unfinished_requests()


def test_too_long_text_after_the_first_chunk(llm, tokenizer_thread: bool) -> None:
    """A text found too long only when its chunk is tokenized: ValueError naming the limit, every request of the
    call aborted (those already run included), the engine usable after."""
    texts = _texts(600)
    texts[500] = "word " * 100
    gc_enabled = gc.isenabled()
    with pytest.raises(ValueError, match="maximum model length of 64"):
        llm.embed(texts, use_tqdm=False)
    assert gc.isenabled() == gc_enabled
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.engine_core.debug_state()["num_running"] == 0
    assert not any(t.name.startswith("pagedllm-tokenize") for t in threading.enumerate())
    outs = llm.embed(texts[:3], use_tqdm=False)
    assert [o.prompt for o in outs] == texts[:3]


def test_bad_prompt_late_in_the_batch_queues_nothing(llm) -> None:
    """A prompt that is not plain text is checked before anything is queued, wherever it sits."""
    texts: list = _texts(600)
    texts[550] = ""
    steps_before = llm.llm_engine.engine_core.num_steps
    with pytest.raises(ValueError, match="empty"):
        llm.embed(texts, use_tqdm=False)
    assert llm.llm_engine.engine_core.num_steps == steps_before
    assert not llm.llm_engine.has_unfinished_requests()


def test_core_returns_each_step_after_queueing_the_next(llm) -> None:
    """``step`` queues a batch and returns the previous one's outputs (first come, first served); the last
    batch comes back from a step that queues nothing."""
    engine = llm.llm_engine
    core = engine.engine_core
    lengths = [30, 30, 30, 30, 30]  # two requests per step under a budget of 80
    for i, n in enumerate(lengths):
        core.add_request(_one_request(f"r{i}", list(range(5, 5 + n))))
    seen = []
    first = core.step()
    assert first.outputs == [] and core.has_unfinished_requests()
    while core.has_unfinished_requests():
        seen.append([o.request_id for o in core.step().outputs])
    assert seen == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert all(isinstance(o, list) for o in seen)


def test_abort_in_flight_and_waiting(llm) -> None:
    """Aborting a request already on the device drops its output; the others come out unchanged."""
    engine = llm.llm_engine
    core = engine.engine_core
    ids = [list(range(5, 35)) for _ in range(6)]
    for i, x in enumerate(ids):
        core.add_request(_one_request(f"a{i}", x))
    assert core.step().outputs == []  # a0, a1 on the device
    core.abort_requests(["a0", "a4"])  # one in flight, one waiting
    got = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id] = o.pooling_output
    assert sorted(got) == ["a1", "a2", "a3", "a5"]
    ref = core.runner.execute([_input("x", ids[0])])["x"]
    for row in got.values():
        assert_close(torch.from_numpy(row)[None], torch.from_numpy(ref)[None], atol=1e-6)
    for rid in ("b0", "b1", "b2"):
        core.add_request(_one_request(rid, ids[0]))
    assert core.step().outputs == []  # b0, b1 on the device
    core.abort_requests(["b0", "b1"])  # the whole step in flight: nothing left to wait for
    assert core.debug_state()["num_running"] == 0
    assert [o.request_id for o in core.step().outputs] == ["b2"]  # alone: finished in the step that runs it
    assert not core.has_unfinished_requests()


def _input(rid: str, ids: list[int]):
    from pagedllm.worker.pooling_runner import PoolingInput

    return PoolingInput(rid, ids, PoolingParams().with_task("embed"))


def test_a_failed_launch_loses_only_its_batch(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    core = llm.llm_engine.engine_core
    for i in range(4):
        core.add_request(_one_request(f"f{i}", list(range(5, 35))))
    assert core.step().outputs == []  # f0, f1 in flight
    launch = core.runner.launch

    def failing(inputs):
        raise RuntimeError("device fault")

    monkeypatch.setattr(core.runner, "launch", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        core.step()  # f2, f3 are lost
    monkeypatch.setattr(core.runner, "launch", launch)
    assert [o.request_id for o in core.step().outputs] == ["f0", "f1"]
    assert not core.has_unfinished_requests()


def test_embedding_lists_are_built_when_read(llm) -> None:
    out = llm.embed(["hello world"], use_tqdm=False)[0]
    emb = out.outputs
    assert emb._embedding is None  # nothing built yet
    assert emb.hidden_size == emb.data.shape[0]
    values = emb.embedding
    assert isinstance(values, list) and values == emb.data.tolist()
    assert emb == EmbeddingOutput(list(values))
    assert EmbeddingOutput(values).data.tolist() == values
    assert PoolingOutput(emb.data.numpy()) == PoolingOutput(values)
    with pytest.raises(ValueError):
        EmbeddingOutput()


def test_classify_and_score_through_the_pipeline(tmp_path) -> None:
    """Classifier outputs (small rows, several steps) keep their order too."""
    from tests.pooling.pooling_utils import hf_classifier_logits, make_classifier

    path = make_classifier("bert", tmp_path / "cls", num_labels=3)
    texts = _texts(40, seed=1)
    with LLM(path, max_num_batched_tokens=BUDGET, max_num_seqs=4) as llm:
        outs = llm.classify(texts, use_tqdm=False)
    probs = torch.tensor([o.outputs.probs for o in outs])
    ref = torch.softmax(hf_classifier_logits(path, texts), dim=-1)
    assert_close(probs, ref)
