"""Bad input to pooling models offline: a ValueError naming the field, nothing queued; truncation on request;
Matryoshka ``dimensions``; the checkpoint's pooler settings."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.pooling.config import resolve_pooler_config
from tests.pooling.pooling_utils import TEXTS, assert_close, make_classifier, make_st_embedder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_st_embedder("bert", tmp_path_factory.mktemp("err") / "bert", "mean")


@pytest.fixture(scope="module")
def llm(embedder: str):
    with LLM(embedder, max_model_len=24, max_num_batched_tokens=20) as llm:
        yield llm


def test_params_validated_on_construction() -> None:
    for kwargs, field in (
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 1.5}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"normalize": "yes"}, "normalize"),
        ({"task": "generate"}, "task"),
    ):
        with pytest.raises(ValueError, match=field):
            PoolingParams(**kwargs)


@pytest.mark.parametrize("prompts", ["", [""], [], [[]], {"prompt": ""}])
def test_empty_input(llm, prompts) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.embed(prompts, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_too_long_refused_or_truncated(llm) -> None:
    long_text = TEXTS[3]  # ~30 tokens
    with pytest.raises(ValueError, match="maximum model length of 24.*truncate_prompt_tokens"):
        llm.embed([TEXTS[0], long_text], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the valid first prompt was not queued either
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # fits max_model_len, not the step budget
        llm.embed(list(range(3, 25)), use_tqdm=False)
    ids = llm.get_tokenizer()(long_text)["input_ids"]
    out = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[:10]  # text: the tokenizer truncates (its side: right)
    same = llm.embed(ids[:10], use_tqdm=False)[0]
    assert out.outputs.embedding == same.outputs.embedding
    out = llm.embed(ids, truncate_prompt_tokens=12, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-12:]  # token ids: the last ones kept, as vLLM
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(long_text, PoolingParams(truncate_prompt_tokens=100), use_tqdm=False)
    # -1: to max_model_len (24 tokens), which still does not fit this engine's step budget of 20
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.embed(long_text, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)


def test_mixed_batch_of_strings_and_token_ids(llm) -> None:
    with pytest.raises(ValueError, match="mixes strings and token-id lists"):
        llm.embed([TEXTS[0], [3, 4, 5]], use_tqdm=False)
    outs = llm.embed(
        [{"prompt": TEXTS[0]}, {"prompt_token_ids": [0, 3, 4, 5]}], use_tqdm=False
    )  # dicts: fine
    assert outs[1].prompt_token_ids == [0, 3, 4, 5]


def test_options_a_pooling_model_does_not_take(embedder) -> None:
    for kwargs, field in (
        ({"enable_lora": True}, "enable_lora"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
        ({"enable_sleep_mode": True}, "enable_sleep_mode"),
    ):
        with pytest.raises(ValueError, match=field):
            LLM(embedder, **kwargs)


def test_sentence_transformers_max_seq_length_caps_context(embedder, tmp_path) -> None:
    import shutil

    from pagedllm.config import ModelConfig

    path = tmp_path / "capped"
    shutil.copytree(embedder, path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    assert ModelConfig(str(path)).max_model_len == 32
    assert ModelConfig(embedder).max_model_len == 128


def test_token_ids_out_of_vocabulary(llm) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        llm.embed([[1, 2, 10**6]], use_tqdm=False)


def test_wrong_task_for_model(llm, tmp_path) -> None:
    with pytest.raises(ValueError, match="classif"):
        llm.classify(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling model.*cannot generate"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions.*Matryoshka"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    cls_path = make_classifier("xlm-roberta", tmp_path / "cls", num_labels=2)
    with LLM(cls_path, max_num_batched_tokens=64) as cls_llm:
        with pytest.raises(ValueError, match="classifier.*embed"):
            cls_llm.embed(TEXTS[0], use_tqdm=False)
        with pytest.raises(ValueError, match="one label"):
            cls_llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)
    with pytest.raises(ValueError, match="runner"):
        LLM(cls_path, runner="generate")
    with pytest.raises(ValueError, match="runner"):
        LLM(cls_path, runner="embedding")


def test_bad_pooling_task_and_params(llm) -> None:
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode(TEXTS[0], pooling_task="generate", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params.task"):
        llm.embed(TEXTS[0], PoolingParams(task="classify"), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params has 1 entries"):
        llm.embed(TEXTS[:2], [PoolingParams()], use_tqdm=False)


def test_score_pairing_errors(llm) -> None:
    with pytest.raises(ValueError, match="same length"):
        llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="data_2"):
        llm.score(TEXTS[0], [], use_tqdm=False)


def test_generator_has_no_embeddings(tiny_llama) -> None:
    with LLM(tiny_llama, max_model_len=64) as gen:
        with pytest.raises(ValueError, match="runner='pooling'"):
            gen.embed(TEXTS[0], use_tqdm=False)


def test_matryoshka_dimensions(tmp_path) -> None:
    path = make_st_embedder("bert", tmp_path / "mrl", "cls", matryoshka_dimensions=[16, 32, 64])
    with LLM(path, max_num_batched_tokens=80) as llm:
        full = llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
        short = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions must be one of"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=20), use_tqdm=False)
    full_t = torch.tensor([o.outputs.embedding for o in full])
    expected = torch.nn.functional.normalize(full_t[:, :16], dim=-1)
    assert_close(torch.tensor([o.outputs.embedding for o in short]), expected)


def _write_st(tmp_path, modules: list[tuple[str, str]], pooling_cfg: dict) -> str:
    entries = [{"idx": i, "name": str(i), "path": p, "type": t} for i, (p, t) in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_cfg))
    return str(tmp_path)


def test_pooler_config_from_classic_modules(tmp_path) -> None:
    classic = [
        ("", "sentence_transformers.models.Transformer"),
        ("1_Pooling", "sentence_transformers.models.Pooling"),
    ]
    path = _write_st(tmp_path, classic, {"pooling_mode_cls_token": False, "pooling_mode_lasttoken": True})
    cfg = resolve_pooler_config(path, object(), "Qwen3ForCausalLM")
    assert (cfg.pooling_type, cfg.normalize, cfg.is_classifier) == ("LAST", False, False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode"):
        resolve_pooler_config(path, object(), "BertModel")
    dense = [*classic, ("2_Dense", "sentence_transformers.models.Dense")]
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": i, "name": str(i), "path": p, "type": t} for i, (p, t) in enumerate(dense)])
    )
    with pytest.raises(ValueError, match="Dense"):
        resolve_pooler_config(path, object(), "BertModel")
    assert resolve_pooler_config(str(tmp_path / "1_Pooling"), object(), "BertModel").pooling_type == "CLS"


def test_pooler_config_overrides_the_checkpoint(embedder, tiny_llama) -> None:
    """vLLM's pooler_config: another pooling type / normalization than the checkpoint's; bad keys are refused."""
    from tests.pooling.pooling_utils import hf_last_hidden

    with LLM(
        embedder, pooler_config={"pooling_type": "CLS", "normalize": False}, max_num_batched_tokens=80
    ) as llm:
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert_close(ours, hf_last_hidden(embedder.replace("/st", "/hf"), TEXTS, "cls"))
    for bad, match in (
        ({"pooling_type": "MAX"}, "pooler_config.pooling_type"),
        ({"normalize": "no"}, "pooler_config.normalize"),
        ({"softmax": True}, "pooler_config: unknown keys"),
    ):
        with pytest.raises(ValueError, match=match):
            LLM(embedder, pooler_config=bad)
    with pytest.raises(ValueError, match="pooler_config applies to pooling models"):
        LLM(tiny_llama, pooler_config={"pooling_type": "MEAN"})


def test_batched_tokenization_equals_one_text_at_a_time(llm) -> None:
    """``LLM.embed`` tokenizes its texts in one batched call per truncation length: the same token ids as the
    one-prompt path, with token-id prompts, dict prompts and other truncations mixed in."""
    processor = llm.llm_engine.pooling_processor
    short = PoolingParams(truncate_prompt_tokens=5).with_task("embed")
    plain = PoolingParams().with_task("embed")
    items = [
        ("hello world", plain, None),
        ({"prompt": "the cat sat"}, short, None),
        ([5, 6, 7], plain, None),
        ("a much longer text that truncation cuts short", short, None),
        ("hello world", plain, "a pair"),
    ]
    batched = processor.tokenize_batch(items)
    for prompt, (original, params, pair) in zip(batched, items):
        want = processor.to_prompt(original, params, pair)
        got = processor.to_prompt(prompt, params, pair)
        assert (got.token_ids, got.token_type_ids) == (want.token_ids, want.token_type_ids)
    assert batched[2] == [5, 6, 7] and batched[4] == "hello world"  # left for to_prompt
