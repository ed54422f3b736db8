"""The log line that names a Triton kernel variant first met after start-up (pagedllm/kernels/compile_watch.py),
driven through a stand-in ``triton.knobs`` (CI has no Triton; the hook's arguments are those of Triton 3.x)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from pagedllm.kernels import compile_watch


def test_describe_variant_names_arguments():
    text = compile_watch.describe_variant(
        ["q_ptr", "num_tokens", "BLOCK_M"], {(1,): 1, (2,): 64, (7,): 3}, {(0,): [["tt.divisibility", 16]]}
    )
    assert text == "num_tokens=1, BLOCK_M=64, (7,)=3, q_ptr:divisibility=16"


@pytest.fixture
def fake_triton(monkeypatch):
    calls = []
    runtime = types.SimpleNamespace(jit_cache_hook=lambda **kw: calls.append(kw) or None)
    triton = types.ModuleType("triton")
    triton.knobs = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(compile_watch, "_installed", False)
    return runtime, calls


def test_hook_logs_variant_and_chains(fake_triton, caplog):
    runtime, calls = fake_triton
    assert compile_watch.log_later_compiles()
    assert compile_watch.log_later_compiles()  # a second engine in the process: no second hook
    jit = types.SimpleNamespace(params=[types.SimpleNamespace(name="x_ptr"), types.SimpleNamespace(name="SPLITS")])
    fn = types.SimpleNamespace(name="_paged_attention_kernel", jit_function=jit)
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        runtime.jit_cache_hook(
            key=None, repr="r", fn=fn, compile={"constants": {(1,): 4}, "configs": [{}]},
            is_manual_warmup=False, already_compiled=False,
        )
    assert "_paged_attention_kernel(SPLITS=4)" in caplog.text
    assert len(calls) == 1  # the hook that was there before still runs


def test_hook_never_raises(fake_triton, caplog):
    runtime, _ = fake_triton
    compile_watch.log_later_compiles()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        runtime.jit_cache_hook(fn=None, repr="kernel[num_warps=4](...)")  # not what it expects: still one line
    assert "kernel[num_warps=4]" in caplog.text


def test_no_hook_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    monkeypatch.setattr(compile_watch, "_installed", False)
    assert not compile_watch.log_later_compiles()


def test_quiet_during_an_engines_start_up(fake_triton, caplog):
    """A second engine's start-up in the same process compiles its own variants: expected, not logged (the hook
    the first engine installed stays, and still chains)."""
    runtime, calls = fake_triton
    compile_watch.log_later_compiles()
    fn = types.SimpleNamespace(name="k", jit_function=types.SimpleNamespace(params=[]))
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        with compile_watch.start_up():
            runtime.jit_cache_hook(fn=fn, compile={}, repr="r")
        assert "first met" not in caplog.text
        runtime.jit_cache_hook(fn=fn, compile={}, repr="r")
    assert "first met after start-up: k()" in caplog.text
    assert len(calls) == 2

