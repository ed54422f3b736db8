#!/usr/bin/env bash
# KV cache beyond GPU memory: a prefix-heavy workload 4x the GPU KV cache, with and without the CPU tier
#   [PREFIXES=48] [REPEATS=4] bash benchmarks/gpu.sh kv-offload
# Llama-3.1-8B shape (dummy weights). The server's GPU KV cache is pinned to 3072 blocks of 16 tokens (49,152
# tokens, 6 GiB); the workload is vLLM's prefix_repetition dataset: PREFIXES prefixes of 4,000 tokens (192,000
# tokens of prefixes: 3.9x the GPU cache), each asked REPEATS times with its own 100-token suffix and 64 output
# tokens, shuffled, request rate inf. Without the CPU tier a repeat finds its prefix evicted and recomputes it; with
# --kv-offloading-size 40 the prefix loads back from pinned host memory. Prints req/s, output tok/s and TTFT of each.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
use_wheels "fastapi, uvicorn"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
L="$out/models/llama-3.1-8b"
PREFIXES="${PREFIXES:-48}"; REPEATS="${REPEATS:-4}"
port=8766
for variant in gpu-only cpu-tier; do
  extra=""; [ "$variant" = cpu-tier ] && extra="--kv-offloading-size 40"
  echo "=== $variant"
  $py -m pagedllm.entrypoints.cli serve "$L" --load-format dummy --max-model-len 8192 --num-gpu-blocks-override 3072 \
    --port $port --disable-log-requests $extra > "$out/offload_${variant}_server.log" 2>&1 &
  spid=$!; t0=$(date +%s); up=0
  for _ in $(seq 600); do
    curl -sf localhost:$port/health >/dev/null && { up=1; break; }
    kill -0 $spid 2>/dev/null || break
    sleep 0.5
  done
  if [ $up = 1 ]; then
    echo "    up in $(( $(date +%s) - t0 )) s"
    $py -m pagedllm.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --model "$L" --tokenizer "$L" \
      --disable-tqdm --dataset-name prefix_repetition --prefix-repetition-prefix-len 4000 \
      --prefix-repetition-suffix-len 100 --prefix-repetition-num-prefixes "$PREFIXES" \
      --prefix-repetition-output-len 64 --num-prompts $((PREFIXES * REPEATS)) --ignore-eos --request-rate inf \
      --metric-percentiles 50,99 --save-result "$out/offload_$variant.json" > "$out/offload_$variant.log" 2>&1
    grep -E "throughput \(req/s\)|Output token throughput|(P50|P99|Mean) TTFT|Benchmark duration" \
      "$out/offload_$variant.log" | sed 's/  */ /g' | paste -sd';'
    curl -s localhost:$port/metrics | grep -E "^pagedllm:(prefix_cache|kv_connector|external_prefix)[a-z_]*(hits|queries)[a-z_]* " | head -8
  else
    echo "    server did not come up:"; tail -20 "$out/offload_${variant}_server.log"
  fi
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
done
