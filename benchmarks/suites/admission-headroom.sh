#!/usr/bin/env bash
# admission headroom (128 / 64 tokens) against vLLM's admit-while-blocks-last, 1000 x 1024 throughput rows
# Admission headroom (SchedulerConfig.admission_headroom_tokens, default 128) against vLLM's rule (0: admit while
# blocks last) on the headline table's 1000 x (1024, 128) throughput rows, with the default batch limits, one
# device call.
#   OUT=DIR bash benchmarks/gpu.sh admission-headroom [qwen] [llama]
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
Q="$out/models/qwen3-0.6b"; L="$out/models/llama-3.1-8b"
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9 --num-prompts 1000 --input-len 1024 --output-len 128"
row() {  # name, headroom, throughput args...
  local name=$1 headroom=$2; shift 2
  echo "=== $name (PAGEDLLM_ADMISSION_HEADROOM=$headroom): $*"
  PAGEDLLM_ADMISSION_HEADROOM=$headroom $py -m pagedllm.benchmarks.throughput $common "$@" 2>&1 \
    | tee "$out/hr_$name.log" | grep -E "^(Throughput|Step profile|Batch limits)|Error|Traceback" | head -12
}
if want qwen; then
  row qwen_128 128 --model $Q --profile-steps
  row qwen_0 0 --model $Q
  row qwen_64 64 --model $Q
fi
if want llama; then
  row llama_128 128 --model $L --profile-steps
  row llama_0 0 --model $L
fi
