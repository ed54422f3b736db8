"""int4 packing: known bit patterns, round trips, agreement with the test's independent packers, and checks that a
wrong layout reading gives different weights (so the checkpoint tests can fail)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.quantization.awq import AWQConfig
from pagedllm.quantization.base import AWQ_ORDER, GPTQ_ORDER, matches_module, pack_int4, unpack_int4
from pagedllm.quantization.gptq import GPTQConfig
from tests.quantization.quant_utils import (
    AWQ_PACK_ORDER,
    pack_cols,
    pack_rows_gptq,
    quantize_awq,
    quantize_gptq,
)


def test_known_bit_patterns():
    row = torch.arange(8).reshape(1, 8)
    assert pack_int4(row, dim=1, order=GPTQ_ORDER).item() == 0x76543210
    assert pack_int4(row, dim=1, order=AWQ_ORDER).item() == 0x75316420
    # the sign bit: 0xF in the top nibble is a negative int32
    top = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]])
    packed = pack_int4(top, dim=1)
    assert packed.item() == 0xF0000000 - 2**32
    assert unpack_int4(packed, dim=1).tolist() == top.tolist()


@pytest.mark.parametrize("order", [GPTQ_ORDER, AWQ_ORDER], ids=["gptq", "awq"])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip(order, dim):
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (24, 40), generator=gen)
    packed = pack_int4(values, dim=dim, order=order)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] * 8 == values.shape[dim]
    assert torch.equal(unpack_int4(packed, dim=dim, order=order).long(), values)


def test_library_reads_independent_packers():
    values = np.random.default_rng(0).integers(0, 16, size=(32, 48)).astype(np.uint8)
    ref = torch.from_numpy(values).long()
    assert torch.equal(unpack_int4(pack_rows_gptq(values), dim=0, order=GPTQ_ORDER).long(), ref)
    assert torch.equal(unpack_int4(pack_cols(values, AWQ_PACK_ORDER), dim=1, order=AWQ_ORDER).long(), ref)
    assert torch.equal(unpack_int4(pack_cols(values, tuple(range(8))), dim=1).long(), ref)


def test_wrong_nibble_order_reads_different_weights():
    values = np.random.default_rng(1).integers(0, 16, size=(16, 64)).astype(np.uint8)
    awq_packed = pack_cols(values, AWQ_PACK_ORDER)
    as_gptq = unpack_int4(awq_packed, dim=1, order=GPTQ_ORDER).numpy()
    assert not np.array_equal(as_gptq, values)
    # and GPTQ's qweight packs along the input dim: reading it along the output dim is wrong too
    gptq_packed = pack_rows_gptq(values)
    assert gptq_packed.shape == (2, 64)
    assert not np.array_equal(unpack_int4(gptq_packed, dim=0, order=AWQ_ORDER).numpy(), values)


def _load_layer(layer: Linear, method, tensors_per_shard: list[dict[str, torch.Tensor]]) -> None:
    layer.set_linear_method(method)
    for shard_id, tensors in enumerate(tensors_per_shard):
        for suffix, tensor in tensors.items():
            param = getattr(layer, suffix)
            if layer.fused:
                param.weight_loader(param, tensor, shard_id)
            else:
                param.weight_loader(param, tensor)
    method.process_weights_after_loading(layer)


def test_gptq_fused_shards_with_different_g_idx():
    """q/k/v quantized with different act-order permutations: each shard uses its own g_idx."""
    gen = torch.Generator().manual_seed(0)
    sizes = [64, 32, 32]
    layer = MergedLinear(64, sizes)
    weights = [torch.randn(n, 64, generator=gen) for n in sizes]
    parts = [quantize_gptq(w, 16, True, gen) for w in weights]
    assert not torch.equal(parts[0][0]["g_idx"], parts[1][0]["g_idx"])
    method = GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True})
    _load_layer(layer, method.get_linear_method(layer, "x", ["x"]), [p for p, _ in parts])
    assert layer.g_idx.shape == (3, 64)
    assert not layer.g_idx_shared
    expected = torch.cat([deq for _, deq in parts])
    assert torch.equal(layer.quant_method.dequantize(layer), expected)
    # the v1 zero convention matters: reading it as v2 (zero stored as is) gives other weights
    layer.quant_method.config.checkpoint_format = "gptq_v2"
    assert not torch.equal(layer.quant_method.dequantize(layer), expected)


def test_awq_layer_dequantizes_and_packs_outputs():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    tensors, deq = quantize_awq(w, 32)
    assert tensors["qweight"].shape == (64, 6) and tensors["qzeros"].shape == (2, 6)
    layer = Linear(64, 48)
    config = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM"})
    _load_layer(layer, config.get_linear_method(layer, "x", ["x"]), [tensors])
    assert torch.equal(layer.quant_method.dequantize(layer), deq)
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, deq))


def test_shard_sizes_must_fit_the_packing():
    layer = MergedLinear(64, [60, 4])
    config = AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="not a multiple of 8"):
        layer.set_linear_method(config.get_linear_method(layer, "x", ["x"]))


def test_module_name_matching():
    assert matches_module("lm_head", "lm_head")
    assert matches_module("model.layers.3.mlp.down_proj", "mlp.down_proj")
    assert matches_module("model.layers.3.mlp.down_proj", "re:.*down_proj$")
    assert not matches_module("model.layers.3.mlp.down_proj", "down")
    assert not matches_module("model.layers.13.mlp.down_proj", "layers.1")
