#!/usr/bin/env bash
# batch-1 latency, 128 in / 128 out: Qwen3-0.6B and Llama-3.1-8B shapes, with the transformers baseline
#   [NO_HF=1] bash benchmarks/gpu.sh latency [qwen] [llama]
# The rows' `qwen-latency` and `llama-latency` sections (see rows.sh); NO_HF=1 skips the transformers runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
sections=()
want qwen && sections+=(qwen-latency)
want llama && sections+=(llama-latency)
[ ${#sections[@]} -gt 0 ] || { echo "sections: qwen llama"; exit 2; }
[ "${NO_HF:-0}" = 1 ] || sections+=(hf)
exec bash benchmarks/suites/rows.sh "${sections[@]}"
