"""MTP speculative decoding (``method="mtp"``): DeepSeek-V3's multi-token-prediction layer, shipped inside the
target checkpoint as ``model.layers.{num_hidden_layers}.*``, drafts for the target. Tiny random checkpoints saved
by transformers with an MTP layer added to their safetensors (float32, CPU).

Greedy output equals decoding without speculation (k = 1 and 2, a batch, chunked prefill, prefix hits); the
layer's incremental KV cache proposes what a fresh pass proposes; seeded sampling repeats; constrained requests
speculate exactly; aborts leak no blocks; an MTP layer built to predict what the target predicts gets every draft
accepted; targets without MTP layer weights are refused at start-up, naming ``speculative_config.method``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.models.test_deepseek import make_tiny_deepseek
from tests.spec_decode.test_eagle import _drafts_log
from tests.spec_decode.test_spec_engine import assert_no_leaks, stats

NUM_LAYERS = 3  # tests/models/test_deepseek.py's tiny config: layer 0 dense, layers 1-2 MoE
MAX_NEW = 16
V3 = dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


def add_mtp_layer(path: str, seed: int, copy_target: bool = False) -> str:
    """Add an MTP layer ``model.layers.{NUM_LAYERS}.*`` (DeepSeek-V3's names: a decoder layer shaped like the last
    one, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}`` and a copy of the embedding) to the
    one-file checkpoint at ``path``, with random weights.

    ``copy_target``: instead, make target and MTP layer agree. Every attention output and MLP down projection
    (target and MTP) is zeroed, so the target's next token is a function of the current token alone,
    ``argmax(lm_head(norm(embed(x))))``; the MTP layer, its decoder layer adding nothing, computes
    ``lm_head(rms(enorm(embed(x))))`` with ``enorm`` = the target's final norm and ``eh_proj`` = ``[I | 0]``: a
    positive multiple of the target's logits for the same token, so every draft is the target's next token."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)

    def rand(name: str, shape: torch.Size) -> torch.Tensor:
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * noise
        if name.endswith((".bias", "e_score_correction_bias")):
            return 0.1 * noise
        return 0.15 * noise

    src, dst = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
    embed = tensors["model.embed_tokens.weight"]  # [V, H]
    h = embed.shape[1]
    for name in [n for n in tensors if n.startswith(src)]:
        mtp_name = dst + name[len(src) :]
        tensors[mtp_name] = rand(mtp_name, tensors[name].shape)
    for leaf, shape in (
        ("enorm.weight", (h,)),
        ("hnorm.weight", (h,)),
        ("eh_proj.weight", (h, 2 * h)),
        ("shared_head.norm.weight", (h,)),
        ("shared_head.head.weight", tuple(embed.shape)),
    ):
        tensors[dst + leaf] = rand(dst + leaf, torch.Size(shape))
    tensors[dst + "embed_tokens.weight"] = embed.clone()
    if copy_target:
        for name, t in tensors.items():
            if "o_proj." in name or "down_proj" in name:
                tensors[name] = torch.zeros_like(t)
        tensors[dst + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        tensors[dst + "enorm.weight"] = tensors["model.norm.weight"].clone()
        tensors[dst + "shared_head.norm.weight"] = torch.ones(h)
        tensors[dst + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def v3_dirs(tmp_path_factory) -> dict[str, str]:
    """``plain``: transformers' checkpoint as saved (config declares one MTP layer, no MTP weights); ``mtp``: the
    same with a random MTP layer; ``copy``: with an MTP layer that predicts what the target predicts."""
    root = tmp_path_factory.mktemp("mtp")
    dirs = {
        "plain": make_tiny_deepseek("DeepseekV3Config", root / "plain", 41, num_nextn_predict_layers=1, **V3)
    }
    for seed, name in enumerate(("mtp", "copy")):
        shutil.copytree(dirs["plain"], root / name)
        dirs[name] = add_mtp_layer(str(root / name), seed=51 + seed, copy_target=name == "copy")
    return dirs


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab) for _ in range(12)]  # 3 full blocks another prompt hits
    return [
        shared + [rng.randrange(3, vocab) for _ in range(6)],
        [rng.randrange(3, vocab) for _ in range(21)],
        [7, 8, 9, 10] * 4,
        shared + [rng.randrange(3, vocab) for _ in range(3)],
    ]


