"""Run a function on N spawned ranks joined over gloo, as a pytest-friendly call.

``run_ranks(fn, world_size, *args)`` calls ``fn(tp, *args)`` in each of ``world_size`` spawned processes, where
``tp`` is that rank's ``TPGroup`` over all of them (file-based init in a fresh temp directory, so no port is
shared between tests). A child that raises fails the calling test with the tracebacks of every rank that raised
(the other ranks are killed); ranks that do not finish within ``timeout`` seconds are killed and the test fails: a failing
child never hangs the suite. ``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 60.0  # a collective a peer never joins fails after this (the harness timeout is shorter)


def _entry(rank: int, fn: Any, world_size: int, init_file: str, args: tuple) -> None:
    import torch

    from pagedllm.distributed import destroy_distributed, init_tp_group

    torch.set_num_threads(1)  # N ranks share the CI machine's few cores
    tp = init_tp_group(world_size, rank, f"file://{init_file}", backend="gloo", timeout_s=GLOO_TIMEOUT_S)
    try:
        fn(tp, *args)
        torch.distributed.barrier()  # no rank tears its connections down while a peer still reads from them
    finally:
        destroy_distributed()


def _tracebacks(context: mp.ProcessContext) -> str:
    """Every failed rank's traceback (a peer's error often only says its partner went away), then remove
    the error files."""
    parts = []
    for rank, path in enumerate(context.error_files):
        if os.path.exists(path):
            with open(path, "rb") as f:
                parts.append(f"\n\n-- rank {rank}:\n{pickle.load(f)}")
            os.unlink(path)
    return "".join(parts)


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(tp, *args)`` on ``world_size`` gloo ranks; fail the test on any child error or on timeout."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-dist-") as tmp:
        init_file = str(Path(tmp) / "init")
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, init_file, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    pytest.fail(f"{world_size} ranks running {fn.__name__} did not finish in {timeout:.0f} s")
        except mp.ProcessRaisedException:
            pytest.fail(f"ranks running {fn.__name__} raised:{_tracebacks(context)}", pytrace=False)
        except mp.ProcessExitedException as e:
            pytest.fail(f"a rank running {fn.__name__} died: {e}", pytrace=False)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
