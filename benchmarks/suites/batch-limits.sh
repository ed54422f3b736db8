#!/usr/bin/env bash
# default batch limits (vLLM's: 16384 tokens, 1024 sequences) against 8192 / 256 on the throughput rows
# The headline table's throughput rows under the batch limits the engine takes when the user sets none (vLLM's
# table: 16384 tokens and 1024 sequences offline on an H100) against the earlier fixed 8192 / 256, one device call.
#   OUT=DIR bash benchmarks/gpu.sh batch-limits [qwen] [llama] [nano]
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
Q="$out/models/qwen3-0.6b"; L="$out/models/llama-3.1-8b"
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
old="--max-num-seqs 256 --max-num-batched-tokens 8192"
row() {  # name, throughput args...
  local name=$1; shift
  echo "=== $name: $*"
  $py -m pagedllm.benchmarks.throughput $common "$@" 2>&1 | tee "$out/ab_$name.log" \
    | grep -E "^(Throughput|Step profile|Batch limits)|first met after start-up|preempt|Error|Traceback" | head -12
}
if want qwen; then
  row qwen_new --model $Q --num-prompts 1000 --input-len 1024 --output-len 128 --profile-steps
  row qwen_old --model $Q --num-prompts 1000 --input-len 1024 --output-len 128 $old
fi
if want llama; then
  row llama_new --model $L --num-prompts 1000 --input-len 1024 --output-len 128 --profile-steps
fi
if want nano; then
  row nano_new --model $Q --workload nanovllm --num-prompts 256
fi
if want llama; then
  row llama_old --model $L --num-prompts 1000 --input-len 1024 --output-len 128 $old
fi
