"""MoE models (Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS, DeepSeek-V2/V3) under tensor parallelism, with and without
expert parallelism.

* Per rank, in-process (``TPGroup(rank, 2)`` without a process group builds and loads a rank's part): rank r's
  expert tensors are its slice of every expert's intermediate dim (TP) or its E / T whole experts (EP), loaded
  from the whole checkpoint tensors transformers saves (per expert, or GPT-OSS's stacked and interleaved ones with
  their biases), and the ranks' partial block outputs (shared experts included) add up to the single-rank block's
  output. (The engine runs of GPT-OSS and DeepSeek are in tests/distributed/test_tp_pp_families.py.)
* The expert-parallel skip in both expert paths: ``moe_align`` gives remote experts (id ``E``) no row, the twin
  and the kernel path (emulated GEMM; the real one under ``TRITON_INTERPRET=1``) give them zero.
* Through the engine: ``LLM(..., tensor_parallel_size=2)`` (CPU, gloo, one worker process) greedy tokens equal
  transformers', with and without ``enable_expert_parallel``; no leaked blocks. One multi-rank engine at a time.
* Bad configs are refused at start-up with the field named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels.fused_moe import fused_experts, fused_experts_ref, moe_align
from pagedllm.layers.fused_moe import EXPERT_PARALLEL_ATTR, FusedMoE, RemoteExpert
from pagedllm.model_loader import get_model
from tests.kernels.test_triton_fused_moe import INTERPRET, make_inputs, no_host_sync, use_emulated_kernels
from tests.models.test_deepseek import tiny_deepseek
from tests.models.test_gpt_oss_qwen2moe import make_tiny
from tests.models.test_moe import make_tiny_moe
from tests.utils import hf_greedy

TP = 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_tp")
    return {
        "mixtral": make_tiny_moe("mixtral", root / "mixtral", seed=11),  # 8 experts, inter 96
        "qwen3moe": make_tiny_moe("qwen3_moe", root / "qwen3moe", seed=12, norm_topk_prob=True),  # 8, 48
        "qwen2moe": make_tiny("qwen2_moe", root / "qwen2moe", seed=13),  # 6 experts, inter 32, shared 40
        "gpt_oss": make_tiny("gpt_oss", root / "gpt_oss", seed=14),  # 4 stacked experts with biases, inter 48
        # 8 experts, inter 32, 2 shared; layer 0 dense
        "deepseek_v2": tiny_deepseek("v2-group", root / "deepseek_v2", seed=15),
        "deepseek_v3": tiny_deepseek("v3", root / "deepseek_v3", seed=16),
    }


def _load(path: str, tp: TPGroup | None = None, expert_parallel: bool = False) -> torch.nn.Module:
    model_config = ModelConfig(model=path, dtype="float32")
    setattr(model_config.hf_config, EXPERT_PARALLEL_ATTR, expert_parallel)
    return get_model(model_config, torch.device("cpu"), TorchAttentionBackend(), tp=tp)


def _moe_blocks(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("variant", ["mixtral", "qwen3moe", "qwen2moe", "gpt_oss", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@torch.inference_mode()
def test_rank_slices_and_partial_outputs_sum_to_the_whole(moe_dirs, variant: str, expert_parallel: bool):
    whole = _load(moe_dirs[variant])
    ranks = [_load(moe_dirs[variant], TPGroup(r, TP), expert_parallel) for r in range(TP)]
    x = torch.randn(13, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    blocks = _moe_blocks(whole)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        parts = [_moe_blocks(model)[i] for model in ranks]
        num_experts, two_inter, _ = block.w13.shape
        inter = two_inter // 2
        for r, part in enumerate(parts):
            assert part.expert_parallel == expert_parallel
            router = "router" if variant == "gpt_oss" else "gate"
            for name, param in getattr(block, router).named_parameters():  # the router is replicated
                assert torch.equal(getattr(getattr(part, router), name), param)
            if expert_parallel:
                local = num_experts // TP
                experts = slice(r * local, (r + 1) * local)
                assert part.w13.shape == (local, two_inter, block.w13.shape[2])
                assert torch.equal(part.w13, block.w13[experts]) and torch.equal(part.w2, block.w2[experts])
                if block.w2_bias is not None:  # each expert on one rank: its biases whole there
                    assert torch.equal(part.w13_bias, block.w13_bias[experts])
                    assert torch.equal(part.w2_bias, block.w2_bias[experts])
                if isinstance(part.experts, torch.nn.ModuleList):  # per-expert checkpoint modules
                    remote = [e for e, m in enumerate(part.experts) if isinstance(m, RemoteExpert)]
                    assert remote == [e for e in range(num_experts) if not r * local <= e < (r + 1) * local]
            else:
                units = slice(r * inter // TP, (r + 1) * inter // TP)
                gate, up = block.w13[:, :inter], block.w13[:, inter:]
                assert torch.equal(part.w13, torch.cat([gate[:, units], up[:, units]], dim=1))
                assert torch.equal(part.w2, block.w2[:, :, units])
                if block.w2_bias is not None:  # gate/up biases split with their units, the down bias once
                    b_gate, b_up = block.w13_bias[:, :inter], block.w13_bias[:, inter:]
                    assert torch.equal(part.w13_bias, torch.cat([b_gate[:, units], b_up[:, units]], dim=1))
                    want = block.w2_bias if r == 0 else torch.zeros_like(block.w2_bias)
                    assert torch.equal(part.w2_bias, want)
            # Qwen2-MoE's shared expert, DeepSeek's shared experts: split like a dense MLP, down_proj unreduced
            shared = getattr(part, "shared_expert", None) or getattr(part, "shared_experts", None)
            if shared is not None:
                whole_shared = getattr(block, "shared_expert", None) or block.shared_experts
                width = whole_shared.down_proj.input_size // TP
                assert shared.gate_up_proj.weight.shape[0] == 2 * width
                assert shared.down_proj.input_size == width and not shared.down_proj.reduce_results
        total = sum(part.forward_partial(x) for part in parts)
        torch.testing.assert_close(total, block(x), atol=ATOL, rtol=0)
        if expert_parallel:  # each rank contributes only its own experts' outputs
            assert all((part.forward_partial(x) - total).abs().max() > 1e-3 for part in parts)


@pytest.mark.parametrize("variant", ["gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("path", ["emulated", "interpret"])
@torch.inference_mode()
def test_rank_parts_on_the_kernel_path_sum_to_the_whole(
    moe_dirs, variant: str, expert_parallel: bool, path: str, monkeypatch
) -> None:
    """GPT-OSS's biased experts and DeepSeek's shared + routed ones, each rank's part as it runs on CUDA (the kernel
    path: emulated GEMMs without a host sync, or the real kernels under ``TRITON_INTERPRET=1``): the parts add up
    to the single-rank block's output on the PyTorch twin path."""
    import pagedllm.layers.fused_moe as layer_module

    if path == "interpret" and not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1")
    whole = _moe_blocks(_load(moe_dirs[variant]))[-1]
    parts = [_moe_blocks(_load(moe_dirs[variant], TPGroup(r, TP), expert_parallel))[-1] for r in range(TP)]
    x = torch.randn(9, whole.w13.shape[2], generator=torch.Generator().manual_seed(1))
    want = whole(x)  # CPU: the twin
    monkeypatch.setattr(layer_module, "use_fused_kernels", lambda t: True)
    if path == "emulated":
        use_emulated_kernels(monkeypatch)
        with no_host_sync(monkeypatch):
            total = sum(part.forward_partial(x) for part in parts)
    else:
        total = sum(part.forward_partial(x) for part in parts)
    torch.testing.assert_close(total, want, atol=ATOL, rtol=0)


