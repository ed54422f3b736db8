"""Triton multi-LoRA shrink/expand against their PyTorch twins (``pagedllm.lora.ops_ref``).

GPU tests are marked ``gpu``. With ``TRITON_INTERPRET=1`` the ``interpret`` tests run small shapes through
Triton's CPU interpreter on CPU tensors::

    TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/lora/test_triton_lora_kernels.py -k interpret

Skipped without Triton (CI).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils import rel_l2

pytest.importorskip("triton")

from pagedllm.kernels.lora_shrink_expand import (  # noqa: E402
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from pagedllm.lora import layers as lora_layers  # noqa: E402
from pagedllm.lora.layers import LoRAMapping  # noqa: E402
from tests.lora.lora_utils import ATOL, MIXED, hf_peft_logits, run_mixed_batch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}



def check_shrink_expand(
    num_tokens: int,
    in_size: int,
    output_sizes: list[int],
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> None:
    g = torch.Generator().manual_seed(seed)
    num_slices, out = len(output_sizes), sum(output_sizes)
    offsets = [sum(output_sizes[:i]) for i in range(num_slices + 1)]
    slots = torch.randint(-1, max_loras, (num_tokens,), generator=g)  # [T]; -1: base rows
    slots[-1] = max_loras - 1  # the last slot is used
    if num_tokens > 1:
        slots[0] = -1  # and some base rows
    x = torch.randn(num_tokens, in_size, generator=g).to(dtype)  # [T, in]
    lora_a = (torch.randn(max_loras, num_slices * max_rank, in_size, generator=g) * 0.2).to(dtype)
    lora_b = (torch.randn(max_loras, out, max_rank, generator=g) * 0.2).to(dtype)
    y0 = torch.randn(num_tokens, out, generator=g).to(dtype)  # [T, out]: the base output

    mapping = LoRAMapping(max_num_tokens=num_tokens + 5, max_loras=max_loras, device=device)
    mapping.update(slots)
    x_d, a_d, b_d = x.to(device), lora_a.to(device), lora_b.to(device)
    h = lora_shrink(x_d, a_d, mapping.sorted_token_ids, mapping.slot_num_tokens, mapping.slot_start)
    h_ref = lora_shrink_ref(x, lora_a, slots)
    rows = (slots >= 0).nonzero().squeeze(1)
    h_tol = 1e-5 if dtype == torch.float32 else 1e-4  # exact products, fp32 sums in another order
    assert rel_l2(h[rows.to(device)].cpu(), h_ref[rows]) < h_tol

    y = y0.clone().to(device)
    offsets_d = torch.tensor(offsets, dtype=torch.int32, device=device)
    lora_expand(
        h_ref.to(device),
        b_d,
        y,
        mapping.sorted_token_ids,
        mapping.slot_num_tokens,
        mapping.slot_start,
        offsets_d,
    )
    y_ref = y0.clone()
    lora_expand_ref(h_ref, lora_b, y_ref, slots, offsets)
    y = y.cpu()
    base = (slots < 0).nonzero().squeeze(1)
    torch.testing.assert_close(y[base], y0[base], atol=0, rtol=0)  # base rows untouched
    assert (y_ref.float() - y0.float()).abs().max() > 0.1  # the adapters move the output
    assert rel_l2(y, y_ref) < TOL[dtype]
    assert rel_l2(y.float() - y0.float(), y_ref.float() - y0.float()) < 4 * TOL[dtype]


CASES = [  # (num_tokens, in, output_sizes, max_loras, max_rank)
    (1, 64, [64], 1, 16),
    (7, 64, [64, 32, 32], 4, 16),  # q/k/v, GQA
    (37, 96, [40, 24, 24], 3, 8),  # slices not multiples of the block
    (20, 48, [128, 128], 2, 32),  # gate/up
    (33, 130, [70], 5, 4),  # rank below the block, odd sizes
]


@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_lora_shrink_expand_interpret(case) -> None:
    check_shrink_expand(*case, dtype=torch.float32, device="cpu")


@needs_interpreter
def test_lora_shrink_expand_bf16_interpret() -> None:
    check_shrink_expand(19, 64, [64, 32, 32], 3, 16, dtype=torch.bfloat16, device="cpu")


@needs_interpreter
def test_model_with_lora_kernels_matches_peft_interpret(tiny_model_dirs, lora_adapters, monkeypatch) -> None:
    """The tiny Llama with its LoRA layers on the kernels (interpreted, CPU tensors), mixed adapters in one
    batch, against transformers + peft: checks the kernels' wiring (slices, offsets, grouping) end to end."""
    monkeypatch.setattr(lora_layers, "use_fused_kernels", lambda x: True)
    base, adapters = tiny_model_dirs["llama"], lora_adapters["llama"]
    out, prompts, _ = run_mixed_batch(base, adapters, MIXED)
    for name, prompt, logits in zip(MIXED, prompts, out):
        expected = hf_peft_logits(base, adapters.get(name), tuple(prompt))
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        (300, 4096, [4096, 1024, 1024], 4, 64),
        (513, 4096, [14336, 14336], 8, 16),
        (2048, 14336, [4096], 4, 8),
    ],
)
def test_lora_shrink_expand_cuda(case, dtype) -> None:
    check_shrink_expand(*case, dtype=dtype, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_lora_kernels_replay_in_cuda_graph() -> None:
    """Captured once, the kernels follow whatever slot assignment is written into the mapping's buffers."""
    num_tokens, in_size, out, max_loras, r = 24, 64, 96, 3, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, in_size, generator=g).cuda()
    lora_a = (torch.randn(max_loras, r, in_size, generator=g) * 0.2).cuda()
    lora_b = (torch.randn(max_loras, out, r, generator=g) * 0.2).cuda()
    offsets = torch.tensor([0, out], dtype=torch.int32, device="cuda")
    mapping = LoRAMapping(num_tokens, max_loras, "cuda")
    mapping.update(torch.zeros(num_tokens, dtype=torch.int64), force_apply=True)
    y = torch.zeros(num_tokens, out, device="cuda")

    def step():
        y.zero_()
        h = lora_shrink(x, lora_a, mapping.sorted_token_ids, mapping.slot_num_tokens, mapping.slot_start)
        lora_expand(
            h, lora_b, y, mapping.sorted_token_ids, mapping.slot_num_tokens, mapping.slot_start, offsets
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        slots = torch.randint(-1, max_loras, (num_tokens,), generator=torch.Generator().manual_seed(seed))
        mapping.update(slots)
        graph.replay()
        torch.cuda.synchronize()
        y_ref = torch.zeros(num_tokens, out)
        lora_expand_ref(lora_shrink_ref(x.cpu(), lora_a.cpu(), slots), lora_b.cpu(), y_ref, slots, [0, out])
        torch.testing.assert_close(y.cpu(), y_ref, atol=1e-4, rtol=1e-4)
