#!/usr/bin/env bash
# A/B of the headline table's throughput and latency rows on one machine: this tree ("new") against another
# checkout ("old", e.g. `git archive HEAD~1 pagedllm | tar -x -C _ab_old`), in one device call, the order rotating
# each round.
#   OLD=_ab_old ROUNDS=2 [VARIANTS="name:VAR=value ..."] OUT=DIR bash benchmarks/gpu.sh ab [qwen-tp] [qwen-nano] [llama-tp]
#     [qwen-lat] [llama-lat]   (more sides: VARIANTS="name:VAR=value ..." and CHECKOUTS="name:dir ...", below)
# Each row's log is $OUT/ab_<row>_<new|old>_<round>.log; the summary lines print as they come.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/lib.sh "$@"
old_dir=$(cd "${OLD:?OLD=dir of the old checkout}" && pwd)
out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
lat="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5"
declare -A spec=(
  [qwen-lat]="latency --model $out/models/qwen3-0.6b $lat"
  [llama-lat]="latency --model $out/models/llama-3.1-8b $lat"
  [qwen-tp]="throughput --model $out/models/qwen3-0.6b --num-prompts 1000 --input-len 1024 --output-len 128"
  [qwen-nano]="throughput --model $out/models/qwen3-0.6b --workload nanovllm --num-prompts 256"
  [llama-tp]="throughput --model $out/models/llama-3.1-8b --num-prompts 1000 --input-len 1024 --output-len 128"
)
# Sides: "new", "old", and each VARIANTS entry "name:VAR=value[,VAR=value...]" (this tree with those environment
# variables, e.g. VARIANTS="nopdl:PAGEDLLM_PDL=0 nokv:PAGEDLLM_ROPE_WRITES_KV=0"). The order rotates by one side
# each round, so no side always runs first (an earlier A/B saw the side that ran first come out lower in every
# round).
sides=(new old)
declare -A side_env=() side_dir=([new]=$PWD [old]=$old_dir)
for v in ${VARIANTS:-}; do sides+=("${v%%:*}"); side_env[${v%%:*}]="${v#*:}"; side_dir[${v%%:*}]=$PWD; done
# More checkouts as sides: CHECKOUTS="name:dir ..." (e.g. HEAD with one file reverted, to bisect a change).
for c in ${CHECKOUTS:-}; do sides+=("${c%%:*}"); side_dir[${c%%:*}]=$(cd "${c#*:}" && pwd); done
for round in $(seq "${ROUNDS:-2}"); do
  shift_by=$(( (round - 1) % ${#sides[@]} ))
  order=("${sides[@]:$shift_by}" "${sides[@]:0:$shift_by}")
  for row in "${ARGS[@]:-qwen-tp}"; do
    for side in "${order[@]}"; do
      dir=${side_dir[$side]}
      envs=(); [ -n "${side_env[$side]:-}" ] && IFS=, read -ra envs <<< "${side_env[$side]}"
      echo "=== $row $side (round $round)"
      (cd "$dir" && env "${envs[@]}" PYTHONPATH="$dir" $py -m pagedllm.benchmarks.${spec[$row]} $common ${EXTRA:-}) 2>&1 \
        | tee "$out/ab_${row}_${side}_${round}.log" | grep -E "^(Throughput|Latency|Avg|Step profile|Batch limits)|Error|Traceback" | head -8
    done
  done
done
