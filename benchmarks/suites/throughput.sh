#!/usr/bin/env bash
# offline throughput: Qwen3-0.6B nano-vllm workload, Qwen3-0.6B and Llama-3.1-8B 1000 x (1024 in, 128 out)
#   [NO_HF=1] bash benchmarks/gpu.sh throughput [qwen-nano] [qwen] [llama]
# The rows' `qwen-nano`, `qwen-throughput` and `llama-throughput` sections (see rows.sh), in that order, with
# transformers' static batch of 128 prompts on the Llama shape; NO_HF=1 skips it.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
sections=()
want qwen-nano && sections+=(qwen-nano)
want qwen && sections+=(qwen-throughput)
want llama && sections+=(llama-throughput)
[ ${#sections[@]} -gt 0 ] || { echo "sections: qwen-nano qwen llama"; exit 2; }
[ "${NO_HF:-0}" = 1 ] || sections+=(hf)
exec bash benchmarks/suites/rows.sh "${sections[@]}"