def _remote_ids(ids: torch.Tensor, local: int, rank: int) -> torch.Tensor:  # global -> this rank's (E_r: remote)
    shifted = ids - rank * local
    return shifted.masked_fill((shifted < 0) | (shifted >= local), local)


def test_moe_align_gives_remote_experts_no_rows() -> None:
    ids = torch.tensor([[2, 0], [3, 2], [0, 2], [3, 2]])  # 3 local experts; id 3: an expert held elsewhere
    sorted_ids, block_expert, num_blocks = moe_align(ids, num_experts=3, block_m=4)
    pad = ids.numel()
    used = int(num_blocks)
    assert used == 2  # expert 0 (2 assignments) and expert 2 (4); the 2 remote assignments get no block
    rows = sorted_ids.view(-1, 4)[:used]
    assert rows[0].tolist() == [1, 4, pad, pad] and rows[1].tolist() == [0, 3, 5, 7]
    assert block_expert[:used].tolist() == [0, 2]
    assert set(sorted_ids.tolist()) == {0, 1, 3, 4, 5, 7, pad}  # 2 and 6 (remote) appear nowhere


@pytest.mark.parametrize("path", ["twin", "emulated", "interpret"])
def test_expert_paths_skip_remote_experts(path: str, monkeypatch) -> None:
    """Rank r of 2 with the experts [r * E/2, (r + 1) * E/2): twin and kernel path compute only those, and the
    two ranks' outputs add up to the whole layer's."""
    if path == "interpret" and not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1")
    num_experts, top_k = 6, 2
    x, w13, w2, weights, ids = make_inputs(11, num_experts, top_k, 32, 16, torch.float32, "cpu")
    want = fused_experts_ref(x, w13, w2, weights, ids)
    local = num_experts // 2
    if path == "emulated":
        use_emulated_kernels(monkeypatch)
    total = torch.zeros_like(x)
    for rank in range(2):
        mine = slice(rank * local, (rank + 1) * local)
        local_ids = _remote_ids(ids, local, rank)
        if path == "twin":
            out = fused_experts_ref(x, w13[mine], w2[mine], weights, local_ids)
        elif path == "emulated":
            with no_host_sync(monkeypatch):
                out = fused_experts(x, w13[mine], w2[mine], weights, local_ids, remote_experts=True)
        else:
            out = fused_experts(x, w13[mine], w2[mine], weights, local_ids, remote_experts=True)
        # oracle: only this rank's experts, every one on the tokens that picked it
        expect = torch.zeros_like(x)
        for e in range(rank * local, (rank + 1) * local):
            gate, up = (x @ w13[e].T).chunk(2, dim=-1)
            mix = (weights * (ids == e)).sum(-1, keepdim=True)
            expect += mix * ((F.silu(gate) * up) @ w2[e].T)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
        total += out
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_remote_rows_are_zeroed_even_when_unwritten(monkeypatch) -> None:
    """The kernel path leaves remote assignments' rows unwritten (``torch.empty``): they must not leak into the
    sum. A GEMM stand-in that fills unwritten rows with NaN shows they are masked."""
    import pagedllm.kernels.fused_moe as fm
    from tests.kernels.test_triton_fused_moe import emulated_moe_gemm

    def nan_gemm(a, w, sorted_ids, block_expert, num_blocks, num_assign, a_div, scale, block_m, bias=None, config=None):
        c = emulated_moe_gemm(a, w, sorted_ids, block_expert, num_blocks, num_assign, a_div, scale, block_m, bias)
        written = torch.zeros(num_assign + 1, dtype=torch.bool)
        written[sorted_ids.long()] = True
        return c.masked_fill(~written[:num_assign, None], float("nan"))

    use_emulated_kernels(monkeypatch)
    monkeypatch.setattr(fm, "_moe_gemm", nan_gemm)
    x, w13, w2, weights, ids = make_inputs(9, 4, 2, 32, 16, torch.float32, "cpu")
    local_ids = _remote_ids(ids, 2, 0)
    out = fused_experts(x, w13[:2], w2[:2], weights, local_ids, remote_experts=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_experts_ref(x, w13[:2], w2[:2], weights, local_ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "variant, expert_parallel",
    [("mixtral", False), ("mixtral", True), ("qwen3moe", False), ("qwen3moe", True), ("qwen2moe", True)],
)
def test_tp2_engine_greedy_matches_transformers(moe_dirs, variant: str, expert_parallel: bool) -> None:
    from pagedllm import LLM, SamplingParams

    path = moe_dirs[variant]
    llm = LLM(
        path,
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
        enable_expert_parallel=expert_parallel,
        dtype="float32",
        device="cpu",
        block_size=4,
        max_num_batched_tokens=8,
    )
    try:
        vocab = llm.llm_engine.engine_core.vocab_size
        gen = torch.Generator().manual_seed(len(variant) + expert_parallel)
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 11, 6)]
        max_new = 6
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(path, prompts, max_new)
        core = llm.llm_engine.engine_core
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "variant, kw, field",
    [
        ("qwen3moe", {"tensor_parallel_size": 3}, "tensor_parallel_size"),  # heads / sizes do not split
        ("qwen2moe", {"tensor_parallel_size": 4, "enable_expert_parallel": True}, "num_experts"),  # 6 experts
        ("gpt_oss", {"tensor_parallel_size": 3}, r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"),
        (
            "deepseek_v3",
            {"tensor_parallel_size": 3},
            r"moe_intermediate_size \(32\).*tensor_parallel_size \(3\)",
        ),
        (
            "deepseek_v2",
            {"tensor_parallel_size": 3, "enable_expert_parallel": True},
            r"n_routed_experts \(8\).*tensor_parallel_size \(3\)",
        ),
    ],
)
def test_bad_moe_parallel_configs_fail_at_startup(moe_dirs, variant: str, kw: dict, field: str) -> None:
    from pagedllm.config import make_engine_config

    path = moe_dirs[variant]
    with pytest.raises(ValueError, match=field):
        make_engine_config(path, device="cpu", **kw)


