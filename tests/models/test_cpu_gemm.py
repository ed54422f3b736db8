"""CPU linear layers through oneDNN with packed weights (``pagedllm/layers/cpu_gemm.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers import cpu_gemm
from pagedllm.layers.cpu_gemm import can_pack, linear, onednn_enabled, pack_weight
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import Linear, UnquantizedLinearMethod
from pagedllm.model_loader import get_model

needs_onednn = pytest.mark.skipif(not onednn_enabled(), reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 48, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_float32(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = pack_weight(w, min_elements=0)
    assert packed is not None
    out = linear(x, w, packed, b)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_takes_any_leading_shape_and_strided_input() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    packed = pack_weight(w, min_elements=0)
    x3 = torch.randn(2, 5, 32, generator=g)  # [B, T, in]
    torch.testing.assert_close(linear(x3, w, packed), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    wide = torch.randn(6, 100, generator=g)
    x = wide[:, 10:42]  # a strided view, as a slice of a fused projection's output is
    assert not x.is_contiguous()
    torch.testing.assert_close(linear(x, w, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_dtype_this_cpu_cannot_pack_stays_on_f_linear(monkeypatch) -> None:
    from pagedllm.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "can_pack", lambda dtype: dtype != torch.bfloat16)
    assert pack_weight(torch.randn(128, 64).bfloat16(), min_elements=0) is None


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN packs no bfloat16 weights on this CPU")
def test_packed_linear_bfloat16_equals_f_linear() -> None:
    # bfloat16 F.linear already runs through oneDNN on CPU: packing changes the layout, not the result.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g).bfloat16()
    out = linear(x, w, pack_weight(w, min_elements=0))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-2, atol=1e-2)


@needs_onednn
def test_packed_linear_rejects_a_dtype_mismatch() -> None:
    w = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="does not match"):
        linear(torch.randn(2, 4, dtype=torch.float64), w, pack_weight(w, min_elements=0))


@needs_onednn
def test_packed_copy_follows_the_weight() -> None:
    """An in-place change (version counter) or a new weight tensor is packed again at the next call."""
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(16, 8, generator=g), requires_grad=False)
    packed = pack_weight(w, min_elements=0)
    x = torch.randn(3, 8, generator=g)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(linear(x, w, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # the engine's mode: still seen
        w.zero_()
        assert torch.equal(linear(x, w, packed), torch.zeros(3, 16))
    other = torch.randn(16, 8, generator=g)
    torch.testing.assert_close(linear(x, other, packed), F.linear(x, other), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # an inference tensor has no version counter: packed, and followed by identity
        frozen = torch.randn(16, 8, generator=g)
    assert frozen.is_inference()
    packed = pack_weight(frozen, min_elements=0)
    torch.testing.assert_close(linear(x, frozen, packed), F.linear(x, frozen), rtol=1e-5, atol=1e-5)


def test_weights_that_stay_on_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pack_weight(torch.randn(8, 4, dtype=torch.float64)) is None  # dtype oneDNN does not pack here
    assert pack_weight(torch.randn(8, 4, device="meta")) is None  # not on CPU
    assert pack_weight(torch.randn(0, 4)) is None
    assert pack_weight(torch.randn(2, 8, 4)) is None  # not a matrix
    assert pack_weight(torch.randn(100, 100)) is None  # small: oneDNN's per-call cost outweighs its speed
    if onednn_enabled():
        assert pack_weight(torch.randn(256, 256)) is not None
    monkeypatch.setenv("PAGEDLLM_CPU_ONEDNN", "0")
    assert not onednn_enabled()
    w = torch.randn(8, 4)
    assert pack_weight(w) is None
    x = torch.randn(3, 4)
    assert torch.equal(linear(x, w, None), F.linear(x, w))


def _load(path: str) -> torch.nn.Module:
    model_config = ModelConfig(model=path, dtype="float32")
    return get_model(model_config, torch.device("cpu"), TorchAttentionBackend())


@needs_onednn
def test_loaded_model_packs_every_linear_and_the_lm_head(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "PACK_MIN_ELEMENTS", 0)  # the tiny model's layers are below the size cut
    model = _load(tiny_llama)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    assert linears and len(heads) == 1
    for m in linears:
        assert isinstance(m.quant_method, UnquantizedLinearMethod)
        assert m.packed_weight is not None and m.packed_weight.get(m.weight).is_mkldnn
        assert m.weight.dtype == torch.float32 and not m.weight.is_mkldnn  # the plain weight stays
    assert heads[0].packed_weight is not None

    # The same checkpoint with packing off gives the same logits within float32 rounding.
    monkeypatch.setenv("PAGEDLLM_CPU_ONEDNN", "0")
    plain = _load(tiny_llama)
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, Linear))
    with torch.inference_mode():
        for a, b in zip(linears, [m for m in plain.modules() if isinstance(m, Linear)]):
            x = torch.randn(5, a.input_size)
            torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
        head_plain = next(m for m in plain.modules() if isinstance(m, LMHead))
        h = torch.randn(5, head_plain.weight.shape[1])
        torch.testing.assert_close(heads[0](h), head_plain(h), rtol=1e-5, atol=1e-5)


# --- one-row products through the Triton GEMV (GPU) ----------------------------------------------------------


def test_one_row_gemv_is_gpu_only_and_needs_a_half_precision_row() -> None:
    from pagedllm.layers.cpu_gemm import one_row_gemv

    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert not one_row_gemv(torch.randn(1, 32, dtype=torch.bfloat16), w)  # CPU: never
    if torch.cuda.is_available():
        wc = w.cuda()
        assert one_row_gemv(torch.randn(1, 32, dtype=torch.bfloat16, device="cuda"), wc)
        assert one_row_gemv(torch.randn(1, 1, 32, dtype=torch.bfloat16, device="cuda"), wc)
        assert not one_row_gemv(torch.randn(2, 32, dtype=torch.bfloat16, device="cuda"), wc)
        assert not one_row_gemv(torch.randn(1, 32, device="cuda"), wc.float())  # float32 stays on cuBLAS
        assert not one_row_gemv(torch.randn(1, 32, dtype=torch.bfloat16, device="cuda"), wc.t().contiguous().t())


def test_act_then_linear_declines_on_cpu_and_under_lora_or_quantization() -> None:
    from pagedllm.layers.linear import RowParallelLinear, act_then_linear

    layer = RowParallelLinear(32, 16)
    torch.nn.init.normal_(layer.weight)
    assert act_then_linear(layer, torch.randn(1, 64), "silu_and_mul") is None  # CPU: the caller runs both


def test_pdl_only_inside_its_scope_on_hopper_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels launch as PDL only inside launch_with_pdl (the decode graphs' capture), on compute capability 9+
    with the fused kernels on, and not with PAGEDLLM_PDL=0."""
    from types import SimpleNamespace

    from pagedllm import platform

    gpu_row = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert not platform.use_pdl(torch.zeros(1))
    monkeypatch.setattr(platform, "use_fused_kernels", lambda x: x.is_cuda)
    monkeypatch.setattr(platform, "_pdl_capable", lambda index: True)  # a faked Hopper
    assert not platform.use_pdl(gpu_row)  # outside the scope: plain launches
    with platform.launch_with_pdl():
        assert platform.use_pdl(gpu_row)
        assert not platform.use_pdl(torch.zeros(1))  # CPU
        monkeypatch.setenv("PAGEDLLM_PDL", "0")
        assert not platform.use_pdl(gpu_row)
        monkeypatch.delenv("PAGEDLLM_PDL")
        monkeypatch.setattr(platform, "_pdl_capable", lambda index: False)  # Ampere
        assert not platform.use_pdl(gpu_row)
    monkeypatch.setattr(platform, "_pdl_capable", lambda index: True)
    assert not platform.use_pdl(gpu_row)  # the scope has ended


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_linear_and_mlp_take_the_gemv_on_gpu(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """A single bf16 row through Linear, the LM head and LlamaMLP launches the GEMV (counted), and equals the
    cuBLAS path (fused kernels off) within bf16 rounding; two rows stay on cuBLAS."""
    from types import SimpleNamespace

    import pagedllm.kernels.gemv as gemv_mod
    from pagedllm.layers.embedding import LMHead
    from pagedllm.layers.linear import Linear
    from pagedllm.models.llama import LlamaMLP
    from pagedllm.platform import launch_with_pdl

    calls = []
    real = gemv_mod.gemv

    pdl = []

    def counting(*args, **kwargs):
        pdl.append(kwargs.get("pdl"))
        calls.append(kwargs.get("act"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_mod, "gemv", counting)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = SimpleNamespace(hidden_size=256, intermediate_size=512, hidden_act="silu", mlp_bias=bias)
    mlp = LlamaMLP(cfg).to(dev, torch.bfloat16)
    lin = Linear(256, 384, bias=bias).to(dev, torch.bfloat16)
    head = LMHead(1000, 256).to(dev, torch.bfloat16)
    for m in (mlp, lin, head):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 256, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = [mlp(x), lin(x), head(x)]
        assert calls == [None, "silu_and_mul", None, None]  # gate_up, down with silu, the linear, the head
        assert pdl == [False] * 4  # eager: plain launches
        with launch_with_pdl():  # as in the decode graphs' capture: PDL on Hopper and later
            torch.testing.assert_close(lin(x), got[1], rtol=0, atol=0)
        assert pdl[-1] is (torch.cuda.get_device_capability()[0] >= 9)
        calls.clear()
        mlp(torch.randn(2, 256, device=dev, dtype=torch.bfloat16))
        assert calls == []
        monkeypatch.setattr("pagedllm.platform._fast_ops_disabled", lambda: True)  # (the switch is read once)
        want = [mlp(x), lin(x), head(x)]
        assert calls == []
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
