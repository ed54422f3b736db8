"""Pooling models on CUDA (float32, CUDA graphs as configured by default) against sentence-transformers on the CPU:
an encoder (BERT, CLS) and a decoder embedder (Qwen3, last token), mixed lengths over several steps."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.pooling.pooling_utils import TEXTS, make_st_embedder, st_embed_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("arch", "pooling"), [("bert", "cls"), ("qwen3", "lasttoken")])
def test_embeddings_on_cuda_match_sentence_transformers(tmp_path, arch, pooling):
    path = make_st_embedder(arch, tmp_path / arch, pooling)
    with LLM(path, runner="pooling", dtype="float32", device="cuda", max_num_batched_tokens=80) as llm:
        outs = llm.embed(TEXTS * 3, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    want = st_embed_ref(path, TEXTS).repeat(3, 1)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min().item() > 0.99999
    assert (got - want).abs().max().item() < 1e-4  # TF32 is off in float32; 1e-4 leaves room for kernel order