def _llm(path: str, k: int | None = 2, **kw) -> LLM:
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    kw = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, max_num_seqs=8) | kw
    return LLM(path, speculative_config=spec, **kw)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def _plain_greedy(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy output without speculation): the target loads with the MTP tensors in its checkpoint."""
    llm = _llm(path, k=None)
    prompts = _prompts(llm.llm_engine.engine_core.vocab_size)
    return prompts, _greedy(llm, prompts)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_plain_decoding(v3_dirs, k, admit_while_blocks_last):
    """A batch of prompts split into chunks of at most 8 tokens, two sharing a prefix (prefix-cache hits); with
    k = 2 a 20-block pool also preempts requests mid-generation (the MTP layer's cache is rebuilt with theirs)."""
    prompts, want = _plain_greedy(v3_dirs["mtp"])
    pool = {"num_gpu_blocks_override": 20, "max_model_len": 64} if k == 2 else {}
    llm = _llm(v3_dirs["mtp"], k=k, max_num_batched_tokens=8, enable_prefix_caching=True, **pool)
    assert _greedy(llm, prompts) == want
    s = stats(llm)
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens >= s.spec_num_drafts
    assert s.prefix_cache_hits > 0
    assert s.num_preemptions > 0 or k == 1
    assert_no_leaks(llm)


def test_incremental_mtp_cache_gives_the_drafts_of_a_fresh_pass(v3_dirs):
    """The MTP layer's own cache, kept step by step (prefill chunks, rejected drafts rolled back, two requests
    sharing steps), proposes what a fresh engine proposes after prefilling the same tokens in one pass. The
    21-token prompt's chunks of 5 stop one token short of its end, where the request gets one draft (its blocks end
    there) and the layer must not write past its blocks."""
    chunked = _llm(v3_dirs["mtp"], k=2, max_num_batched_tokens=5)
    prompts, _ = _plain_greedy(v3_dirs["mtp"])
    log = _drafts_log(chunked, [prompts[1], prompts[2]], max_tokens=14)
    assert (prompts[1], 1) in [(t, len(d)) for t, d in log]  # drafted one token short of the prompt's end
    log = [
        (t, d) for t, d in log if len(d) == 2 and t not in prompts
    ]  # after a sampled token, drafts not capped
    assert len(log) > 6
    fresh = _llm(v3_dirs["mtp"], k=2, enable_prefix_caching=False)
    for tokens, drafts in log[::3]:
        fresh_log = _drafts_log(fresh, [tokens[:-1]], max_tokens=5)
        assert fresh_log[0] == (tokens, drafts)


def test_mtp_seeded_sampling_repeats(v3_dirs):
    """temperature > 0: a seeded request gives the same tokens alone, in a batch and in another run."""
    llm = _llm(v3_dirs["mtp"])
    prompts, _ = _plain_greedy(v3_dirs["mtp"])
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    batch = [o.outputs[0].token_ids for o in llm.generate(inputs, sp, use_tqdm=False)]
    alone = llm.generate(inputs[1:2], sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(inputs[1:2], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert batch[1] == alone == again
    assert stats(llm).spec_num_drafts > 0
    assert_no_leaks(llm)


def test_mtp_with_structured_outputs(v3_dirs):
    """Constrained requests speculate, and their tokens are those of decoding without speculation."""
    path = v3_dirs["mtp"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd)+[0-9]{2,6}")),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=["red green blue", "red red red"])),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, disable_any_whitespace=True)),
    ]  # fmt: skip
    prompts = ["abab12 cdcd", "red green", '{"n": 12}']
    want = _llm(path, k=None).generate(prompts, params, use_tqdm=False)
    llm = _llm(path)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert got[1].outputs[0].text in ("red green blue", "red red red")
    assert stats(llm).spec_num_drafts > 0
    assert_no_leaks(llm)


def test_mtp_aborts_leak_no_blocks(v3_dirs):
    """Requests aborted mid-generation between steps with drafts in flight: the pool invariants hold after every
    step and every block is back at the end."""
    llm = _llm(v3_dirs["mtp"], num_gpu_blocks_override=20, max_model_len=48)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    prompts, _ = _plain_greedy(v3_dirs["mtp"])
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        core.check_integrity()
        steps += 1
        if steps in (3, 6):
            engine.abort_request([f"r{steps // 3}"])  # r1 while its drafts are in flight, then r2
    assert stats(llm).spec_num_draft_tokens > 0
    assert_no_leaks(llm)


def test_mtp_layer_that_copies_the_target_is_always_accepted(v3_dirs):
    prompts, want = _plain_greedy(v3_dirs["copy"])
    llm = _llm(v3_dirs["copy"], k=2)
    assert _greedy(llm, prompts) == want
    s = stats(llm)
    assert s.spec_num_draft_tokens > 0
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens


def test_mtp_defaults_and_startup_errors(v3_dirs, tiny_llama, tmp_path):
    # num_speculative_tokens defaults to the checkpoint's number of MTP layers, model to the target (as vLLM)
    llm = LLM(v3_dirs["mtp"], device="cpu", speculative_config={"method": "deepseek_mtp"})
    spec = llm.llm_engine.engine_core.config.speculative_config
    assert spec.num_speculative_tokens == 1 and os.path.samefile(spec.model, v3_dirs["mtp"])
    del llm
    # load_format="dummy": a random MTP layer for the declared one, no weights read
    llm = _llm(v3_dirs["plain"], k=2, load_format="dummy")
    assert len(_greedy(llm, [[5, 6, 7, 8, 9]], max_tokens=6)[0]) == 6
    assert stats(llm).spec_num_drafts > 0
    del llm
    # transformers' DeepSeek-V3 config declares an MTP layer, but its save_pretrained drops the weights
    with pytest.raises(ValueError, match="speculative_config.method 'mtp'.*no MTP layer weights"):
        _llm(v3_dirs["plain"])
    with pytest.raises(ValueError, match="speculative_config.method 'deepseek_mtp'.*LlamaForCausalLM"):
        LLM(
            tiny_llama,
            device="cpu",
            speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
        )
    config = json.loads((Path(v3_dirs["mtp"]) / "config.json").read_text())
    no_mtp = tmp_path / "no_mtp"
    no_mtp.mkdir()
    for f in Path(v3_dirs["mtp"]).iterdir():
        (no_mtp / f.name).symlink_to(f)
    (no_mtp / "config.json").unlink()
    config = {k: v for k, v in config.items() if k not in ("num_nextn_predict_layers", "num_mtp_layers")}
    (no_mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="speculative_config.method 'mtp'.*declares no MTP layers"):
        _llm(str(no_mtp))
    with pytest.raises(ValueError, match="speculative_config.model must be the target's own checkpoint"):
        LLM(v3_dirs["mtp"], device="cpu",
            speculative_config={"method": "mtp", "model": v3_dirs["copy"], "num_speculative_tokens": 1})  # fmt: skip
    no_head = tmp_path / "no_head"
    shutil.copytree(v3_dirs["mtp"], no_head)
    weights = load_file(str(no_head / "model.safetensors"))
    n = config["num_hidden_layers"]
    del weights[f"model.layers.{n}.shared_head.head.weight"]
    save_file(weights, str(no_head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size > 1 needs an MTP layer with its own LM head"):
        LLM(str(no_head), device="cpu", pipeline_parallel_size=2, distributed_executor_backend="mp",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip


@pytest.mark.parametrize("name", ["mtp", "copy"])
def test_mtp_under_pipeline_parallelism_drafts_as_in_one_process(v3_dirs, name):
    """PP=2: the MTP layer runs on rank 0 (the first stage holds the embedding; the layer has its own LM head) over
    the last stage's final hidden states, which the sampler sends after each step. The drafts are the
    one-process engine's, step by step (each stage computes its layers as one process does); the layer that
    copies the target has every draft accepted; every rank's batch equals rank 0's; no block leaks."""
    from tests.distributed.test_pp_engine import record_drafts
    from tests.spec_decode.test_spec_tp import check_every_step

    prompts, want = _plain_greedy(v3_dirs[name])
    one = _llm(v3_dirs[name], k=2, max_num_batched_tokens=16)
    drafts_one = record_drafts(one)
    assert _greedy(one, prompts) == want
    one.llm_engine.engine_core.shutdown()
    llm = _llm(v3_dirs[name], k=2, max_num_batched_tokens=16, pipeline_parallel_size=2)
    try:
        core = llm.llm_engine.engine_core
        drafts = record_drafts(llm)
        checks = check_every_step(llm)
        assert _greedy(llm, prompts) == want and checks[0] > 0
        assert drafts == drafts_one and any(d for step_drafts in drafts for _, d in step_drafts)
        s = stats(llm)
        if name == "copy":
            assert 0 < s.spec_num_accepted_tokens == s.spec_num_draft_tokens
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        core.shutdown()
