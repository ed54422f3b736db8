#!/usr/bin/env bash
# multi-LoRA: throughput with no LoRA, 1 and 8 rank-16 adapters, Llama-3.1-8B shape
# Multi-LoRA on the GPU. The gpu tests of tests/lora (Triton shrink/expand against their
# twins, the engine with CUDA graphs), then `pagedllm bench throughput` on the Llama-3.1-8B shape with dummy
# weights, 1000 x (1024 in, 128 out): no LoRA, then --enable-lora --max-loras 8 with 1 and with 8 rank-16 adapters
# (q/k/v/o/gate/up/down, random weights from pagedllm.benchmarks.lora_adapters) spread over the requests at random.
#   [NUM_PROMPTS=1000] bash benchmarks/gpu.sh lora [tests] [throughput]
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
L="$out/models/llama-3.1-8b"
if want tests; then
  echo "=== gpu tests (tests/lora)"
  t0=$(date +%s)
  timeout 240 $py -m pytest -q -m gpu tests/lora -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests_lora.log" | tail -8
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
if want throughput; then
  $py -m pagedllm.benchmarks.lora_adapters "$L" "$out/lora-r16" --rank 16 >/dev/null
  common="--model $L --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
  work="--num-prompts ${NUM_PROMPTS:-1000} --input-len 1024 --output-len 128"
  lora="--enable-lora --max-loras 8 --max-lora-rank 16 --lora-path $out/lora-r16"
  for what in none 1 8; do
    flags=""; [ $what != none ] && flags="$lora --num-loras $what"
    echo "=== llama_lora_$what: bench throughput $common $work $flags"
    t0=$(date +%s)
    timeout 240 $py -m pagedllm.benchmarks.throughput $common $work $flags --output-json "$out/llama_lora_$what.json" \
      2>&1 | tee "$out/bench_llama_lora_$what.log" | grep -E "^(Throughput|WARNING)|Error|error|Traceback" | head -20
    echo "    ($(( $(date +%s) - t0 )) s)"
  done
fi
