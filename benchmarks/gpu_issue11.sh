#!/usr/bin/env bash
# Issue 11's device call: speculative decoding on the GPU. The gpu tests of tests/spec_decode, then
# `pagedllm bench latency` on the Llama-3.1-8B shape (dummy weights) at batch 1 and 16, 128 in / 128 out:
# no speculation; a draft model equal to the target (the same dummy weights: every draft is accepted, the best
# case, and the verification's overhead); n-gram drafts on random prompts (few accepted: the cost of trying).
#   bash benchmarks/gpu_issue11.sh [tests] [latency]      (no argument: both)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
out="${OUT:-.out}"; mkdir -p "$out"
py=python3
want() { [ $# -eq 0 ] && return 0; [ ${#ARGS[@]} -eq 0 ] && return 0; for a in "${ARGS[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
ARGS=("$@")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if want tests; then
  timeout 200 $py -m pytest -q -m gpu tests/spec_decode -p no:cacheprovider 2>&1 | tail -5
fi
if want latency; then
  $py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
  L="$out/models/llama-3.1-8b"
  common="--model $L --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters ${ITERS:-3}"
  for bs in ${BATCHES:-1 16}; do
    for name in plain draft_self ngram; do
      case $name in
        plain) spec=() ;;
        draft_self) spec=(--speculative-config "{\"model\": \"$L\", \"num_speculative_tokens\": 4}") ;;
        ngram) spec=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}') ;;
      esac
      echo "=== llama8b b$bs $name"
      t0=$(date +%s)
      timeout 150 $py -m pagedllm.benchmarks.latency $common --batch-size "$bs" "${spec[@]}" \
        --output-json "$out/lat_b${bs}_$name.json" 2>&1 | grep -E "^(Latency|SpecDecoding)|Error|Traceback" | head -5
      echo "    ($(( $(date +%s) - t0 )) s)"
    done
  done
fi
