"""Finding connectors: by registered name, through kv_connector_module_path, and the start-up errors that name
the bad field (before any model is loaded where the config alone tells)."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import KVTransferConfig, make_engine_config, resolve_kv_transfer_config
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.kv_transfer.base import KVConnectorBase
from pagedllm.kv_transfer.cpu_offloading import OffloadingConnector
from pagedllm.kv_transfer.factory import get_connector_class, register_connector, registered_connectors
from tests.kv_transfer.connectors import FailingLoadConnector


def test_registered_and_external_connectors_are_found():
    assert "OffloadingConnector" in registered_connectors()
    offloading = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 4})
    assert get_connector_class(offloading) is OffloadingConnector
    external = KVTransferConfig(
        "FailingLoadConnector",
        kv_connector_module_path="tests.kv_transfer.connectors",
        kv_connector_extra_config={"num_cpu_blocks": 4},
    )
    assert get_connector_class(external) is FailingLoadConnector
    register_connector("TestFailingLoad", "tests.kv_transfer.connectors", "FailingLoadConnector")
    named = KVTransferConfig("TestFailingLoad", kv_connector_extra_config={"num_cpu_blocks": 4})
    assert get_connector_class(named) is FailingLoadConnector
    with pytest.raises(ValueError, match="already registered"):
        register_connector("TestFailingLoad", "somewhere.else", "Other")


@pytest.mark.parametrize(
    "transfer, field",
    [
        ({"kv_connector": "NoSuchConnector"}, "kv_transfer_config.kv_connector: unknown connector"),
        ({"kv_connector": "X", "kv_connector_module_path": "no.such.module"}, "kv_connector_module_path"),
        ({"kv_connector": "Missing", "kv_connector_module_path": "tests.kv_transfer.connectors"}, "kv_connector"),
        (
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"num_cpu_blocks": 4}},
            "kv_transfer_config.kv_role",
        ),
        ({"kv_connector": "OffloadingConnector", "kv_role": "both"}, "kv_transfer_config.kv_role"),
        ({"kv_connector": "OffloadingConnector", "extra": 1}, "unknown keys"),
        ({"kv_role": "kv_both"}, "kv_transfer_config.kv_connector is required"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": []}, "kv_connector_extra_config"),
        ({"kv_connector": "OffloadingConnector"}, "needs num_cpu_blocks or cpu_bytes_to_use"),
        (
            {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": "1G"}},
            "cpu_bytes_to_use must be a number",
        ),
        (
            {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 4, "block_size": 64}},
            "does not know",
        ),
        (
            {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 2.5}},
            "kv_connector_extra_config.num_cpu_blocks",
        ),
    ],
)
def test_bad_kv_transfer_config_names_the_field(tiny_llama, transfer, field):
    with pytest.raises(ValueError, match=field):
        make_engine_config(tiny_llama, device="cpu", kv_transfer_config=transfer)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"kv_offloading_size": 0}, "kv_offloading_size"),
        ({"swap_space": -1.0}, "swap_space"),
        ({"kv_offloading_size": 1.0, "swap_space": 2.0}, "swap_space"),
        ({"kv_offloading_backend": "lmcache", "kv_offloading_size": 1.0}, "kv_offloading_backend"),
        ({"kv_offloading_backend": "native"}, "kv_offloading_size"),
        ({"kv_offloading_size": 1.0, "kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "cannot be"),
    ],
)
def test_bad_offloading_flags_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        resolve_kv_transfer_config(
            kw.get("kv_transfer_config"),
            kw.get("kv_offloading_size"),
            kw.get("kv_offloading_backend"),
            kw.get("swap_space"),
        )


def test_offloading_size_and_swap_space_size_the_same_pool():
    by_size = resolve_kv_transfer_config(None, 0.5, "native", None)
    by_swap = resolve_kv_transfer_config(None, None, None, 0.5)
    assert by_size == by_swap
    assert by_size.kv_connector == "OffloadingConnector" and by_size.kv_role == "kv_both"
    assert by_size.kv_connector_extra_config == {"cpu_bytes_to_use": 2**29}
    assert resolve_kv_transfer_config(None, None, None, None) is None


def test_server_flags_reach_the_engine_config(tiny_llama):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
         '{"num_cpu_blocks": 8}}']
    )
    config = make_engine_config(tiny_llama, **{**engine_kwargs_from_args(args), "device": "cpu"})
    assert config.kv_transfer_config == KVTransferConfig("OffloadingConnector", "kv_both", {"num_cpu_blocks": 8})
    args = parser.parse_args(["--kv-offloading-size", "0.25", "--kv-offloading-backend", "native"])
    config = make_engine_config(tiny_llama, **{**engine_kwargs_from_args(args), "device": "cpu"})
    assert config.kv_transfer_config.kv_connector_extra_config == {"cpu_bytes_to_use": 2**28}
    args = parser.parse_args([])
    assert make_engine_config(tiny_llama, **{**engine_kwargs_from_args(args), "device": "cpu"}).kv_transfer_config is None


def test_unsupported_combinations_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="data_parallel_size"):
        make_engine_config(tiny_llama, device="cpu", kv_offloading_size=0.01, data_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        make_engine_config(
            tiny_llama,
            device="cpu",
            kv_offloading_size=0.01,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
        )


def test_a_cpu_tier_smaller_than_a_block_fails_at_start_up(tiny_llama):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="cpu_bytes_to_use: the CPU tier must hold at least one block"):
        LLM(
            tiny_llama,
            device="cpu",
            kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 10}},
        )
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        LLM(
            tiny_llama,
            device="cpu",
            kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 0}},
        )


def test_base_connector_is_a_no_op(tiny_llama):
    """A connector that only inherits the base class: the engine runs as without one."""
    from pagedllm import LLM, SamplingParams

    register_connector("TestNoOp", "tests.kv_transfer.test_connector_registry", "NoOpConnector")
    llm = LLM(
        tiny_llama, device="cpu", dtype="float32", block_size=4, kv_transfer_config={"kv_connector": "TestNoOp"}
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.check_integrity()


class NoOpConnector(KVConnectorBase):
    pass


def test_delayed_free_keeps_blocks_until_the_worker_reports_them(tiny_llama):
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        tiny_llama,
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_transfer_config={"kv_connector": "DelayedFreeConnector", "kv_connector_module_path": "tests.kv_transfer.connectors"},
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params)
    scheduler = engine.engine_core.scheduler
    while not scheduler.delayed_free:
        engine.step()
    assert "a" in engine.engine_core.kv_cache_manager.req_to_blocks  # finished, blocks still held
    engine.engine_core.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert not scheduler.delayed_free
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    engine.engine_core.check_integrity()


def test_worker_side_calls_come_in_order_every_step(tiny_llama):
    from pagedllm import LLM, SamplingParams
    from tests.kv_transfer.connectors import RecordingConnector

    RecordingConnector.calls.clear()
    llm = LLM(
        tiny_llama,
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_transfer_config={"kv_connector": "RecordingConnector", "kv_connector_module_path": "tests.kv_transfer.connectors"},
    )
    num_layers = len(llm.llm_engine.engine_core.runner.kv_caches)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
    one_step = (
        [("start_load_kv",)]
        + [("wait_for_layer_load", i) for i in range(num_layers)]
        + [("save_kv_layer", i) for i in range(num_layers)]
        + [("wait_for_save",)]
    )
    calls = RecordingConnector.calls
    assert len(calls) % len(one_step) == 0 and len(calls) >= 3 * len(one_step)
    assert calls == one_step * (len(calls) // len(one_step))
