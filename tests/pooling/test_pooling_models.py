"""Pooling models offline (``LLM.embed / encode / classify / score``) against sentence-transformers and
transformers, float32 on CPU: every architecture and pooling type, mixed lengths, a token budget small enough
that the batch takes several steps."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.pooling.pooling_utils import (
    TEXTS,
    assert_close,
    hf_classifier_logits,
    hf_last_hidden,
    make_classifier,
    make_st_embedder,
    save_base_model,
    st_embed_ref,
)

BUDGET = 80  # tokens per step: the longest text fits, all of them together do not


def _embeddings(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pooling_models")
    return {
        "bert-mean": make_st_embedder("bert", root / "bert-mean", "mean"),
        "bert-cls": make_st_embedder("bert", root / "bert-cls", "cls"),
        "bert-mean-raw": make_st_embedder("bert", root / "bert-mean-raw", "mean", normalize=False),
        "bert-last": make_st_embedder("bert", root / "bert-last", "lasttoken"),
        "xlm-roberta-cls": make_st_embedder("xlm-roberta", root / "xlmr-cls", "cls"),
        "xlm-roberta-mean": make_st_embedder("xlm-roberta", root / "xlmr-mean", "mean"),
        "qwen3-last": make_st_embedder("qwen3", root / "qwen3-last", "lasttoken"),
        "qwen3-mean": make_st_embedder("qwen3", root / "qwen3-mean", "mean"),
        "qwen2-last": make_st_embedder("qwen2", root / "qwen2-last", "lasttoken"),
        "llama-cls": make_st_embedder("llama", root / "llama-cls", "cls"),
    }


EMBEDDERS = [
    "bert-mean",
    "bert-cls",
    "bert-mean-raw",
    "bert-last",
    "xlm-roberta-cls",
    "xlm-roberta-mean",
    "qwen3-last",
    "qwen3-mean",
    "qwen2-last",
    "llama-cls",
]


@pytest.mark.parametrize("name", EMBEDDERS)
def test_embed_matches_sentence_transformers(models: dict[str, str], name: str) -> None:
    path = models[name]
    with LLM(path, max_num_batched_tokens=BUDGET, max_num_seqs=4) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        stats = llm.llm_engine.last_stats
    ref = st_embed_ref(path, TEXTS)
    ours = _embeddings(outs)
    assert_close(ours, ref)
    if name == "bert-mean-raw":  # no Normalize module: not normalized
        assert (ours.norm(dim=-1) - 1).abs().max() > 1e-2
    else:
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert stats.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outs) > BUDGET


def test_encode_is_raw_pooled_hidden_state(models: dict[str, str]) -> None:
    path = models["bert-mean"]
    with LLM(path, max_num_batched_tokens=BUDGET) as llm:
        outs = llm.encode(TEXTS, use_tqdm=False)
    ref = hf_last_hidden(path.replace("/st", "/hf"), TEXTS, "mean")
    assert_close(torch.stack([o.outputs.data for o in outs]), ref)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_causal_lm_checkpoint_as_embedder(tmp_path, arch: str) -> None:
    """A decoder saved as a causal LM serves as a last-token embedder with runner='pooling' (normalized)."""
    from tests.utils import make_tiny_model

    path = make_tiny_model(arch, tmp_path / arch)
    with LLM(path, runner="pooling", max_num_batched_tokens=BUDGET, max_num_seqs=3) as llm:
        ours = _embeddings(llm.embed(TEXTS, use_tqdm=False))
    ref = torch.nn.functional.normalize(hf_last_hidden(path, TEXTS, "last"), dim=-1)
    assert_close(ours, ref)


def test_bare_qwen3_model_defaults_to_last_token(tmp_path) -> None:
    """A Qwen3Model checkpoint without sentence-transformers modules: the pooling runner by itself is not chosen
    (no modules.json, not an encoder), so runner='pooling' asks for it; last token, normalized."""
    path = save_base_model("qwen3", tmp_path / "qwen3")
    with LLM(path, runner="pooling", max_num_batched_tokens=BUDGET) as llm:
        ours = _embeddings(llm.embed(TEXTS, use_tqdm=False))
    assert_close(ours, torch.nn.functional.normalize(hf_last_hidden(path, TEXTS, "last"), dim=-1))


@pytest.mark.parametrize("arch", ["xlm-roberta", "bert"])
def test_cross_encoder_score_and_classify(tmp_path, arch: str) -> None:
    """A BERT cross-encoder's tokenizer gives the second text of a pair segment id 1: token_type_ids reach the
    model."""
    path = make_classifier(arch, tmp_path / arch, num_labels=1, pair_type_ids=arch == "bert")
    query, docs = TEXTS[1], TEXTS[:4] + TEXTS[5:]
    with LLM(path, max_num_batched_tokens=BUDGET * 2, max_num_seqs=2) as llm:
        assert llm.llm_engine.config.model_config.runner_type == "pooling"  # chosen from the architecture
        scores = llm.score(query, docs, use_tqdm=False)
        probs = llm.classify(TEXTS, use_tqdm=False)
    ref = torch.sigmoid(hf_classifier_logits(path, [query] * len(docs), docs))[:, 0]
    assert torch.allclose(torch.tensor([s.outputs.score for s in scores]), ref, atol=1e-5, rtol=0)
    ref = torch.sigmoid(hf_classifier_logits(path, TEXTS))
    assert torch.allclose(torch.tensor([p.outputs.probs for p in probs]), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decoder_sequence_classifier(tmp_path, arch: str) -> None:
    path = make_classifier(arch, tmp_path / arch, num_labels=3)
    with LLM(path, max_num_batched_tokens=BUDGET, max_num_seqs=4) as llm:
        probs = torch.tensor([p.outputs.probs for p in llm.classify(TEXTS, use_tqdm=False)])
        logits = torch.stack([o.outputs.data for o in llm.encode(TEXTS, use_tqdm=False)])
    ref = hf_classifier_logits(path, TEXTS)
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0)
    assert torch.allclose(probs, torch.softmax(ref, dim=-1), atol=1e-5, rtol=0)


def test_decoder_cross_encoder_score(tmp_path) -> None:
    path = make_classifier("qwen3", tmp_path / "qwen3", num_labels=1)
    with LLM(path, max_num_batched_tokens=BUDGET * 2) as llm:
        scores = [
            s.outputs.score for s in llm.score([TEXTS[0], TEXTS[1]], [TEXTS[4], TEXTS[5]], use_tqdm=False)
        ]
    ref = torch.sigmoid(hf_classifier_logits(path, [TEXTS[0], TEXTS[1]], [TEXTS[4], TEXTS[5]]))[:, 0]
    assert torch.allclose(torch.tensor(scores), ref, atol=1e-5, rtol=0)


def test_embedding_model_score_is_cosine(models: dict[str, str]) -> None:
    path = models["bert-cls"]
    with LLM(path, max_num_batched_tokens=BUDGET) as llm:
        scores = [s.outputs.score for s in llm.score(TEXTS[0], TEXTS[1:4], use_tqdm=False)]
        same = llm.score([TEXTS[0], TEXTS[1]], [TEXTS[0], TEXTS[0]], use_tqdm=False)  # repeated texts embed once
    ref = st_embed_ref(path, TEXTS[:4])
    expected = torch.nn.functional.cosine_similarity(ref[:1], ref[1:], dim=-1)
    assert torch.allclose(torch.tensor(scores), expected, atol=1e-5, rtol=0)
    assert abs(same[0].outputs.score - 1.0) < 1e-6 and abs(same[1].outputs.score - expected[0].item()) < 1e-5


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_bare_encoder_is_a_pooling_model_by_itself(tmp_path, arch: str) -> None:
    """An encoder checkpoint without sentence-transformers modules: the pooling runner is chosen from the
    architecture, CLS pooling and normalization by default (vLLM's defaults)."""
    path = save_base_model(arch, tmp_path / arch)
    with LLM(path, max_num_batched_tokens=BUDGET, max_num_seqs=2) as llm:
        assert llm.llm_engine.config.model_config.runner_type == "pooling"
        ours = _embeddings(llm.embed(TEXTS, use_tqdm=False))
    assert_close(ours, torch.nn.functional.normalize(hf_last_hidden(path, TEXTS, "cls"), dim=-1))
