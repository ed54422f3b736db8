"""Start-up checks of a tensor-parallel split (no processes needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.distributed import TPGroup, init_tp_group, local_num_kv_heads, verify_tp_config
from pagedllm.layers.linear import QKVLinear


def _config(heads: int = 8, kv: int = 4, inter: int = 128) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)


def test_valid_splits() -> None:
    for tp_size in (1, 2, 4, 8):  # kv 4 with 8 ranks: each KV head on 2 ranks
        verify_tp_config(_config(), tp_size)
    assert [local_num_kv_heads(4, t) for t in (1, 2, 4, 8)] == [4, 2, 1, 1]


@pytest.mark.parametrize(
    "config, tp_size, field",
    [
        (_config(heads=8), 3, r"num_attention_heads \(8\) must be divisible by tensor_parallel_size \(3\)"),
        (
            _config(heads=12, kv=6),
            4,
            r"num_key_value_heads \(6\) must be divisible by tensor_parallel_size \(4\)",
        ),
        (_config(heads=12, kv=3), 4, r"num_key_value_heads \(3\) is smaller than tensor_parallel_size \(4\)"),
        (_config(inter=100), 8, r"intermediate_size \(100\) must be divisible"),
        (_config(), 0, "tensor_parallel_size must be a positive integer"),
    ],
)
def test_bad_splits_name_the_field(config, tp_size: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        verify_tp_config(config, tp_size)


def test_layer_checks_its_heads() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        QKVLinear(32, 8, 6, 2, tp=TPGroup(rank=0, size=4))
    qkv = QKVLinear(32, 8, 8, 2, tp=TPGroup(rank=3, size=4))  # KV head 1 on ranks 2 and 3
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.output_sizes) == (2, 1, [16, 8, 8])
    assert qkv.shard_slice_starts == [48, 8, 8]


def test_tp_group() -> None:
    assert init_tp_group(1, 0, "file:///unused") == TPGroup.single()
    with pytest.raises(ValueError, match="invalid tensor-parallel rank 2 of size 2"):
        TPGroup(rank=2, size=2)
