"""The engine core (scheduler + model runner) in its own process, and the asyncio client that drives it.

Why a process: HTTP handling, tokenization and detokenization run in the API process's event loop; the forward
passes run here, in a busy loop that never waits on Python code of the front-end (no GIL sharing).

Wiring (the sockets live in a private temp dir, mode 0700)::

    API process (EngineCoreClient)                      engine core process (run_engine_core)
      PUSH  --- ("add" | "abort" | "utility" | "shutdown", payload) --->  PULL   input
      PULL  <--- ("outputs" | "utility" | "dead", ...) -----------------  PUSH   output
      PULL  <--- ("ready", info) | ("failed", type, message) -----------  PUSH   start-up only

Messages are pickled tuples of plain data (``pagedllm.core.sched_output``). The API process connects and the core
binds, so messages the client sends before the core is up are queued, not dropped. The core runs in a fresh
interpreter (``CoreProcess``), which reads its arguments from stdin.

Start-up handshake: the core builds ``EngineCore`` and sends ``("ready", info)`` with ``kv_cache_info`` and the
vocabulary size, or ``("failed", type_name, message)``; the client's constructor blocks on it and raises the
core's error (``ValueError`` stays a ``ValueError``) in the API process.

The core loop: drain every pending input message, then ``step()`` while there is work, and send each step's
``EngineCoreOutputs`` with fresh ``SchedulerStats``. When the work runs out it calls the core's ``on_idle()`` (the
integrity check, once per transition to idle) after the last outputs are sent, so it delays nobody. An ``add_request`` that raises ``ValueError`` does not stop
the loop: the request is reported back in the ``errors`` map of the next outputs message. A request the core
accepted is stamped with ``time.monotonic()`` (CLOCK_MONOTONIC: the same clock in every process of the host) once
its scheduler holds it; the stamps go out in the same iteration's outputs message (``queued_times``). When the core has
nothing to do it blocks on its input (waking once a second); it exits by itself when the API process is gone.

Death: the client watches the process sentinel with ``loop.add_reader``; when the core exits unexpectedly it
fails every pending utility call and the output stream with ``EngineDeadError`` at once.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import importlib
import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine import core_launch

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_CORE = core_launch.DEFAULT_ENGINE_CORE
POOLING_ENGINE_CORE = "pagedllm.engine.pooling_core:PoolingEngineCore"

# The calls ``call_utility_async`` may make, run between steps: EngineCore methods, plus three answered by the loop.
_UTILITIES = (
    "get_stats",
    "check_integrity",
    "has_unfinished_requests",
    "reset_prefix_cache",
    "is_idle",
    "get_kv_cache_info",
    "debug_state",
    "ping",
    "add_lora",
    "remove_lora",
    "list_loras",
    "sleep",
    "wake_up",
    "is_sleeping",
    "collective_rpc",
)

# How long the idle core blocks on its input before checking that the API process is still alive.
_IDLE_POLL_MS = 1000


class EngineDeadError(RuntimeError):
    """The engine core process is gone: every in-flight and later request fails with this."""


class EngineSleepingError(RuntimeError):
    """The engine sleeps (``sleep``): requests are refused until ``wake_up``."""


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _rebuild_exception(type_name: str, message: str) -> Exception:
    """An exception of the builtin type the core raised (ValueError, AssertionError...), else RuntimeError."""
    exc_type = getattr(builtins, type_name, None)
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        return exc_type(message)
    return RuntimeError(f"{type_name}: {message}")


# ---------------------------------------------------------------------------------------------- core side


def _load_class(path: str) -> type:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class _CoreLoop:
    """Runs inside the engine core process: owns the EngineCore and both sockets."""

    def __init__(self, core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        # Called after the last message of a busy stretch is sent: the core's idle-time integrity check.
        self.on_idle = getattr(core, "on_idle", None)

    def run(self) -> None:
        core = self.core
        while True:
            # Idle: block on the input (waking now and then); busy: just peek at it between steps.
            idle = not core.has_unfinished_requests() and not self.poller.poll(_IDLE_POLL_MS)
            if os.getppid() != self.parent_pid:  # one cheap syscall per step
                logger.warning("engine core: the API process is gone; exiting")
                return
            if idle:
                continue
            errors: dict[str, str] = {}
            queued_times: dict[str, float] = {}
            changed, stop = self._drain_input(errors, queued_times)
            if stop:
                return
            outputs = EngineCoreOutputs()
            if core.has_unfinished_requests():
                outputs = core.step()
                changed = True
            if changed or errors:
                if outputs.stats is None:
                    outputs.stats = core.get_stats()
                outputs.queued_times = queued_times
                outputs.timestamp = time.monotonic()
                self.out_sock.send(_dumps(("outputs", outputs, errors)), copy=False)
            if not core.has_unfinished_requests() and self.on_idle is not None and not self.on_idle():
                # The check failed (the core logged why); make the new failure count visible at once.
                stats_only = EngineCoreOutputs(stats=core.get_stats(), timestamp=time.monotonic())
                self.out_sock.send(_dumps(("outputs", stats_only, {})))

    def _drain_input(self, errors: dict[str, str], queued_times: dict[str, float]) -> tuple[bool, bool]:
        """Handle every message waiting on the input socket: refused adds go into ``errors``, accepted ones are
        stamped in ``queued_times``. Returns (requests changed, shut down)."""
        changed = False
        while True:
            try:
                raw = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed, False
            kind, payload = pickle.loads(raw.buffer)
            if kind == "add":
                req: EngineCoreRequest = payload
                try:
                    self.core.add_request(req)
                    queued_times[req.request_id] = time.monotonic()
                except (ValueError, EngineSleepingError) as e:
                    errors[req.request_id] = str(e)
                changed = True
            elif kind == "abort":
                self.core.abort_requests(list(payload))
                changed = True
            elif kind == "utility":
                self._run_utility(*payload)
            elif kind == "shutdown":
                return changed, True
            else:
                logger.error("engine core: unknown message kind %r", kind)

    def _run_utility(self, call_id: int, name: str, args: tuple) -> None:
        try:
            if name not in _UTILITIES:
                raise ValueError(f"unknown utility call {name!r}")
            if name == "ping":
                result: Any = "pong"
            elif name == "is_idle":
                result = not self.core.has_unfinished_requests()
            elif name == "get_kv_cache_info":
                result = dict(self.core.kv_cache_info)
            else:
                result = getattr(self.core, name)(*args)
            reply = ("utility", call_id, True, result)
        except Exception as e:  # noqa: BLE001 - sent back to the caller, who re-raises it
            reply = ("utility", call_id, False, (type(e).__name__, str(e)))
        self.out_sock.send(_dumps(reply))


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_addr: str,
    parent_pid: int,
    core_cls_path: str,
) -> None:
    """Entry point of the engine core process (multiprocessing spawn target)."""
    # Ctrl-C in a terminal reaches the whole process group: the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [engine core] %(message)s")
    if _imports_done_at is not None:  # how long its imports took, and how long it then waited for its arguments
        logger.info(
            "engine core process started (pid %d; its imports took %.2f s, then it waited %.2f s for its arguments)",
            os.getpid(),
            _imports_done_at - _interpreter_started_at,
            time.time() - _imports_done_at,
        )
    else:
        logger.info("engine core process started (pid %d)", os.getpid())
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.bind(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.bind(output_addr)
    ready_sock = ctx.socket(zmq.PUSH)
    ready_sock.setsockopt(zmq.LINGER, 2000)
    ready_sock.bind(ready_addr)
    exit_code = 0
    core = None
    try:
        try:
            device = config.device_config.device
            if device.type == "cuda" and device.index is not None:
                # Triton launches on the current device: a data-parallel rank's process works on cuda:<rank>.
                torch.cuda.set_device(device)
            if core_cls_path == DEFAULT_ENGINE_CORE and config.model_config.runner_type == "pooling":
                core_cls_path = POOLING_ENGINE_CORE  # the same loop drives a pooling model's core
            core = _load_class(core_cls_path)(config)
        except Exception as e:  # noqa: BLE001 - reported to the API process, which raises it
            logger.error("engine core failed to start:\n%s", traceback.format_exc())
            ready_sock.send(_dumps(("failed", type(e).__name__, str(e))))
            exit_code = 1
            return
        info = {
            "kv_cache_info": dict(getattr(core, "kv_cache_info", {}) or {}),
            "vocab_size": getattr(core, "vocab_size", None),
            "pid": os.getpid(),
        }
        ready_sock.send(_dumps(("ready", info)))
        _CoreLoop(core, in_sock, out_sock, parent_pid).run()
    except Exception as e:  # noqa: BLE001 - the process is about to die; tell the API process why
        logger.error("engine core died:\n%s", traceback.format_exc())
        try:
            out_sock.send(_dumps(("dead", f"{type(e).__name__}: {e}")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        exit_code = 1
    finally:
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("engine core shutdown failed")
        in_sock.close(linger=0)
        out_sock.close()
        ready_sock.close()
        ctx.term()
        if os.getppid() != parent_pid:  # orphaned: nobody else will remove the socket dir
            shutil.rmtree(os.path.dirname(input_addr[len("ipc://") :]), ignore_errors=True)
    sys.exit(exit_code)


# -------------------------------------------------------------------------------------------- client side


class CoreProcess:
    """The engine core process: a fresh interpreter running ``_child_main`` (not multiprocessing's spawn, which
    re-imports the parent's ``__main__`` and so breaks scripts without an ``if __name__ == "__main__"`` guard).

    ``sentinel`` is a file descriptor that becomes readable (EOF) when the process exits: the read end of a pipe
    whose only write end the child holds.
    """

    def __init__(self, launched: core_launch.LaunchedCore) -> None:
        """Adopt a launched core (``core_launch.launch``): its process and sentinel are this object's now."""
        self._popen = launched.popen
        self.sentinel, launched.sentinel = launched.sentinel, -1
        launched.adopted = True
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


_imports_done_at: float | None = None  # set in a core interpreter (_child_main) once its imports are done
_interpreter_started_at = 0.0


def _child_main(started_at: float | None = None) -> None:
    """Entry point of the engine core interpreter: import the engine, then read the arguments from stdin (they
    may come seconds later: see core_launch.py), then run the core."""
    global _imports_done_at, _interpreter_started_at
    _interpreter_started_at = time.time() if started_at is None else started_at
    # The engine's own imports, while the parent is still busy (the config arrives without transformers
    # classes: see PlainHFConfig).
    import pagedllm.engine.engine_core  # noqa: F401
    import pagedllm.model_loader  # noqa: F401
    import pagedllm.models.registry  # noqa: F401

    _imports_done_at = time.time()  # the start-up log says how long the core then waited for the parent
    try:
        args = pickle.load(sys.stdin.buffer)
    except EOFError:
        return  # a pre-spawned spare the parent never used
    sys.stdin.close()
    run_engine_core(*args)


_LIVE_CLIENTS: weakref.WeakSet[EngineCoreClient] = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:
    for client in list(_LIVE_CLIENTS):
        client.shutdown()


@dataclass
class _ClientState:
    dead_error: EngineDeadError | None = None
    death_note: str | None = None  # the core's own last words ("dead" message), when it sent them
    pending_utilities: dict[int, asyncio.Future] = field(default_factory=dict)


class EngineCoreClient:
    """Starts the engine core process and talks to it from an asyncio event loop.

    The constructor blocks until the core is ready (or raises its start-up error). ``add_request`` and
    ``abort_requests`` never block; ``get_output_async`` returns ``(EngineCoreOutputs, errors)`` in the order the
    core produced them and raises ``EngineDeadError`` once the core is gone and its last outputs are consumed.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        core_cls_path: str = DEFAULT_ENGINE_CORE,
        startup_timeout_s: float | None = None,
        while_starting: Callable[[], None] | None = None,
        launched: core_launch.LaunchedCore | None = None,
    ) -> None:
        """Start the core process and wait until it is ready. ``while_starting`` runs here meanwhile (the
        front-end's own set-up, e.g. loading the tokenizer, overlaps the model load). ``launched``: a core
        already sent its arguments (``core_launch.launch``; ``pagedllm serve`` starts it before importing this
        module's users), adopted instead of starting one; it must run ``core_cls_path`` with this ``config``."""
        self._state = _ClientState()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        self._outputs: asyncio.Queue | None = None
        self._call_ids = itertools.count()
        if launched is None:
            launched = core_launch.launch(config, core_cls_path)
        elif launched.core_cls_path != core_cls_path:
            launched.discard()
            raise ValueError(f"the launched core runs {launched.core_cls_path}, not {core_cls_path}")
        self._tmpdir = launched.tmpdir
        input_addr, output_addr, ready_addr = launched.addresses
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(input_addr)
        # The output socket is read from the event loop; it binds to the running loop on first use.
        self._output = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.connect(output_addr)
        ready_sock = self._ctx.socket(zmq.PULL)
        ready_sock.setsockopt(zmq.LINGER, 0)
        ready_sock.connect(ready_addr)
        _LIVE_CLIENTS.add(self)
        self.proc: CoreProcess | None = None
        try:
            self.proc = CoreProcess(launched)
            if while_starting is not None:
                while_starting()
            info = self._wait_ready(ready_sock, startup_timeout_s)
        except BaseException:
            ready_sock.close(linger=0)
            self.shutdown()
            raise
        ready_sock.close(linger=0)
        self.kv_cache_info: dict = info["kv_cache_info"]
        self.vocab_size: int | None = info["vocab_size"]
        self.pid: int = info["pid"]

    def _wait_ready(self, ready_sock: zmq.Socket, timeout_s: float | None) -> dict:
        poller = zmq.Poller()
        poller.register(ready_sock, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not poller.poll(100):
            if not self.proc.is_alive():
                raise RuntimeError(
                    f"the engine core process exited with code {self.proc.exitcode} during start-up; "
                    "see its log above"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready within {timeout_s} s")
        msg = pickle.loads(ready_sock.recv())
        if msg[0] == "failed":
            _, type_name, message = msg
            if type_name == "ValueError":
                raise ValueError(message)
            raise RuntimeError(f"the engine core failed to start: {type_name}: {message}")
        if msg[0] != "ready":
            raise RuntimeError(f"unexpected first message from the engine core: {msg[0]!r}")
        return msg[1]

    # ------------------------------------------------------------------ state

    @property
    def is_dead(self) -> bool:
        return self._state.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._state.dead_error

    def is_alive(self) -> bool:
        """The process is running and not declared dead (cheap; usable outside the event loop)."""
        return not self.is_dead and not self._closed and self.proc.is_alive()

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Attach to the running event loop: start reading outputs and watching the process. Idempotent."""
        loop = asyncio.get_running_loop()
        if self._loop is loop or self._closed:
            return
        if self._loop is not None:
            raise RuntimeError("EngineCoreClient is already attached to another event loop")
        self._loop = loop
        self._outputs = asyncio.Queue()
        loop.add_reader(self.proc.sentinel, self._on_process_exit)
        self._reader_task = loop.create_task(self._read_loop(), name="pagedllm-core-reader")
        if not self.proc.is_alive():
            self._on_process_exit()

    async def _read_loop(self) -> None:
        assert self._outputs is not None
        while True:
            try:
                raw = await self._output.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                msg = pickle.loads(raw.buffer)
                kind = msg[0]
            except Exception as e:  # noqa: BLE001 - without its messages the engine is as good as dead
                self._mark_dead(f"unreadable message from the engine core: {type(e).__name__}: {e}")
                return
            if kind == "outputs":
                self._outputs.put_nowait((msg[1], msg[2]))
            elif kind == "utility":
                _, call_id, ok, value = msg
                fut = self._state.pending_utilities.pop(call_id, None)
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(_rebuild_exception(*value))
            elif kind == "dead":
                self._state.death_note = msg[1]
            else:
                logger.error("unexpected message from the engine core: %r", kind)

    def _on_process_exit(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.remove_reader(self.proc.sentinel)
        if self._closed or self.is_dead:
            return
        self.proc.join(timeout=1.0)
        note = f": {self._state.death_note}" if self._state.death_note else ""
        self._mark_dead(f"the engine core process died unexpectedly (exit code {self.proc.exitcode}){note}")

    def _mark_dead(self, message: str) -> None:
        logger.error("%s", message)
        err = EngineDeadError(message)
        self._state.dead_error = err
        for fut in self._state.pending_utilities.values():
            if not fut.done():
                fut.set_exception(err)
        self._state.pending_utilities.clear()
        if self._outputs is not None:
            self._outputs.put_nowait(err)

    def _send(self, kind: str, payload: Any) -> None:
        if self._state.dead_error is not None:
            raise self._state.dead_error
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")
        self._input.send(_dumps((kind, payload)), zmq.NOBLOCK, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send("add", request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead and not self._closed:
            self._send("abort", list(request_ids))

    async def get_output_async(self) -> tuple[EngineCoreOutputs, dict[str, str]]:
        """The next outputs message: (outputs, {request_id: error message for adds the core refused})."""
        if self._outputs is None:
            self.start()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    async def call_utility_async(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``name(*args)`` on the core between steps and return its result (or raise its exception)."""
        if self._loop is None:
            self.start()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._state.pending_utilities[call_id] = fut
        try:
            self._send("utility", (call_id, name, args))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._state.pending_utilities.pop(call_id, None)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (politely, then by force) and release sockets and the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE_CLIENTS.discard(self)
        proc = self.proc
        if proc is not None and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(proc.sentinel)
            except (ValueError, RuntimeError):
                pass
        if self._reader_task is not None and not self._reader_task.done():
            try:
                self._reader_task.cancel()
            except RuntimeError:  # its loop is closed already
                pass
        for fut in self._state.pending_utilities.values():
            if not fut.done() and not fut.get_loop().is_closed():
                fut.set_exception(EngineDeadError("the engine is shut down"))
        if proc is not None:
            if proc.is_alive():
                try:
                    self._input.send(_dumps(("shutdown", None)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
            proc.close()
        self._output.close(linger=0)
        self._input.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
