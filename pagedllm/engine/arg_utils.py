"""Engine flags with vLLM's names, shared by `pagedllm serve`, `generate` and the benchmarks."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.config import EngineConfig, make_engine_config


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add the engine's flags (vLLM names) to ``parser``."""
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model directory or hub id")
    parser.add_argument(
        "--model", default=None, help="model directory or hub id (default: the bundled demo model)"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"]
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    # None: the device's default (config.default_batch_limits: vLLM's table, by GPU memory and usage context).
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="generate text, or pool (embed / classify / score); auto: pooling for encoder and "
        "sequence-classification architectures and sentence-transformers checkpoints",
    )
    parser.add_argument(
        "--pooler-config",
        type=_json_dict,
        default=None,
        help='a pooling model\'s pooling over the checkpoint\'s, as JSON: {"pooling_type": "MEAN", "normalize": false}',
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=_json_dict,
        default=None,
        help='a multimodal model\'s most images per prompt, as JSON: \'{"image": 4}\' (default 999)',
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory under which file:// image URLs may be read (default: file:// URLs are refused)",
    )
    parser.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        default=4.0,
        help="GiB of preprocessed images kept by content, so a repeated image skips the image processor (0: off)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8", "gptq", "awq", "compressed-tensors", "gptq_marlin", "awq_marlin"],
        help="quantization method; default: the checkpoint's quantization_config ('fp8' also quantizes a float "
        "checkpoint online)",
    )
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="KV cache element type: auto = the model dtype; fp8 = float8_e4m3fn with per-layer k/v scales "
        "from the checkpoint (else 1.0)",
    )
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="models mixing sliding-window and full-attention layers (Gemma 2/3, GPT-OSS): keep every KV block for "
        "every layer instead of freeing the sliding layers' blocks behind their window",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--compilation-config",
        "-cc",
        type=_json_or_int,
        default=None,
        help='vLLM\'s, as JSON: its "cudagraph_mode" picks the CUDA graphs (FULL_AND_PIECEWISE, the default; '
        "FULL_DECODE_ONLY; PIECEWISE; NONE; FULL falls back to the default); torch.compile keys are ignored. "
        "vLLM's dotted form (-cc.cudagraph_mode=...) is not taken",
    )
    parser.add_argument(
        "--optimization-level",
        "-O",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="vLLM's levels, for the CUDA graphs: 0 none, 1 PIECEWISE, 2 and 3 FULL_AND_PIECEWISE (the default); "
        "a cudagraph_mode in --compilation-config wins",
    )
    parser.add_argument("--attention-backend", default=None, choices=[None, "torch", "triton"])
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="admission order: arrival (fcfs), or the request's priority (lower first) then arrival; under "
        "priority the lowest-priority running request is the one preempted",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap every request's chunk at this many tokens per step, and call a prompt with more left 'long' "
        "(0: off; 4%% of --max-model-len when --max-num-partial-prefills > 1)",
    )
    parser.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="most requests mid-prefill at once (1: no limit, as vLLM; > 1 needs chunked prefill)",
    )
    parser.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=1,
        help="of those, most with a long prompt: shorter prompts overtake the rest (<= --max-num-partial-prefills)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan the next step while the GPU runs this one (default: on with CUDA, off on CPU)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many ranks (worker processes on this node; GPUs cuda:0..T-1)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="split the model's layers over this many stages, each of --tensor-parallel-size ranks (worker "
        "processes on this node; GPUs cuda:0..P*T-1)",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=[None, "mp", "ray"],
        help="how the ranks start: 'mp' (worker processes on this node) or 'ray' (Ray actors on the Ray cluster; "
        "several nodes); default 'mp', or 'ray' when the ranks outnumber this node's GPUs and Ray is installed",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models with --tensor-parallel-size > 1: give each rank whole experts (num_experts / T of them) "
        "instead of every expert's slice of the intermediate dim",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="whole engine copies (each its own KV cache and GPU) behind one front-end; requests go to the least loaded",
    )
    parser.add_argument(
        "--speculative-config",
        type=_json_dict,
        default=None,
        help='speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\', \'{"model": DRAFT_DIR, "num_speculative_tokens": 4}\' or (a DeepSeek-V3 '
        'checkpoint\'s own MTP layer) \'{"method": "mtp", "num_speculative_tokens": 1}\'',
    )
    parser.add_argument(
        "--kv-transfer-config",
        type=_json_dict,
        default=None,
        help='a KV connector, as JSON: \'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"num_cpu_blocks": 4096}}\'; disaggregated prefill/decode: "P2pConnector" '
        'with "kv_role" "kv_producer" (and "kv_port") or "kv_consumer"; "kv_connector_module_path" loads one from '
        "another module",
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of CPU memory for KV blocks beyond the device cache (a second prefix-cache tier)",
    )
    parser.add_argument(
        "--kv-offloading-backend",
        default=None,
        choices=[None, "native"],
        help="what --kv-offloading-size uses: the native CPU offloading connector",
    )
    parser.add_argument(
        "--swap-space", type=float, default=None, help="vLLM's older name for --kv-offloading-size (GiB)"
    )
    parser.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0,
        help="GiB of each GPU's model weights (whole decoder layers, from the first) kept in CPU memory and copied "
        "to the GPU for every forward pass: more room for the KV cache, at the cost of a copy of those weights each "
        "step (needs a fast CPU-GPU link)",
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)")
    parser.add_argument(
        "--max-loras", type=int, default=1, help="most distinct LoRA adapters in one batch (GPU slots)"
    )
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
    parser.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters cached on the host (default: --max-loras)"
    )
    parser.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="allow releasing device memory between uses (LLM.sleep / wake_up; the server's /sleep and "
        "/wake_up with --enable-debug-endpoints)",
    )
    parser.add_argument(
        "--worker-extension-cls",
        default=None,
        help="module.Class whose methods join every rank's worker (collective_rpc)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="split <think>...</think> into reasoning_content; structured outputs apply after it",
    )


