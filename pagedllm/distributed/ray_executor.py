"""The "ray" executor backend: ranks 1..W-1 of a tensor/pipeline-parallel engine as Ray actors, on any node of
a Ray cluster. Only how the workers start and stop lives here; what they run (``_worker_main``) and rank 0's side
(``MultiprocRunner``) are pagedllm/distributed/executor.py's, the same as with "mp".

    placement group (strategy PACK), one bundle per rank:
        bundle 0      {"GPU": 1, "CPU": 1, "node:<this node's ip>": 0.001}   rank 0 = this process (no actor)
        bundle r > 0  {"GPU": 1, "CPU": 1}                                    rank r = actor r, ``_worker_main``
    (on CPU, ``{"CPU": 1}`` bundles and gloo everywhere)

Every rank joins at ``tcp://<this node's ip>:<free port>`` (rank 0 hosts the store). An actor's GPU is the one
Ray gave it (Ray sets its CUDA_VISIBLE_DEVICES: ``cuda:0`` there); bundle 0 keeps one GPU of this node for rank
0, which takes a visible GPU no actor on this node got. Actors get PYTHONPATH (this checkout need not be
installed on the workers) and the driver's NCCL_* / TORCH_* / NVSHMEM_* / PAGEDLLM_* / VLLM_* / HF_* variables.

A worker whose actor dies makes rank 0's next gloo collective fail, as with "mp": the engine core then ends.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

PLACEMENT_GROUP_TIMEOUT_S = 120.0  # waiting this long for the cluster's resources is a RuntimeError
ACTOR_START_TIMEOUT_S = 300.0  # an actor's process start and imports (torch, transformers)
ACTOR_NAME_PREFIX = "pagedllm-rank"  # actor r is named f"pagedllm-rank{r}-{placement group id}"
WORKER_ENV_PREFIXES = ("NCCL_", "TORCH_", "NVSHMEM_", "PAGEDLLM_", "VLLM_", "HF_")


def connect_ray() -> None:
    """Use this process's Ray connection; else the cluster named by RAY_ADDRESS or started on this node with
    ``ray start --head``; else start a local Ray instance (left running until this process exits)."""
    import ray

    if ray.is_initialized():
        logger.info("Ray: using this process's Ray connection")
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto")
        logger.info("Ray: connected to the cluster at RAY_ADDRESS=%s", os.environ["RAY_ADDRESS"])
        return
    try:  # a cluster `ray start` runs on this node; a ConnectionError at once without one
        ray.init(address="auto")
        logger.info("Ray: connected to the Ray cluster running on this node")
    except ConnectionError:
        ray.init()
        logger.info("Ray: no running cluster found; started a local Ray instance")


def worker_env() -> dict[str, str]:
    """The environment variables every actor gets (``runtime_env={"env_vars": ...}``)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(WORKER_ENV_PREFIXES)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds pagedllm/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorker:
    """One worker rank as a Ray actor (``ray.remote(RayWorker)``); ``run`` holds the actor until "stop"."""

    def node_and_gpus(self) -> tuple[str, list[str]]:
        """(this actor's Ray node id, the GPU ids Ray gave it); importing the executor checks that pagedllm
        imports here before rank 0 waits for this rank."""
        import ray

        import pagedllm.distributed.executor  # noqa: F401

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def run(self, config: EngineConfig, rank: int, init_method: str, device: str) -> None:
        from pagedllm.distributed.executor import _worker_main

        _worker_main(config, rank, init_method, device)


