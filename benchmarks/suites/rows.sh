#!/usr/bin/env bash
# the headline rows one by one, transformers baselines in the same run (latency/throughput/startup/serve)
#   bash benchmarks/gpu.sh rows [tests] [qwen-latency] [qwen-throughput] [qwen-nano] [llama-latency] [llama-throughput] [hf] [startup] [serve]
# With no arguments it runs everything (tests: the whole `pytest -m gpu tests/ -x`; hf: the transformers baseline
# of each latency / Llama throughput row picked). Dummy weights, Qwen3-0.6B and Llama-3.1-8B shapes. Logs go to
# $OUT (or .out/) as bench_*.log and *.json; each row lists the Triton kernels compiled while it ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
Q="$out/models/qwen3-0.6b"; L="$out/models/llama-3.1-8b"
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
tcache="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$(date +%s)
  touch "$out/.mark"
  "$@" 2>&1 | tee "$out/bench_$name.log" | grep -E "^(Throughput|Latency)|Error|error|Traceback" | head -20
  # Kernels Triton compiled during the row (start-up and the timed run: a cold cache's cost).
  # Each as name@seconds after the row began.
  local new=$(find "$tcache" -name '*.json' ! -name '__grp__*' -newer "$out/.mark" -printf '%T@ %f\n' 2>/dev/null | sort -n | awk -v t0="$t0" '{sub(/\.json$/, "", $2); printf " %s@%d", $2, $1 - t0}')
  echo "    ($(( $(date +%s) - t0 )) s; Triton compiles:${new:- none})"
}
if want tests; then
  echo "=== gpu tests"
  $py -m pytest -q -m gpu tests/ -x -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
fi
if want qwen-latency; then
  run qwen_lat $py -m pagedllm.benchmarks.latency --model $Q $common --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5 --output-json "$out/qwen_lat.json"
  want hf && run qwen_lat_hf $py -m pagedllm.benchmarks.latency --backend hf --model $Q $common --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 2
fi
if want qwen-nano; then
  run qwen_nano $py -m pagedllm.benchmarks.throughput --model $Q $common --workload nanovllm --num-prompts 256 --output-json "$out/qwen_nano.json"
fi
if want qwen-throughput; then
  run qwen_tp $py -m pagedllm.benchmarks.throughput --model $Q $common --num-prompts 1000 --input-len 1024 --output-len 128 --output-json "$out/qwen_tp.json"
fi
if want llama-latency; then
  run llama_lat $py -m pagedllm.benchmarks.latency --model $L $common --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5 --output-json "$out/llama_lat.json"
  want hf && run llama_lat_hf $py -m pagedllm.benchmarks.latency --backend hf --model $L $common --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 2
fi
if want llama-throughput; then
  run llama_tp $py -m pagedllm.benchmarks.throughput --model $L $common --num-prompts 1000 --input-len 1024 --output-len 128 --output-json "$out/llama_tp.json"
  want hf && run llama_tp_hf $py -m pagedllm.benchmarks.throughput --backend hf --model $L $common --num-prompts 128 --input-len 1024 --output-len 128 --hf-max-batch-size 128
fi
if want startup; then
  # Needs the server's wheels on the GPU image (../shared/device/gpu-wheels.sh; carry .whl).
  run llama_startup $py -m pagedllm.entrypoints.cli bench startup --model $L --serve-args "$common" --num-runs 2 --output-json "$out/llama_startup.json"
  cut -c1-160 "$out/bench_llama_startup.log"
fi
if want serve; then
  port=8765
  $py -m pagedllm.entrypoints.cli serve $Q $common --port $port --disable-log-requests > "$out/qwen_server.log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do curl -sf localhost:$port/health >/dev/null && break; kill -0 $spid 2>/dev/null || break; sleep 0.5; done
  run qwen_serve $py -m pagedllm.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --model $Q --tokenizer $Q --num-prompts 500 --random-input-len 512 --random-output-len 128 --ignore-eos --request-rate inf --metric-percentiles 50,99 --save-result "$out/qwen_serve.json"
  grep -A40 "Serving Benchmark Result" "$out/bench_qwen_serve.log" | head -40
  kill $spid; wait $spid
fi
