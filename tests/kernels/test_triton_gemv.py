"""Triton single-row GEMV (plain, with bias, with the fused silu_and_mul input, split-K or not) against its
``gemv_ref`` twin.

GPU tests are marked ``gpu``; with ``TRITON_INTERPRET=1`` (see test_triton_interpreter.py) the
``interpret`` tests run small shapes through Triton's CPU interpreter on CPU tensors. The kernel has no
``tl.dot``, so it does not depend on the interpreter's bf16 dot fix (pagedllm.kernels._interpret).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.utils import rel_l2

pytest.importorskip("triton")

from pagedllm.kernels.gemv import GemvConfig, gemv, gemv_ref, pick_config  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Both sides sum in fp32 (different orders) and round once; the interpreter truncates fp32 -> bf16 instead of
# rounding to nearest, about half an ulp everywhere (also in the fused silu's intermediate roundings).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2 if INTERPRET else 5e-3}

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
QWEN3_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
DOWN_SHAPES = {(4096, 14336), (1024, 3072)}  # their input comes from silu_and_mul
UNTUNED = [(5120, 5120), (14336, 5120), (64, 4096), (3000, 1000), (8, 100000)]  # pick_config's heuristic



def randn(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def check_gemv(
    N: int,
    K: int,
    dtype: torch.dtype,
    device: str,
    *,
    bias: bool = False,
    act: str | None = None,
    strided: bool = False,
    config: GemvConfig | None = None,
    pdl: bool = False,
    seed: int = 0,
) -> None:
    x_cols = 2 * K if act else K
    if strided:  # row 1 of a [3, x_cols + 24] buffer, offset by 8 elements: a 1-row view with a row stride
        x = randn(3, x_cols + 24, dtype=dtype, device=device, seed=seed, scale=2.0)[1:2, 8 : 8 + x_cols]
        assert x.stride(0) == x_cols + 24 and x.stride(1) == 1
    else:
        x = randn(1, x_cols, dtype=dtype, device=device, seed=seed, scale=2.0)
    weight = randn(N, K, dtype=dtype, device=device, seed=seed + 1, scale=K**-0.5)
    b = randn(N, dtype=dtype, device=device, seed=seed + 2) if bias else None
    out = gemv(x, weight, b, config=config, act=act, pdl=pdl)
    assert out.shape == (1, N) and out.dtype == dtype
    ref = gemv_ref(x, weight, b, act=act)
    err = rel_l2(out, ref)
    assert err < TOL[dtype], f"rel_l2 {err:.2e} for N={N} K={K} {dtype} bias={bias} act={act} {config}"
    if dtype != torch.float32 and act is None and not INTERPRET:  # rounds like cuBLAS's F.linear
        assert rel_l2(out, F.linear(x, weight, b)) < TOL[dtype]


# ------------------------------------------------------------------------------------------- configs


def test_gemv_config_checks():
    with pytest.raises(AssertionError):
        GemvConfig(BLOCK_N=3)
    with pytest.raises(AssertionError):
        GemvConfig(SPLIT_K=0)


@pytest.mark.parametrize("shape", LLAMA_8B + QWEN3_06B + UNTUNED + [(1000, 1000), (1, 64)])
def test_pick_config_is_valid(shape):
    cfg = pick_config(*shape)
    assert isinstance(cfg, GemvConfig) and cfg.SPLIT_K <= 8
    assert cfg.BLOCK_N * cfg.BLOCK_K <= 32768, "accumulator too large for registers"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", LLAMA_8B + QWEN3_06B)
def test_gemv_model_shapes_gpu(shape):
    check_gemv(*shape, torch.bfloat16, "cuda", act="silu_and_mul" if shape in DOWN_SHAPES else None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", LLAMA_8B + QWEN3_06B + UNTUNED)
@pytest.mark.parametrize("act", [None, "silu_and_mul"])
def test_gemv_pick_config_gpu(shape, act):
    """The config pick_config returns for every model shape (and a few heuristic ones), with and without
    the fused input."""
    check_gemv(*shape, torch.bfloat16, "cuda", act=act, config=pick_config(*shape))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1000, 1000), (6144, 4096), (4096, 14336), (33, 4100), (4097, 96)])
@pytest.mark.parametrize("split_k", [1, 2, 8])
def test_gemv_gpu(dtype, shape, split_k):
    cfg = GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=split_k, num_warps=4, num_stages=3)
    check_gemv(*shape, dtype, "cuda", config=cfg)
    check_gemv(*shape, dtype, "cuda", config=cfg, bias=True, strided=True, seed=1)
    check_gemv(*shape, dtype, "cuda", config=cfg, act="silu_and_mul", seed=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "cfg",
    [
        GemvConfig(1, 128, 1, 2, 2),
        GemvConfig(2, 2048, 1, 8, 4),
        GemvConfig(8, 1024, 1, 4, 6),
        GemvConfig(16, 256, 4, 4, 3),
        GemvConfig(32, 512, 2, 8, 2),
        GemvConfig(64, 128, 8, 8, 5),
        GemvConfig(8, 512, 3, 4, 1),  # split count that does not divide K's blocks
    ],
)
@pytest.mark.parametrize("shape", [(1000, 1000), (1024, 3072), (4096, 4096), (151936, 1024)])
def test_gemv_configs_gpu(cfg, shape):
    check_gemv(*shape, torch.bfloat16, "cuda", config=cfg, bias=True)


needs_pdl = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+"
)


@pytest.mark.gpu
@needs_cuda
@needs_pdl
@pytest.mark.parametrize("split_k", [1, 4])
def test_gemv_pdl_gpu(split_k):
    cfg = GemvConfig(BLOCK_N=4, BLOCK_K=512, SPLIT_K=split_k, num_warps=4, num_stages=3)
    for shape in [(1000, 1000), (1024, 3072), (6144, 4096)]:
        check_gemv(*shape, torch.bfloat16, "cuda", config=cfg, pdl=True, bias=True)
        check_gemv(*shape, torch.bfloat16, "cuda", config=cfg, pdl=True, act="silu_and_mul", seed=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_gemv_cuda_graph_deterministic_gpu(split_k, pdl):
    """Captured once, replayed: same bits every time (the split-K counters reset themselves). Each call
    reads the previous call's output, so a PDL launch that reads x too early shows up as a mismatch."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    N = K = 1024
    cfg = GemvConfig(BLOCK_N=4, BLOCK_K=256, SPLIT_K=split_k, num_warps=4, num_stages=3)
    x = randn(1, 2 * K, dtype=torch.bfloat16, device="cuda")
    weight = randn(N, K, dtype=torch.bfloat16, device="cuda", seed=1, scale=K**-0.5)
    bias = randn(N, dtype=torch.bfloat16, device="cuda", seed=2)

    def chain() -> list[torch.Tensor]:
        outs = [gemv(x, weight, config=cfg, act="silu_and_mul", pdl=pdl)]
        for _ in range(4):  # each input is the previous output, repeated twice: [1, 2K]
            outs.append(gemv(outs[-1].repeat(1, 2), weight, bias, config=cfg, act="silu_and_mul", pdl=pdl))
        return outs

    expected = chain()  # compiles, allocates the counters
    ref = gemv_ref(x, weight, act="silu_and_mul")
    for _ in range(4):
        ref = gemv_ref(ref.repeat(1, 2), weight, bias, act="silu_and_mul")
    assert rel_l2(expected[-1], ref) < 3e-2  # five chained bf16 roundings
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(5):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out, exp in zip(outs, expected):
            assert torch.equal(out, exp)


