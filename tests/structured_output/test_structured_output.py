"""Structured outputs in the engine: every constrained output obeys its constraint, with async scheduling,
chunked prefill, prefix caching, preemption, n > 1 and seeds; bad constraints are ValueErrors naming the field;
a grammar still compiling holds back only its own request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedllm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.demo import default_model
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sample.ops import apply_token_bitmask_
from pagedllm.structured_output.manager import GrammarState, StructuredOutputManager

# Bounded schemas: a random-weight model must finish them within max_tokens (an unbounded integer may not).
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "email": {"type": "string", "maxLength": 16},
                },
                "required": ["id", "email"],
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["user", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["color", "ok", "ratio"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
]
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
PROMPT = "Describe the record as JSON:\n"
# The demo model writes Python; after this prompt its greedy JSON object closes (after PROMPT it loops in a key).
OBJECT_PROMPT = "config = "


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def demo_llm(request) -> LLM:
    return LLM(default_model(), dtype="float32", device="cpu", async_scheduling=request.param)


def _so(**kw) -> SamplingParams:
    max_tokens = kw.pop("max_tokens", 200)
    temperature = kw.pop("temperature", 0.0)
    seed = kw.pop("seed", None)
    n = kw.pop("n", 1)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        n=n,
        structured_outputs=StructuredOutputsParams(**kw),
    )


def check(kind: str, spec, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in spec, text
    elif kind == "grammar":
        assert re.fullmatch(r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)", text), text


def _cases():
    cases = [("json", s) for s in SCHEMAS]
    cases += [("json_object", True), ("regex", REGEX), ("choice", CHOICES), ("grammar", GRAMMAR)]
    return cases


def _params_for(kind, spec, **kw) -> SamplingParams:
    return _so(**{kind: spec}, **kw)


def _prompts(cases) -> list[str]:
    return [OBJECT_PROMPT if kind == "json_object" else PROMPT for kind, _ in cases]


def test_every_constraint_is_obeyed_in_one_batch(demo_llm: LLM) -> None:
    cases = _cases()
    params = [_params_for(k, s, disable_any_whitespace=k in ("json", "json_object")) for k, s in cases]
    outs = demo_llm.generate(_prompts(cases), params, use_tqdm=False)
    for (kind, spec), out in zip(cases, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, spec, out.outputs[0].text)


def test_json_with_free_whitespace(demo_llm: LLM) -> None:
    outs = demo_llm.generate([PROMPT] * 2, [_so(json=SCHEMAS[0]), _so(json=SCHEMAS[2])], use_tqdm=False)
    for spec, out in zip((SCHEMAS[0], SCHEMAS[2]), outs, strict=True):
        check("json", spec, out.outputs[0].text)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_weight_models_obey_schemas(tiny_model_dirs, arch: str) -> None:
    llm = LLM(tiny_model_dirs[arch], dtype="float32", device="cpu")
    params = [_so(json=s, disable_any_whitespace=True) for s in SCHEMAS]
    params += [_so(json=s) for s in SCHEMAS]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs, strict=True):
        check("json", json.loads(p.structured_outputs.key()[1]), out.outputs[0].text)


def test_sampling_n_and_seeds(demo_llm: LLM) -> None:
    params = _so(choice=CHOICES, temperature=1.0, seed=7, n=4)
    first = demo_llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = demo_llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(first.outputs) == 4
    assert all(o.text in CHOICES for o in first.outputs)
    assert [o.text for o in first.outputs] == [o.text for o in again.outputs]
    rnd = _so(json=SCHEMAS[3], temperature=1.0, seed=3, n=3, disable_any_whitespace=True)
    for o in demo_llm.generate([PROMPT], rnd, use_tqdm=False)[0].outputs:
        check("json", SCHEMAS[3], o.text)


def test_unconstrained_requests_are_not_disturbed(demo_llm: LLM) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = demo_llm.generate(["def add(a, b):"], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = demo_llm.generate(
        ["def add(a, b):", PROMPT, OBJECT_PROMPT],
        [plain, _so(regex=REGEX), _so(json_object=True, disable_any_whitespace=True)],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone
    check("regex", REGEX, mixed[1].outputs[0].text)
    check("json_object", True, mixed[2].outputs[0].text)


@pytest.mark.usefixtures("admit_while_blocks_last")
def test_sync_and_async_give_the_same_tokens_under_chunking_caching_and_preemption() -> None:
    """Small token budget (chunked prefill), a shared prefix (prefix caching) and a KV cache too small for the
    batch (preemption by recompute): the constrained tokens equal an unpressured run's, in both loops."""
    cases = _cases()
    prompts = _prompts(cases)
    params = [_params_for(k, s, disable_any_whitespace=True) for k, s in cases]
    baseline = LLM(default_model(), dtype="float32", device="cpu")
    want = [o.outputs[0].token_ids for o in baseline.generate(prompts, params, use_tqdm=False)]
    for async_scheduling in (False, True):
        llm = LLM(
            default_model(),
            dtype="float32",
            device="cpu",
            block_size=4,
            max_num_batched_tokens=16,
            num_gpu_blocks_override=20,
            max_model_len=80,
            async_scheduling=async_scheduling,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        assert core.kv_cache_manager.prefix_cache_hits > 0
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    for (kind, spec), out in zip(cases, outs, strict=True):
        check(kind, spec, out.outputs[0].text)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"json": {"type": "objec"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(ab"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_raise_value_error_naming_the_field(demo_llm: LLM, kwargs, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        demo_llm.generate([PROMPT], _so(**kwargs), use_tqdm=False)
    out = demo_llm.generate([PROMPT], _so(choice=CHOICES), use_tqdm=False)[0]
    assert out.outputs[0].text in CHOICES
    assert not demo_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": SCHEMAS[0], "regex": "a"}, {"choice": []}, {"choice": ["a", 3]}, {"json": 5}],
)
def test_exactly_one_well_typed_constraint(kwargs) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"bogus": 1})


