"""Name the Triton kernel variants first met after start-up.

The model runner's warm-up (``ModelRunner._warm_up_eager_steps``) makes the kernel variants that steps launch, so
that none compiles in the middle of a run: on a cold cache a compile stalls the step loop for seconds. A variant it
missed shows up here: once the warm-up is done, Triton's ``jit_cache_hook`` (called when a kernel meets arguments
it has no compiled variant for in this process, before it compiles or loads one from the disk cache) logs the
kernel, the values it specializes on (constexprs, integers equal to 1) and its divisibility attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)
_installed = False  # one hook per process, however many engines it starts
_starting = 0  # engines of this process inside start_up(): their compiles are expected, not logged


@contextmanager
def start_up() -> Iterator[None]:
    """An engine's start-up (memory profile, graph capture, warm-up): compiles here are the expected ones, also
    when an earlier engine of this process already installed the hook."""
    global _starting
    _starting += 1
    try:
        yield
    finally:
        _starting -= 1


def describe_variant(arg_names: Sequence[str], constants: Mapping[Any, Any], attrs: Mapping[Any, Any]) -> str:
    """``name=value`` for each specialized argument, then ``name:attr`` for each attribute (divisibility by 16),
    arguments named by ``arg_names`` (Triton keys them by position paths such as ``(3,)``)."""

    def name(path: Any) -> str:
        if isinstance(path, tuple) and len(path) == 1 and isinstance(path[0], int) and path[0] < len(arg_names):
            return arg_names[path[0]]
        return str(path)

    values = [f"{name(k)}={v}" for k, v in constants.items()]
    marks = []
    for k, v in attrs.items():
        for attr in v:
            label, value = (attr[0], attr[1]) if isinstance(attr, (list, tuple)) and len(attr) == 2 else (attr, "")
            marks.append(f"{name(k)}:{str(label).removeprefix('tt.')}={value}")
    return ", ".join(values + marks)


def log_later_compiles() -> bool:
    """From now on, log every Triton kernel variant this process meets for the first time. Chains to a hook
    already set. False when this Triton has no such hook (then nothing is logged)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    previous = runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        if _starting:
            return previous(**kwargs) if previous is not None else None
        try:
            fn = kwargs["fn"]
            compile_info = kwargs.get("compile", {})
            params = getattr(getattr(fn, "jit_function", None), "params", [])
            arg_names = [getattr(p, "name", str(p)) for p in params]
            configs = compile_info.get("configs") or [{}]
            variant = describe_variant(arg_names, compile_info.get("constants", {}), configs[0] or {})
            logger.warning("Triton kernel variant first met after start-up: %s(%s)", fn.name, variant)
        except Exception:  # noqa: BLE001 - a log line must never break a launch
            logger.warning("Triton kernel variant first met after start-up: %s", kwargs.get("repr"))
        return previous(**kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    _installed = True
    return True
