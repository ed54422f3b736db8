"""`pagedllm bench throughput --enable-lora --lora-path DIR`: a random adapter written by
``pagedllm.benchmarks.lora_adapters`` loads (PEFT layout, every Llama projection) and changes the output; the
requests spread over ``--num-loras`` adapter ids; bad flag combinations are usage errors."""

from __future__ import annotations

import argparse

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks import throughput
from pagedllm.benchmarks.lora_adapters import TARGETS, make_dummy_lora
from pagedllm.lora.request import LoRARequest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench throughput")
    throughput.add_cli_args(parser)
    return parser


def test_dummy_adapter_loads_and_changes_the_output(tiny_llama: str, tmp_path) -> None:
    path = make_dummy_lora(tiny_llama, str(tmp_path / "lora"), rank=8, std=0.2)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 17, 33, 2, 41]}
    base, tuned = llm.generate([prompt, prompt], params, lora_request=[None, LoRARequest("a", 1, path)])
    assert base.outputs[0].token_ids != tuned.outputs[0].token_ids
    manager = llm.llm_engine.engine_core.runner.lora_manager
    adapter = manager._cpu_cache[1]  # every projection (q/k/v/o, gate/up/down) of every layer, from the file
    assert set(adapter.layers) == set(manager.layers) and adapter.rank == 8
    assert all(p is not None for slices in adapter.layers.values() for p in slices)
    assert len(TARGETS) == 7


def test_requests_spread_over_num_loras(tiny_llama: str, tmp_path) -> None:
    path = make_dummy_lora(tiny_llama, str(tmp_path / "lora"), rank=8)
    args = _parser().parse_args(
        f"--device cpu --dtype float32 --num-prompts 12 --input-len 8 --output-len 4 --enable-lora --max-loras 4 "
        f"--max-lora-rank 8 --num-loras 3 --lora-path {path}".split()
        + ["--model", tiny_llama]
    )
    loras = throughput.lora_requests(args, 12)
    assert {r.lora_int_id for r in loras} == {1, 2, 3}
    result, outs = throughput.run_pagedllm_outputs(args, 0.0)
    assert result.lora == "3 LoRA adapters over the requests"
    assert result.num_output_tokens == 12 * 4 and all(o.finished for o in outs)


def test_lora_path_needs_enable_lora(capsys) -> None:
    args = _parser().parse_args(["--lora-path", "x"])
    assert throughput.main(args) == 2
    assert "--lora-path needs --backend pagedllm and --enable-lora" in capsys.readouterr().err


def test_num_loras_must_be_positive(capsys) -> None:
    args = _parser().parse_args(["--enable-lora", "--lora-path", "x", "--num-loras", "0"])
    assert throughput.main(args) == 2
    assert "--num-loras must be >= 1, got 0" in capsys.readouterr().err
