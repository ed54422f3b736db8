"""``distributed_executor_backend="ray"`` on CPU (gloo): the worker ranks run as Ray actors in a placement group
of one local Ray instance (started once for the module). TP=2 and PP=2 give transformers' greedy tokens; a worker
actor killed mid-run makes ``generate`` raise at once (and AsyncLLM report the engine dead) and shutdown leaves no
actor or placement group behind; bad backend names, ray with data parallelism and the default backend rule are
checked without starting anything."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time

import pytest
import torch.distributed as dist

from pagedllm import LLM, SamplingParams
from pagedllm.config import ParallelConfig, make_engine_config
from tests.utils import hf_greedy

ray = pytest.importorskip("ray")  # in the `test` extra; the GPU image has no ray
from pagedllm.distributed.ray_executor import ACTOR_NAME_PREFIX  # noqa: E402

MAX_NEW = 8
NUM_CPUS = 4
PROMPTS = [[5, 6, 7], list(range(20, 45)), [9, 300, 41, 7, 7, 2]]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module (engines in this process use it; an engine core process finds it
    through ``ray.init(address="auto")``)."""
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def ray_llm(path: str, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM(path, distributed_executor_backend="ray", **kw)


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def pagedllm_actors() -> list[dict]:
    return [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(ACTOR_NAME_PREFIX)
    ]


def wait_all_released(timeout_s: float = 30.0) -> None:
    """Until every CPU is free again, no placement group holds resources and no worker actor is alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        held = [k for k in free if k.startswith("bundle_group")]
        if free.get("CPU") == NUM_CPUS and not held and not pagedllm_actors():
            return
        assert time.monotonic() < deadline, f"still held after shutdown: {free}, actors {pagedllm_actors()}"
        time.sleep(0.1)


def test_tp2_matches_transformers_and_a_killed_actor_fails_generate(ray_cluster, tiny_llama):
    llm = ray_llm(tiny_llama, tensor_parallel_size=2)
    core = llm.llm_engine.engine_core
    try:
        runner = core.runner
        assert len(runner.workers) == 1 and isinstance(runner.workers[0], ray.actor.ActorHandle)
        assert greedy_ids(llm, PROMPTS) == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
        core.check_integrity()
        runner.check_batches()

        # Kill the worker actor at the third launch of a long generate: that generate must raise, not hang.
        launch, launches, killed_at = runner.launch, [0], []

        def launch_then_kill(sched):
            launches[0] += 1
            if launches[0] == 3:
                ray.kill(runner.workers[0])
                killed_at.append(time.monotonic())
            return launch(sched)

        runner.launch = launch_then_kill
        with pytest.raises(RuntimeError):
            greedy_ids(llm, [[5, 6, 7]], max_tokens=400)
        assert killed_at and time.monotonic() - killed_at[0] < 10
    finally:
        core.shutdown()
    assert not dist.is_initialized()
    wait_all_released()


def test_pp2_matches_transformers(ray_cluster, tiny_llama):
    llm = ray_llm(tiny_llama, pipeline_parallel_size=2)
    try:
        assert greedy_ids(llm, PROMPTS) == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    wait_all_released()


def test_async_engine_reports_a_dead_ray_worker(ray_cluster, tiny_llama):
    """The server's engine: the engine core (its own process) connects to the running Ray instance; killing its
    worker actor ends the request in flight with EngineDeadError and fails the health check (the server's 503)."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.core_process import EngineDeadError

    async def run() -> None:
        config = make_engine_config(
            tiny_llama,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            kv_cache_memory_bytes=4 << 20,
        )
        engine = AsyncLLM(config)
        try:
            got = asyncio.Event()

            async def consume() -> None:
                params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
                async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "a"):
                    got.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got.wait(), 60)
            (actor,) = pagedllm_actors()
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            result = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 20)
            assert isinstance(result[0], EngineDeadError), result
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(run())
    wait_all_released()  # the engine core's Ray job ended with its process: its actors and placement group too


def test_too_few_resources_name_the_shortage(ray_cluster):
    from pagedllm.distributed.ray_executor import RayWorkers

    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size = 8 needs 8 CPUs in the Ray cluster; it has 4"
    ):
        RayWorkers._check_resources(8, "CPU", ray.util.get_node_ip_address())
    with pytest.raises(ValueError, match="needs 2 GPUs in the Ray cluster; it has 0"):
        RayWorkers._check_resources(2, "GPU", ray.util.get_node_ip_address())


# --- no Ray engine started ---------------------------------------------------------------------------------------
def test_bad_backend_and_ray_with_data_parallel(tiny_llama):
    with pytest.raises(ValueError, match="distributed_executor_backend must be .*'ray'.* got 'rya'"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=2, distributed_executor_backend="rya")
    with pytest.raises(ValueError, match="data_parallel_size > 1 with distributed_executor_backend 'ray'"):
        LLM(tiny_llama, device="cpu", data_parallel_size=2, distributed_executor_backend="ray")


def test_ray_missing_is_a_pip_hint(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="distributed_executor_backend 'ray' needs Ray: pip install ray"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ParallelConfig(tensor_parallel_size=2).default_executor_backend("cuda") == "mp"


def test_default_backend_is_vllms_rule(monkeypatch, tiny_llama):
    """None: "mp", unless on CUDA the ranks outnumber this node's GPUs (and Ray is installed): "ray"."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ParallelConfig(tensor_parallel_size=2).default_executor_backend("cuda") == "mp"
    assert (
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).default_executor_backend("cuda")
        == "ray"
    )
    assert ParallelConfig(tensor_parallel_size=4).default_executor_backend("cpu") == "mp"
    assert (
        ParallelConfig(data_parallel_size=2, tensor_parallel_size=4).default_executor_backend("cuda") == "mp"
    )
    config = make_engine_config(tiny_llama, device="cpu", tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"


def test_cli_flag_reaches_the_engine_config(tiny_llama):
    from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--model", tiny_llama, "--device", "cpu", "-tp", "2", "--distributed-executor-backend", "ray"]
    )
    config = make_engine_config(tiny_llama, **engine_kwargs_from_args(args))
    assert config.parallel_config.distributed_executor_backend == "ray"
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "rya"])
