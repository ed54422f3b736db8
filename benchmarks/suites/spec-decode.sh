#!/usr/bin/env bash
# speculative decoding: n-gram, draft model and EAGLE against plain decoding, speed and acceptance length
#   tests    the gpu tests of tests/spec_decode
#   demo     `pagedllm bench latency` on the bundled demo target (real code prompts: 128-token windows of the
#            stdlib's held-out files, 128 out, greedy) at batch 1, 8 and 32: no speculation, n-gram, the small demo
#            model as draft, the demo EAGLE head, the demo Medusa heads; each speculative method synchronously and
#            with --async-scheduling (MODES: sync, async, and async-wait, async with PAGEDLLM_SPEC_AHEAD=0: every
#            verification waits for the step in flight instead of launching ahead of the host); prints each run's mean acceptance length and which CUDA graphs
#            the target and the head replay; PROFILE=1 adds one profiled iteration a run (--profile-steps: host ms
#            per engine phase, the proposer's included, and the GPU's busy fraction)
#   latency  the Llama-3.1-8B shape (dummy weights) at batch 1 and 16, 128 in / 128 out: no speculation and a
#            draft equal to the target (the same dummy weights: the best case, and the verification's overhead)
#   cost     benchmarks/spec_cost.py on the Llama-3.1-8B shape (dummy weights) at batch 1 and 8, k = 3, one run per
#            batch size: a plain decode step, a verification step of k + 1 tokens a request and an EAGLE proposal
#            (a head of the 8B shape), medians of GPU time; prints their ratios and the speedup they imply at mean
#            acceptance lengths 3.0 and 3.6 (MAL * t_plain / (t_verify + t_propose)), and which CUDA graphs ran;
#            --max-num-seqs 16: graphs captured up to batch 16 only (a shorter start-up: each run starts two engines)
#   [ITERS=N] [PROFILE=1] [BATCHES="1 8 32"] [METHODS="plain ngram draft eagle medusa"] [MODES="sync async async-wait"] [LLAMA_BATCHES="1 16"] \
#     [COST_BATCHES="1 8"] \
#     bash benchmarks/gpu.sh spec-decode [tests] [demo] [latency] [cost]      (no argument: all)
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$out/lat"
trap 'tar -C "$out" -cf "$out/lat.tar" lat && rm -rf "$out/lat"' EXIT  # one file back, not one per run
bench() {  # name, then bench latency arguments
  local name=$1; shift
  echo "=== $name"
  local t0=$(date +%s)
  timeout 150 $py -m pagedllm.benchmarks.latency "$@" --output-json "$out/lat/$name.json" 2>&1 \
    | grep -E "^(Latency|SpecDecoding|Scheduling|speculative decoding|Step profile)|Error|Traceback" | cut -c1-400 | head -7
  echo "    ($(( $(date +%s) - t0 )) s)"
}
if want tests; then
  timeout 240 $py -m pytest -q -m gpu tests/spec_decode tests/engine/test_gpu_engine.py -p no:cacheprovider \
    -k "spec or graphs or async" 2>&1 | tail -8
fi
if want demo; then
  std=$($py -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  # The held-out files of the demo model's training (pagedllm/demo_model/train_log.json: from xmlrpc/server.py on).
  held=("$std/xmlrpc/server.py" "$std/zipapp.py" "$std/zipfile" "$std/zipimport.py" "$std/zoneinfo")
  common=(--max-model-len 1024 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters ${ITERS:-5}
          --prompts-from "${held[@]}" ${PROFILE:+--profile-steps})
  for bs in ${BATCHES:-1 8 32}; do
    for name in ${METHODS:-plain ngram draft eagle medusa}; do
      case $name in
        plain) spec=() ;;
        ngram) spec=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}') ;;
        draft) spec=(--speculative-config '{"model": "pagedllm/demo_model/draft", "num_speculative_tokens": 4}') ;;
        eagle) spec=(--speculative-config '{"method": "eagle", "model": "pagedllm/demo_model/eagle", "num_speculative_tokens": 3}') ;;
        medusa) spec=(--speculative-config '{"method": "medusa", "model": "pagedllm/demo_model/medusa", "num_speculative_tokens": 3}') ;;
      esac
      for mode in ${MODES:-sync async}; do
        # plain decoding is asynchronous on CUDA by default: one row; speculation is synchronous unless asked
        [ "$name" = plain ] && [ "$mode" != sync ] && continue
        extra=(); [ "$mode" != sync ] && extra=(--async-scheduling)
        # async-wait: every verification launch waits for the step in flight (no launch ahead of the host)
        PAGEDLLM_SPEC_AHEAD=$([ "$mode" = async-wait ] && echo 0 || echo 1) \
          bench "demo_b${bs}_${name}_$mode" "${common[@]}" --batch-size "$bs" --max-num-seqs "$bs" "${spec[@]}" "${extra[@]}"
      done
    done
  done
fi
if want latency; then
  $py -m pagedllm.benchmarks.shapes /tmp/models >/dev/null  # (not under $out: only 8 files come back)
  L="/tmp/models/llama-3.1-8b"
  common=(--model "$L" --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9 --input-len 128
          --output-len 128 --num-iters-warmup 1 --num-iters ${ITERS:-3})
  for bs in ${LLAMA_BATCHES:-1 16}; do
    bench "llama8b_b${bs}_plain" "${common[@]}" --batch-size "$bs"
    bench "llama8b_b${bs}_draft_self" "${common[@]}" --batch-size "$bs" \
      --speculative-config "{\"model\": \"$L\", \"num_speculative_tokens\": 4}"
  done
fi
if want cost; then
  $py -m pagedllm.benchmarks.shapes /tmp/models >/dev/null
  for bs in ${COST_BATCHES:-1 8}; do
    echo "=== cost_b$bs"
    t0=$(date +%s)
    timeout 150 $py benchmarks/spec_cost.py --model /tmp/models/llama-3.1-8b --load-format dummy --batch-sizes "$bs" \
      --num-speculative-tokens 3 --mal 3.0 3.6 --max-num-seqs 16 --work-dir /tmp/spec_cost 2>&1 \
      | tee "$out/lat/cost_b$bs.log" | grep -E '^(\{"spec_cost"|Spec cost)|Error|Traceback' | head -5
    echo "    ($(( $(date +%s) - t0 )) s)"
  done
fi