def _json_or_int(text: str) -> dict[str, Any] | int:
    """``--compilation-config``: a JSON object, or an integer (a level, as vLLM once took it)."""
    return int(text) if text.strip().isdigit() else _json_dict(text)


def _json_dict(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def resolve_model_arg(args: argparse.Namespace) -> str:
    model = getattr(args, "model_tag", None) or args.model
    if model is None:
        from pagedllm.demo import default_model

        model = default_model()
    args.model = model
    return model


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        device=args.device,
        load_format=args.load_format,
        trust_remote_code=args.trust_remote_code,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager", False),
        enforce_eager=args.enforce_eager,
        compilation_config=getattr(args, "compilation_config", None),
        optimization_level=getattr(args, "optimization_level", None),
        attention_backend=args.attention_backend,
        scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", 0),
        max_num_partial_prefills=getattr(args, "max_num_partial_prefills", 1),
        max_long_partial_prefills=getattr(args, "max_long_partial_prefills", 1),
        async_scheduling=args.async_scheduling,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        quantization=getattr(args, "quantization", None),
        speculative_config=getattr(args, "speculative_config", None),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        served_model_name=getattr(args, "served_model_name", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        enable_sleep_mode=getattr(args, "enable_sleep_mode", False),
        worker_extension_cls=getattr(args, "worker_extension_cls", None),
        runner=getattr(args, "runner", "auto"),
        pooler_config=getattr(args, "pooler_config", None),
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
        kv_offloading_size=getattr(args, "kv_offloading_size", None),
        kv_offloading_backend=getattr(args, "kv_offloading_backend", None),
        swap_space=getattr(args, "swap_space", None),
        cpu_offload_gb=getattr(args, "cpu_offload_gb", 0),
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        mm_processor_cache_gb=getattr(args, "mm_processor_cache_gb", 4.0),
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return make_engine_config(resolve_model_arg(args), **engine_kwargs_from_args(args))