class RayWorkers:
    """The "ray" backend's launcher (see ``executor.start_workers``): ``workers`` are the actor handles of ranks
    1..W-1 (``workers[r - 1]`` is rank r)."""

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = config.parallel_config
        size = pc.world_size
        on_cuda = config.device_config.device.type == "cuda"
        connect_ray()
        ip = ray.util.get_node_ip_address()
        self._check_resources(size, "GPU" if on_cuda else "CPU", ip)
        bundles: list[dict[str, float]] = [
            {"GPU": 1.0, "CPU": 1.0} if on_cuda else {"CPU": 1.0} for _ in range(size)
        ]
        bundles[0][f"node:{ip}"] = 0.001  # rank 0 is this process: its bundle must be on this node
        self._pg = placement_group(bundles, strategy="PACK")
        self.workers: list[Any] = []
        self._runs: list[Any] = []
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"the Ray placement group for tensor_parallel_size x pipeline_parallel_size = {size} ranks "
                    f"({bundles[1]} each, the first on this node {ip}) was not ready after "
                    f"{PLACEMENT_GROUP_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free"
                )
            actor = ray.remote(RayWorker)
            env = worker_env()
            for rank in range(1, size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                )
                self.workers.append(
                    actor.options(
                        num_cpus=1,
                        num_gpus=1 if on_cuda else 0,
                        scheduling_strategy=strategy,
                        runtime_env={"env_vars": env},
                        name=f"{ACTOR_NAME_PREFIX}{rank}-{self._pg.id.hex()}",  # for `ray list actors`
                    ).remote()
                )
            placed = ray.get([w.node_and_gpus.remote() for w in self.workers], timeout=ACTOR_START_TIMEOUT_S)
            if on_cuda:
                here = ray.get_runtime_context().get_node_id()
                self.rank0_device = _free_local_gpu(
                    {g for node, gpus in placed if node == here for g in gpus}
                )
                devices = ["cuda:0"] * len(self.workers)  # Ray's CUDA_VISIBLE_DEVICES: one GPU per actor
            else:
                self.rank0_device = config.device_config.device
                devices = [str(self.rank0_device)] * len(self.workers)
            self.init_method = f"tcp://{ip}:{_free_port()}"
            config_ref = ray.put(config)
            self._runs = [
                w.run.remote(config_ref, rank, self.init_method, dev)
                for rank, (w, dev) in enumerate(zip(self.workers, devices), start=1)
            ]
        except BaseException:
            self.stop(timeout_s=0)
            raise
        logger.info(
            "ray: %d worker actors, placement group %s, rank 0 on %s (node %s), rendezvous %s",
            len(self.workers),
            self._pg.id.hex(),
            self.rank0_device,
            ip,
            self.init_method,
        )

    @staticmethod
    def _check_resources(size: int, kind: str, ip: str) -> None:
        """``ValueError`` naming the shortage when the cluster cannot hold ``size`` ranks (one ``kind`` each),
        or this node (rank 0's) has no ``kind`` at all."""
        import ray

        total = int(ray.cluster_resources().get(kind, 0))
        if total < size:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {size} needs {size} {kind}s in the Ray cluster; "
                f"it has {total}"
            )
        here = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == ip]
        if here and not any(n.get("Resources", {}).get(kind, 0) >= 1 for n in here):
            raise ValueError(f"rank 0 runs in this process, on Ray node {ip}, which has no {kind} for it")

    def wait_ready(self) -> None:
        """Nothing to wait for: the constructor already heard from every actor (``node_and_gpus``)."""

    def alive(self) -> bool:
        """True while every worker's ``run`` call is still going (a returned or failed one: a dead worker)."""
        import ray

        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return not done

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for the workers' ``run`` calls (after "stop"), kill every actor, remove the
        placement group. The Ray connection stays (a cluster's, or the local instance, until process exit)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self._runs and timeout_s > 0:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead
                pass
        try:
            remove_placement_group(self._pg)
        except Exception:  # noqa: BLE001 - already removed
            pass
        self._runs = []


def _free_local_gpu(taken: set[str]) -> torch.device:
    """A visible GPU of this node that no actor on this node got (``taken``: Ray's GPU ids, which are the ids
    CUDA_VISIBLE_DEVICES lists when set, else the device indices)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [i.strip() for i in visible.split(",")]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    for index, gpu in enumerate(ids):
        if gpu not in taken:
            return torch.device("cuda", index)
    raise RuntimeError(
        f"no GPU of this node is left for rank 0: Ray gave this node's actors GPUs {sorted(taken)}"
    )
