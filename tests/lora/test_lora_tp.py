"""Multi-LoRA under tensor parallelism (CPU, gloo, two ranks).

How each rank's LoRA layers cut an adapter (in process, no torch.distributed: every rank's layer is built and
its output checked against the whole layer's), then ``LLM(enable_lora=True, tensor_parallel_size=2)`` on llama
and Phi-3: a mixed batch of the base model and four adapters (o_proj and down_proj included) gives
transformers + peft's greedy tokens, and adapters added and removed at run time reach the worker rank.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.lora.layers import LoRALinearMethod, LoRAMapping
from pagedllm.lora.request import LoRARequest
from tests.lora.test_lora_engine import assert_no_leaks, expected, generate, lora_requests, random_prompts

# ----------------------------------------------------------------------------------------- layer sharding

MAX_RANK = 8


def _lora_layer(make: type[Linear], tp: TPGroup, mapping: LoRAMapping) -> tuple[Linear, LoRALinearMethod]:
    """A layer of ``make``'s kind as rank ``tp`` holds it, with a zero base weight (its output is the LoRA
    delta alone) and LoRA slots installed."""
    torch.manual_seed(0)
    if make is QKVLinear:  # 4 query heads, 2 KV heads of 8: with T = 4 each KV head is held by two ranks
        layer = QKVLinear(32, 8, 4, 2, tp=tp)
    elif make is MergedLinear:
        layer = MergedLinear(32, [48, 48], tp=tp)
    else:
        layer = RowParallelLinear(48, 32, tp=tp)
    layer.weight.data.zero_()
    method = LoRALinearMethod(layer.quant_method, layer, mapping, 2, MAX_RANK, torch.float32, "cpu")
    layer.quant_method = method
    return layer, method


def _adapter(full: LoRALinearMethod, rank: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Whole-layer slices ``(A [r, in], B [out_s, r])``; the last slice left out when there are several."""
    gen = torch.Generator().manual_seed(seed)
    slices = [
        (torch.randn(rank, full.full_input_size, generator=gen), torch.randn(size, rank, generator=gen))
        for size in full.full_output_sizes
    ]
    if len(slices) > 1:
        slices[-1] = None
    return slices


