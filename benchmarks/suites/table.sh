#!/usr/bin/env bash
# the whole headline table: latency, throughput, start-up and serve rows, transformers baselines, a summary
#   [NO_HF=1] bash benchmarks/gpu.sh table [profile]
# Every row of rows.sh but its tests, then (profile) step profiles of the three throughput rows, then what the API
# process's imports cost. Run it twice on one machine for two measurements; NO_HF=1 skips the transformers
# rows (a second run). The last lines are a summary of every row, so that the figures survive a device call's output
# tail (the serve row alone prints ~40 lines).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
# The start-up and serve rows need the server's wheels (../shared/device/gpu-wheels.sh; carry .whl).
use_wheels "fastapi, uvicorn"
hf=hf; [ "${NO_HF:-0}" = 1 ] && hf=
bash benchmarks/suites/rows.sh qwen-latency qwen-nano qwen-throughput llama-latency llama-throughput $hf startup serve
if [ "${1:-}" = profile ]; then
  $py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
  common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
  for spec in "qwen3-0.6b --workload nanovllm --num-prompts 256" "qwen3-0.6b --num-prompts 1000 --input-len 1024 --output-len 128" "llama-3.1-8b --num-prompts 1000 --input-len 1024 --output-len 128"; do
    set -- $spec; m=$1; shift
    echo "=== profile $m $*"
    $py -m pagedllm.benchmarks.throughput --model "$out/models/$m" $common "$@" --profile-steps 2>&1 | grep -E "^(Throughput|Step profile)"
  done
fi
# What the API process's imports cost on this host (the start-up row's largest part): the 12 slowest, cumulative µs.
$py -X importtime -c "import pagedllm.entrypoints.openai.api_server" 2> "$out/importtime.txt"
echo "=== imports of the API process (cumulative µs)"; sort -t'|' -k2 -n "$out/importtime.txt" | tail -12
echo "=== summary"
for f in "$out"/bench_*.log; do
  line=$(grep -hE "^(Throughput|Latency) \(" "$f" | head -1 | cut -c1-170)
  [ -n "$line" ] && echo "$(basename "$f" .log): $line"
done
grep -hs "^Start-up:" "$out/bench_llama_startup.log"
grep -hsE "^(Request throughput|Output token throughput|Median TTFT|P99 TTFT|Mean TPOT|Median TPOT|P99 TPOT)" \
  "$out/bench_qwen_serve.log"
