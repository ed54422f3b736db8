"""Shape directories (pagedllm/benchmarks/shapes.py): their stand-in tokenizer gives random-prompt datasets prompts
that do not repeat one another, so a prefill-heavy benchmark prefills rather than hitting the prefix cache."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagedllm.benchmarks.datasets import random_token_prompts
from pagedllm.benchmarks.shapes import STAND_IN_VOCAB, write_shape_dir


def test_random_prompts_from_a_shape_dir_share_no_first_block(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(write_shape_dir("llama-3.1-8b", tmp_path / "llama"))
    assert len(tokenizer) == STAND_IN_VOCAB
    prompts = random_token_prompts(tokenizer, num_prompts=200, input_len=64, output_len=8, seed=3)
    first_blocks = {tuple(p.prompt_token_ids[:16]) for p in prompts}
    # vLLM's scheme starts prompt i at (offset_i + i) % vocab: a few may collide, most must not (with the former
    # 26-word tokenizer at most 26 of them differed).
    assert len(first_blocks) >= 0.98 * len(prompts)
