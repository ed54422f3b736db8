#!/usr/bin/env bash
# bf16, FP8 W8A8 and GPTQ 4-bit weights, and the FP8 KV cache: Llama-3.1-8B shape
# The GPU paths of quantized models. The gpu tests of tests/quantization, the weights' bytes
# (for the bandwidth floor), then `pagedllm bench latency` (batch 1, 128 in / 128 out) and `bench throughput` on the
# Llama-3.1-8B shape with dummy weights in bf16, `--quantization fp8` (online, W8A8) and GPTQ 4-bit (group 128, a copy
# of the shape dir with a GPTQ quantization_config; dummy weights are random packed bits with fixed scales).
#   [NUM_PROMPTS=200] bash benchmarks/gpu.sh quantization [tests] [bytes] [latency] [kv] [ab] [throughput]
# With no arguments it runs everything (about 7 minutes on an H100). `ab` repeats the GPTQ latency run with split-K
# off (PAGEDLLM_W4A16_SPLIT_K=1) against the default (split-K for M <= 64 when the N tiles are too few).
# Throughput uses NUM_PROMPTS prompts (default 200, not 1000, to fit one device call; 1024 in / 128 out each).
# Logs go to $OUT (or .out/) as bench_*.log and *.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'capability', torch.cuda.get_device_capability())"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
L="$out/models/llama-3.1-8b"; G="$out/models/llama-3.1-8b-gptq"
rm -rf "$G"; cp -r "$L" "$G"
$py - "$G/config.json" <<'PYEOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
json.dump(config, open(sys.argv[1], "w"), indent=2)
PYEOF
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
if want tests; then
  echo "=== gpu tests (tests/quantization)"
  t0=$(date +%s)
  timeout 240 $py -m pytest -q -m gpu tests/quantization -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests.log" | tail -25
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
if want bytes; then
  echo "=== weights' bytes (bandwidth floor = bytes read per decode step / 3.35 TB/s)"
  $py - "$L" "$L:fp8" "$G" <<'PYEOF'
import sys
import torch
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.linear import Linear, deferred_linear_weights
from pagedllm.model_loader import _default_dtype
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import quantize_model

for spec in sys.argv[1:]:  # built on the meta device: shapes and dtypes only
    path, _, quant = spec.partition(":")
    mc = ModelConfig(model=path, dtype="bfloat16", quantization=quant or None, load_format="dummy")
    cls = get_model_class(mc.hf_config.architectures[0])
    with _default_dtype(torch.bfloat16), torch.device("meta"):
        if mc.quant_config is None:
            model = cls(mc.hf_config, TorchAttentionBackend())
        else:
            with deferred_linear_weights():
                model = cls(mc.hf_config, TorchAttentionBackend())
            quantize_model(model, mc.quant_config)
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    linear = nbytes(p for m in model.modules() if isinstance(m, Linear) for p in m.parameters(recurse=False))
    head = nbytes(p for n, p in model.named_parameters() if "lm_head" in n)
    total = nbytes(model.parameters())
    read = linear + head
    name = mc.quant_config.name if mc.quant_config else "bf16"
    print(f"{name:>5}: linear weights {linear / 1e9:.3f} GB, lm_head {head / 1e9:.3f} GB, all {total / 1e9:.3f} GB; "
          f"read per decode step {read / 1e9:.3f} GB -> floor {read / 3.35e12 * 1e3:.2f} ms/token at 3.35 TB/s")
PYEOF
fi
lat="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5"
if want latency; then
  row llama_lat_bf16 150 $py -m pagedllm.benchmarks.latency --model $L $common $lat --output-json "$out/llama_lat_bf16.json"
  row llama_lat_fp8 150 $py -m pagedllm.benchmarks.latency --model $L $common --quantization fp8 $lat --output-json "$out/llama_lat_fp8.json"
  row llama_lat_gptq 150 $py -m pagedllm.benchmarks.latency --model $G $common $lat --output-json "$out/llama_lat_gptq.json"
fi
if want kv; then  # the FP8 KV cache: latency with it, and the KV capacity (max concurrency) against the bf16 cache
  # (run with INFO logging so the engine's "KV cache (...): N blocks ...; maximum concurrency ..." line shows)
  logged="import logging, runpy, sys; logging.basicConfig(level=logging.INFO); sys.argv[0] = 'latency'; runpy.run_module('pagedllm.benchmarks.latency', run_name='__main__')"
  row llama_lat_kvbf16 150 $py -c "$logged" --model $L $common $lat --output-json "$out/llama_lat_kvbf16.json"
  row llama_lat_kvfp8 150 $py -c "$logged" --model $L $common --kv-cache-dtype fp8 $lat --output-json "$out/llama_lat_kvfp8.json"
  for f in "$out/bench_llama_lat_kvbf16.log" "$out/bench_llama_lat_kvfp8.log"; do
    echo "    $(basename "$f"): $(grep -m1 -o "KV cache (.*" "$f")"
  done
fi
if want ab; then
  PAGEDLLM_W4A16_SPLIT_K=1 row llama_lat_gptq_nosplit 150 $py -m pagedllm.benchmarks.latency --model $G $common $lat --output-json "$out/llama_lat_gptq_nosplit.json"
fi
tp="--num-prompts ${NUM_PROMPTS:-200} --input-len 1024 --output-len 128"
if want throughput; then
  row llama_tp_bf16 200 $py -m pagedllm.benchmarks.throughput --model $L $common $tp --output-json "$out/llama_tp_bf16.json"
  row llama_tp_fp8 200 $py -m pagedllm.benchmarks.throughput --model $L $common --quantization fp8 $tp --output-json "$out/llama_tp_fp8.json"
  row llama_tp_gptq 200 $py -m pagedllm.benchmarks.throughput --model $G $common $tp --output-json "$out/llama_tp_gptq.json"
fi
