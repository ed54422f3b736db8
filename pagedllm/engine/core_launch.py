"""Launch the engine core's interpreter early: it imports torch and the engine while the API process is still
importing its own modules and building the config, then waits on stdin for its arguments.

Standard library only, so ``pagedllm serve`` can call ``prespawn()`` before anything heavy is imported. A spare
that is never used exits by itself when the parent closes its stdin (at the parent's exit at the latest).

``launch()`` sends a core its arguments and returns the ``LaunchedCore`` that ``EngineCoreClient`` adopts:
``pagedllm serve`` launches the core as soon as its config is built, before it imports the engine client, the
tokenizer and the server, which then load while the core loads the model.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
DEFAULT_ENGINE_CORE = "pagedllm.engine.engine_core:EngineCore"

_CHILD_CODE = (
    "import json, os, sys, time; t0 = time.time(); sys.path[:] = json.loads(os.environ.pop('PAGEDLLM_CORE_SYS_PATH')); "
    "from pagedllm.engine.core_process import _child_main; _child_main(t0)"
)

_spare: tuple[subprocess.Popen, int] | None = None


def spawn() -> tuple[subprocess.Popen, int]:
    """A fresh core interpreter and the read end of a pipe that reaches EOF when it exits (its sentinel)."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env["PAGEDLLM_CORE_SYS_PATH"] = json.dumps(sys.path)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            close_fds=True,
            env=env,
        )
    finally:
        os.close(write_fd)
    return popen, read_fd


def prespawn() -> None:
    """Start one core interpreter now, for the next ``take()``."""
    global _spare
    if _spare is None:
        _spare = spawn()


def take() -> tuple[subprocess.Popen, int]:
    """The pre-spawned interpreter if there is a live one, else a fresh one."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None:
        if spare[0].poll() is None:
            return spare
        os.close(spare[1])
    return spawn()


@dataclass
class LaunchedCore:
    """A core interpreter that has its arguments: it binds its sockets under ``tmpdir`` and starts the engine.
    ``sentinel`` reaches EOF when it exits. Whoever holds it either hands it to ``EngineCoreClient`` (which then
    owns the process and ``tmpdir``) or calls ``discard()``."""

    popen: subprocess.Popen
    sentinel: int
    tmpdir: str
    core_cls_path: str
    adopted: bool = False  # by an EngineCoreClient, which then owns the process and tmpdir

    @property
    def addresses(self) -> tuple[str, str, str]:
        """The zmq addresses of the core's input, output and ready sockets."""
        return tuple(f"ipc://{self.tmpdir}/{name}" for name in ("input", "output", "ready"))  # type: ignore[return-value]

    def discard(self) -> None:
        """Stop the core and remove its socket directory, unless a client adopted it (then a no-op)."""
        if self.adopted:
            return
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def launch(config: Any, core_cls_path: str = DEFAULT_ENGINE_CORE) -> LaunchedCore:
    """Send a core interpreter (the pre-spawned one if live, else a fresh one) its arguments: ``config`` (an
    ``EngineConfig``) and the addresses to bind."""
    tmpdir = tempfile.mkdtemp(prefix="pagedllm-core-")  # created 0700
    popen, sentinel = take()
    core = LaunchedCore(popen, sentinel, tmpdir, core_cls_path)
    assert popen.stdin is not None
    try:
        pickle.dump(
            (config, *core.addresses, os.getpid(), core_cls_path), popen.stdin, pickle.HIGHEST_PROTOCOL
        )
        popen.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; the client's start-up check says so
    except BaseException:
        core.discard()
        raise
    logger.info("engine core process launched")
    return core