# --------------------------------------------------------------------------------------- interpreter


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_interpret(dtype):
    small = GemvConfig(BLOCK_N=4, BLOCK_K=64, SPLIT_K=1, num_warps=2, num_stages=2)
    check_gemv(64, 256, dtype, "cpu", config=small)  # even: no masks
    check_gemv(37, 200, dtype, "cpu", config=small, bias=True)  # ragged N and K
    check_gemv(37, 200, dtype, "cpu", config=small, act="silu_and_mul", strided=True)
    check_gemv(5, 96, dtype, "cpu")  # pick_config's choice
    check_gemv(300, 130, dtype, "cpu", bias=True, act="silu_and_mul")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split_k", [2, 3, 4, 8])
def test_gemv_split_k_interpret(dtype, split_k):
    cfg = GemvConfig(BLOCK_N=8, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=3)
    check_gemv(64, 256, dtype, "cpu", config=cfg)  # K splits evenly
    check_gemv(50, 200, dtype, "cpu", config=cfg, bias=True)  # ragged: last split short
    check_gemv(19, 70, dtype, "cpu", config=cfg, act="silu_and_mul", strided=True)  # fewer blocks than splits
    # The counters are left at zero (the next call or graph replay needs them so) and results repeat.
    from pagedllm.kernels import gemv as gemv_module

    x = randn(1, 256, dtype=dtype, device="cpu")
    weight = randn(64, 256, dtype=dtype, device="cpu", seed=1)
    first = gemv(x, weight, config=cfg)
    assert torch.equal(gemv(x, weight, config=cfg), first)
    assert not gemv_module._COUNTERS[torch.device("cpu")].any()


@needs_interpreter
def test_gemv_edge_cases_interpret():
    x = randn(1, 16, dtype=torch.float32, device="cpu")
    assert gemv(x, torch.empty(0, 16)).shape == (1, 0)
    bias = randn(3, dtype=torch.float32, device="cpu")
    assert torch.equal(gemv(torch.empty(1, 0), torch.empty(3, 0), bias), bias[None])
    with pytest.raises(AssertionError):
        gemv(randn(2, 16, dtype=torch.float32, device="cpu"), torch.ones(3, 16))  # two rows
    with pytest.raises(AssertionError):
        gemv(x, torch.ones(16, 3).t())  # not row-major
    with pytest.raises(AssertionError):
        gemv(x, torch.ones(3, 16), act="silu_and_mul")  # needs [1, 2K]
