"""Launch the engine core's interpreter early: it imports torch and the engine while the API process is still
importing its own modules and building the config, then waits on stdin for its arguments.

Standard library only, so ``pagedllm serve`` can call ``prespawn()`` before anything heavy is imported. A spare
that is never used exits by itself when the parent closes its stdin (at the parent's exit at the latest).

``launch()`` sends a core its arguments and returns the ``LaunchedCore`` that ``EngineCoreClient`` adopts:
``pagedllm serve`` launches the core as soon as its config is built, before it imports the engine client, the
tokenizer and the server, which then load while the core loads the model.
"""

from __future__ import annotations

import hashlib
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


# ------------------------------------------------------------------------------------ the serve config cache
# Building an engine config imports transformers' config machinery: 8-10 s on the lent GPU hosts, the largest
# part of `pagedllm serve`'s start-up. The config a start sends its core (pickled, its HF config as plain data) is
# kept under a key of the start's inputs; the next start with the same inputs launches its core with the kept
# config at once, builds its own meanwhile and compares: any difference discards that core and launches one with
# the new config (slower, never wrong). PAGEDLLM_SERVE_CONFIG_CACHE=0 turns it off; PAGEDLLM_CACHE_DIR moves it.


def config_cache_key(model: str, kwargs: dict[str, Any], extra: dict[str, Any]) -> str | None:
    """A key for the config that ``make_engine_config(model, **kwargs)`` gives, or None (no cache: a model that
    is not a local directory with a config.json, or the cache turned off). ``extra``: what else the caller sets."""
    if os.environ.get("PAGEDLLM_SERVE_CONFIG_CACHE", "1") == "0":
        return None
    config_json = os.path.join(model, "config.json")
    if not os.path.isfile(config_json):
        return None
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return ""

    with open(config_json, "rb") as f:
        config_digest = hashlib.sha256(f.read()).hexdigest()
    inputs = {
        "model": os.path.abspath(model),
        "config.json": config_digest,
        "kwargs": repr(sorted(kwargs.items())),
        "extra": repr(sorted(extra.items())),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(("PAGEDLLM_", "CUDA_", "HIP_"))),
        "versions": [version(d) for d in ("pagedllm", "transformers", "torch")],
        "python": sys.version,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _config_cache_dir() -> str:
    """``$PAGEDLLM_CACHE_DIR/serve_configs`` (default ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pagedllm"
    )
    return os.path.join(root, "serve_configs")


def load_cached_config(key: str) -> bytes | None:
    """The pickled config kept under ``key``, or None. Only a file of this user that no one else may write is
    read: it is unpickled."""
    try:
        with open(os.path.join(_config_cache_dir(), key + ".pkl"), "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                logger.warning("ignoring the kept engine config %s: others may write it", f.name)
                return None
            return f.read()
    except OSError:
        return None


def store_cached_config(key: str, data: bytes) -> None:
    """Keep ``data`` under ``key`` (atomically; a failure to write is only logged)."""
    directory = _config_cache_dir()
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")  # created 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, key + ".pkl"))
    except OSError as e:
        logger.warning("could not keep the engine config for the next start: %s", e)