def test_moe_sizes_that_do_not_split_are_refused(tmp_path: Path) -> None:
    from pagedllm.config import make_engine_config

    path = make_tiny_moe("qwen3_moe", tmp_path / "odd", seed=3, moe_intermediate_size=50, num_experts=6)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(50\).*tensor_parallel_size \(4\)"):
        make_engine_config(path, device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"num_experts \(6\).*tensor_parallel_size \(4\)"):
        make_engine_config(path, device="cpu", tensor_parallel_size=4, enable_expert_parallel=True)
    make_engine_config(path, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)  # 6 / 2 fine
    # the flag without TP > 1 is accepted and does nothing
    config = make_engine_config(path, device="cpu", enable_expert_parallel=True)
    assert config.parallel_config.enable_expert_parallel
    assert not getattr(config.model_config.hf_config, EXPERT_PARALLEL_ATTR, False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # per-layer check, in-process
        FusedMoE(6, 2, 16, 50, True, tp=TPGroup(0, 4), intermediate_size_field="moe_intermediate_size")


@pytest.mark.parametrize(
    "arch, fields, tp_size, expert_parallel, field",
    [
        ("GptOssForCausalLM", {"num_local_experts": 6, "intermediate_size": 48}, 4, True, r"num_local_experts \(6\)"),
        ("GptOssForCausalLM", {"num_local_experts": 8, "intermediate_size": 50}, 4, False, r"intermediate_size \(50\)"),
        ("DeepseekV2ForCausalLM", {"n_routed_experts": 6, "moe_intermediate_size": 32}, 4, True, r"n_routed_experts \(6\)"),
        ("DeepseekV3ForCausalLM", {"n_routed_experts": 8, "moe_intermediate_size": 30}, 4, False, r"moe_intermediate_size \(30\)"),
        # expert parallel leaves the routed experts whole, but the shared ones still split like a dense MLP
        (
            "DeepseekV3ForCausalLM",
            {"n_routed_experts": 8, "moe_intermediate_size": 30, "n_shared_experts": 1},
            4,
            True,
            r"n_shared_experts \* moe_intermediate_size \(30\).*tensor_parallel_size \(4\)",
        ),
    ],
)  # fmt: skip
def test_moe_expert_fields_that_do_not_split_are_named(
    arch: str, fields: dict, tp_size: int, expert_parallel: bool, field: str
) -> None:
    from types import SimpleNamespace

    from pagedllm.layers.fused_moe import verify_moe_tp_config

    config = SimpleNamespace(architectures=[arch], **fields)
    with pytest.raises(ValueError, match=field):
        verify_moe_tp_config(config, tp_size, expert_parallel)
    verify_moe_tp_config(config, 2, expert_parallel)  # 2 ranks split all of them