@pytest.mark.parametrize("make", [QKVLinear, MergedLinear, RowParallelLinear], ids=["qkv", "gate_up", "row"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_holds_its_part_of_the_adapter(make, tp_size) -> None:
    """Column-parallel ranks give their rows of every slice of the whole layer's delta; row-parallel ranks,
    fed their input columns, give partial deltas that sum (the all-reduce) to the whole one."""
    mapping = LoRAMapping(16, 2)
    mapping.update([0, 0, -1, 1, 1, 1, 0])  # two adapters and a base row
    full_layer, full = _lora_layer(make, TPGroup.single(), mapping)
    adapters = [_adapter(full, r, seed) for seed, r in enumerate((8, 3))]
    for slot, slices in enumerate(adapters):
        full.set_slot(slot, slices)
    x = torch.randn(7, full.full_input_size, generator=torch.Generator().manual_seed(1))
    want = full_layer(x)  # [7, out]: the LoRA deltas only
    assert want[2].abs().max() == 0 and want[0].abs().max() > 0
    full_offsets = [sum(full.full_output_sizes[:s]) for s in range(len(full.full_output_sizes))]
    partial_sum = torch.zeros_like(want)
    for rank in range(tp_size):
        layer, method = _lora_layer(make, TPGroup(rank, tp_size), mapping)
        for slot, slices in enumerate(adapters):
            method.set_slot(slot, slices)
        x_local = x.narrow(1, method.input_start, method.input_size)  # whole x unless row-parallel
        got = method.apply(layer, x_local)  # before any all-reduce
        if make is RowParallelLinear:
            assert method.input_size == 48 // tp_size and method.full_output_sizes == [32]
            partial_sum += got
            continue
        assert method.input_size == 32
        for s, start in enumerate(method.output_starts):
            lo, size = method.slice_offsets[s], method.output_sizes[s]
            ref = want[:, full_offsets[s] + start : full_offsets[s] + start + size]
            torch.testing.assert_close(got[:, lo : lo + size], ref, atol=1e-5, rtol=1e-5)
    if make is RowParallelLinear:
        torch.testing.assert_close(partial_sum, want, atol=1e-5, rtol=1e-5)


def test_set_slot_checks_whole_layer_shapes() -> None:
    mapping = LoRAMapping(4, 1)
    _, method = _lora_layer(RowParallelLinear, TPGroup(1, 2), mapping)
    with pytest.raises(ValueError, match="in 48, out 32"):
        method.set_slot(0, [(torch.zeros(2, 24), torch.zeros(32, 2))])  # A already cut: refused


# ------------------------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module", params=["llama", "phi3"])
def arch(request) -> str:
    """llama: q/k/v and gate/up adapters on separate modules; Phi-3: adapters on its fused qkv / gate_up."""
    return request.param


@pytest.fixture(scope="module")
def tp_lora_llm(arch, tiny_model_dirs):
    """TP=2 with LoRA; Phi-3's engine also schedules asynchronously (the default on CUDA: each step's slots are
    given while the previous step still runs, and the sampled ids reach the worker on the device)."""
    llm = LLM(
        tiny_model_dirs[arch],
        async_scheduling=arch == "phi3",
        enable_lora=True,
        max_loras=4,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        dtype="float32",
        device="cpu",
        block_size=4,
        max_model_len=128,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_tp2_mixed_batch_matches_peft(tp_lora_llm, arch, tiny_model_dirs, lora_adapters) -> None:
    """Base rows and all four adapters (o_proj / down_proj ones included, ranks 2..16) in one batch."""
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    reqs = lora_requests(adapters)
    names = [None, "attn", "all", "rs", "pattern", None, "rs", "all"]
    prompts = random_prompts(len(names), tp_lora_llm.llm_engine.config.model_config.vocab_size, seed=11)
    got = generate(tp_lora_llm, prompts, [None if n is None else reqs[n] for n in names])
    assert got == expected(base, adapters, names, prompts)
    assert len({tuple(g) for g in got}) >= 5  # the adapters do change the output
    assert_no_leaks(tp_lora_llm)


def test_tp2_add_remove_at_run_time(tp_lora_llm, arch, tiny_model_dirs, lora_adapters, tmp_path) -> None:
    """add_lora / remove_lora reach the worker rank: a removed adapter's slot is freed on both ranks (each
    launch checks the worker's slot table against rank 0's), a re-added one serves peft's tokens, and a bad
    adapter is refused without disturbing the worker."""
    base, adapters = tiny_model_dirs[arch], lora_adapters[arch]
    engine = tp_lora_llm.llm_engine
    reqs = lora_requests(adapters)
    vocab = engine.config.model_config.vocab_size
    again = LoRARequest("rs-again", 10, adapters["rs"])
    assert engine.add_lora(again) is True
    assert engine.add_lora(again) is False
    assert again.lora_int_id in engine.list_loras()
    with pytest.raises(ValueError, match="not a directory"):
        engine.add_lora(LoRARequest("missing", 11, str(tmp_path / "nowhere")))
    attn = reqs["attn"].lora_int_id
    generate(tp_lora_llm, random_prompts(1, vocab, seed=12), [reqs["attn"]])  # attn holds a slot
    assert engine.remove_lora(attn) is True
    assert attn not in engine.list_loras()
    names = ["attn", None, "rs"]  # `again` is the rs adapter under another id
    prompts = random_prompts(3, vocab, seed=13)
    got = generate(tp_lora_llm, prompts, [reqs["attn"], None, again])
    assert got == expected(base, adapters, names, prompts)
    assert engine.remove_lora(again.lora_int_id) is True
    assert again.lora_int_id not in engine.list_loras()
    assert_no_leaks(tp_lora_llm)
