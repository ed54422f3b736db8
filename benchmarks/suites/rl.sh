#!/usr/bin/env bash
# Rollout-engine hooks: sleep mode's times and memory, and a trainer's weight broadcast (two GPUs)
#   bash benchmarks/gpu.sh rl [sleep] [broadcast]
# sleep:     Llama-3.1-8B shape, dummy weights: sleep(level=1|2) and wake_up() seconds, device memory held while
#            asleep beyond this process's CUDA context, greedy outputs equal after level 1: benchmarks/sleep_bench.py.
# broadcast: Llama-3.1-8B shape, a trainer on cuda:1 broadcasts every tensor over NCCL to the engine on cuda:0
#            (init_weight_update_group / update_weight): GB/s, benchmarks/weight_broadcast_bench.py. Needs 2 GPUs.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
if want sleep; then
  echo "=== sleep mode, Llama-3.1-8B shape"
  timeout 300 $py benchmarks/sleep_bench.py > "$out/sleep.log" 2>&1; echo "    exit $?"
  grep -E '^\{|Error|Traceback' "$out/sleep.log" | tail -8
fi
if want broadcast; then
  echo "=== weight broadcast, Llama-3.1-8B shape"
  timeout 300 $py benchmarks/weight_broadcast_bench.py > "$out/broadcast.log" 2>&1; echo "    exit $?"
  grep -E '^\{|Error|Traceback' "$out/broadcast.log" | tail -8
fi