def test_guided_decoding_is_the_older_name() -> None:
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert params.structured_outputs.choice == ["a", "b"] and params.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(regex="a"),
            structured_outputs=StructuredOutputsParams(regex="b"),
        )


def test_a_compiling_grammar_holds_back_only_its_own_request(monkeypatch) -> None:
    engine = LLMEngine.from_kwargs(default_model(), dtype="float32", device="cpu")
    release = threading.Event()
    original = StructuredOutputManager._compile

    def slow_compile(self, params):
        release.wait(30)
        return original(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    engine.add_request("constrained", PROMPT, _so(choice=CHOICES))
    engine.add_request("plain", "def f():", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    constrained = engine.engine_core.scheduler.requests["constrained"]
    assert constrained.num_computed_tokens == 0 and not finished.get("constrained")
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["constrained"].outputs[0].text in CHOICES


def test_reasoning_holds_the_grammar_until_the_end_marker() -> None:
    """With a reasoning parser, tokens before the end marker are free; the grammar starts after it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model())
    manager = StructuredOutputManager(4096, lambda: tok, reasoning_markers=("<think>", "</think>"))
    end = tok.encode("</think>", add_special_tokens=False)
    start = tok.encode("<think>", add_special_tokens=False)
    params = StructuredOutputsParams(choice=["yes", "no"])
    thinking = manager.new_state(params, [5, 6, *start], [1])
    answered = manager.new_state(params, [5, *start, 7, *end], [1])
    plain_prompt = manager.new_state(params, [5, 6], [1])
    for state in (thinking, answered, plain_prompt):
        state.wait(30)
        assert state.ready() and state.error is None
    assert not thinking.active and answered.active and not plain_prompt.active
    bitmask = manager.grammar_bitmask([thinking, None, answered])
    assert bitmask.shape == (3, 128)
    assert (bitmask[0] == -1).all() and (bitmask[1] == -1).all() and not (bitmask[2] == -1).all()
    free_text = tok.encode("maybe not", add_special_tokens=False)
    for t in free_text + end:  # anything goes while reasoning
        assert thinking.accept(t)
    assert thinking.active and thinking.num_accepted == 0
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert thinking.accept(t)
    assert thinking.num_accepted == len(yes)
    thinking.rollback(len(yes))
    assert thinking.num_accepted == 0
    assert manager.grammar_bitmask([None, None]) is None


def test_apply_token_bitmask_matches_a_boolean_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    allowed = torch.rand(5, vocab, generator=gen) < 0.3  # [5, vocab]
    allowed[0] = True
    padded = torch.zeros(5, 96, dtype=torch.bool)
    padded[:, :vocab] = allowed
    bits = padded.view(5, 3, 32).long() << torch.arange(32)  # [5, 3, 32]
    words = bits.sum(-1)  # [5, 3], as unsigned 32-bit
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    want = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), want)


def test_grammar_state_reports_a_compile_failure() -> None:
    from concurrent.futures import Future

    future: Future = Future()
    future.set_exception(RuntimeError("boom"))
    state = GrammarState(future, [1, 2], [1])
    assert state.ready() and "boom" in state.error and not state.active


@pytest.mark.gpu
def test_gpu_constrained_tokens_match_between_sync_and_async_with_cuda_graphs() -> None:
    """On the GPU (Triton attention, CUDA graphs for decode, pinned bitmask buffers): the async loop gives the
    sync loop's tokens, and they obey the constraints."""
    cases = _cases()
    prompts = _prompts(cases) * 3
    params = [_params_for(k, s, disable_any_whitespace=True) for k, s in cases] * 3
    tokens = []
    for async_scheduling in (False, True):
        llm = LLM(
            default_model(),
            dtype="float32",
            device="cuda",
            kv_cache_memory_bytes=256 << 20,
            async_scheduling=async_scheduling,
        )
        assert llm.llm_engine.engine_core.runner.graph_runner is not None
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        for (kind, spec), out in zip(cases * 3, outs, strict=True):
            assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
            check(kind, spec, out.outputs[0].text)
        del llm
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]


def test_a_grammar_that_fails_in_the_engine_aborts_only_its_request(monkeypatch) -> None:
    """The front-end validated the constraint, yet the engine's compile fails: that request ends with
    finish_reason "abort", the others complete, and no block leaks."""
    engine = LLMEngine.from_kwargs(default_model(), dtype="float32", device="cpu")

    def failing_compile(self, params):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(StructuredOutputManager, "_compile", failing_compile)
    engine.add_request("bad", PROMPT, _so(choice=CHOICES))
    engine.add_request("plain", "def f():", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "abort" and finished["bad"].outputs[0].token_ids == []
    assert len(finished["plain"].outputs[0].token_ids) == 6
    core = engine.engine_core
    core.check_integrity()
    assert core.scheduler.num_grammar_reqs == 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_llm_chat_passes_tools_and_template_kwargs(demo_llm: LLM) -> None:
    """LLM.chat hands tools and chat_template_kwargs to the template (as vLLM's does); with a constraint the
    reply is a valid call of the offered tool."""
    template = (
        "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}.\n{% endif %}"
        "{% if mode %}MODE: {{ mode }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    )
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"enum": ["a", "b"]},
                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["key", "n"],
            },
        },
    }
    messages = [{"role": "user", "content": "look it up"}]
    schema = tool["function"]["parameters"]
    out = demo_llm.chat(
        messages,
        _so(json=schema, disable_any_whitespace=True),
        use_tqdm=False,
        chat_template=template,
        tools=[tool],
        chat_template_kwargs={"mode": "fast"},
    )[0]
    assert out.prompt == "TOOLS: lookup.\nMODE: fast\nuser: look it up\nassistant: "
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_llm_reasoning_parser_defers_the_grammar() -> None:
    """LLM(reasoning_parser=...): while the reasoning is open (no </think> yet) the output is free, so a
    constrained greedy request gives the unconstrained tokens; an unknown parser name is a ValueError."""
    with pytest.raises(ValueError, match="reasoning parser 'nope'"):
        LLM(default_model(), dtype="float32", device="cpu", reasoning_parser="nope")
    llm = LLM(default_model(), dtype="float32", device="cpu", reasoning_parser="deepseek_r1")
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    a, b = llm.generate(["<think>\nx = ", "<think>\nx = "], [free, constrained], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.outputs[0].text not in CHOICES


def test_json_whitespace_runs_are_capped_per_token() -> None:
    """Free-whitespace JSON: after MAX_JSON_WHITESPACE_TOKENS whitespace-only tokens in a row, the mask drops every
    whitespace-only token (and nothing else) until another token comes; rollback undoes it. Compact JSON and
    other constraints are not capped."""
    from transformers import AutoTokenizer

    from pagedllm.structured_output.grammar import MAX_JSON_WHITESPACE_TOKENS

    tok = AutoTokenizer.from_pretrained(default_model())
    manager = StructuredOutputManager(4096, lambda: tok)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    free = manager.new_state(StructuredOutputsParams(json=schema), [5], [tok.eos_token_id])
    compact = manager.new_state(StructuredOutputsParams(json=schema, disable_any_whitespace=True), [5], [1])
    for state in (free, compact):
        state.wait(30)
        assert state.ready() and state.error is None
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    texts = [tok.convert_tokens_to_string([t]) for t in vocab]
    spaces = [i for i, t in enumerate(texts) if t and not t.strip(" \t\n\r")]
    assert spaces
    brace = tok.encode("{", add_special_tokens=False)
    assert len(brace) == 1 and free.accept(brace[0]) and compact.accept(brace[0])

    def allowed(state) -> set[int]:
        row = manager.grammar_bitmask([state])[0]
        return {i for i in range(len(tok)) if (int(row[i // 32]) >> (i % 32)) & 1}

    before = allowed(free)
    assert set(spaces) & before  # free whitespace after "{"
    for _ in range(MAX_JSON_WHITESPACE_TOKENS - 1):
        assert free.accept(spaces[0]) and not free.whitespace_capped
    assert allowed(free) == before
    assert free.accept(spaces[0]) and free.whitespace_capped
    capped = allowed(free)
    assert capped == before - set(spaces) and capped  # the key's quote is still allowed
    free.rollback(1)
    assert not free.whitespace_capped and allowed(free) == before
    assert free.accept(spaces[0]) and free.whitespace_capped
    quote = tok.encode('"', add_special_tokens=False)
    assert len(quote) == 1 and free.accept(quote[0]) and not free.whitespace_capped
    assert not compact.whitespace_capped and not set(spaces) & allowed(compact)
