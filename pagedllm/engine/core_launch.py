"""Launch the engine core's interpreter early: it imports torch and the engine while the API process is still
importing its own modules and building the config, then waits on stdin for its arguments.

Standard library only, so ``pagedllm serve`` can call ``prespawn()`` before anything heavy is imported. A spare
that is never used exits by itself when the parent closes its stdin (at the parent's exit at the latest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD_CODE = (
    "import json, os, sys; sys.path[:] = json.loads(os.environ.pop('PAGEDLLM_CORE_SYS_PATH')); "
    "from pagedllm.engine.core_process import _child_main; _child_main()"
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
