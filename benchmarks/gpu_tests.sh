#!/usr/bin/env bash
# The whole GPU test suite (`pytest -m gpu tests/`) in one device call: five pytest processes share the GPU (the
# tests' models are tiny; most of the time is Triton compiling, which the machine's CPU cores do side by side).
# Each group's log goes to $OUT (or .out/) as gpu_tests_<group>.log; the script exits non-zero if any group fails.
#   bash benchmarks/gpu_tests.sh [GROUP...]     (or bash benchmarks/gpu.sh tests [GROUP...])
# GROUP: attention_kernel, kernels, small_kernels, engine, models; default all.
# The structured-output tests need xgrammar and jsonschema and the server tests fastapi and openai: carry their
# wheels (../shared/device/gpu-wheels.sh jsonschema referencing rpds-py jsonschema-specifications attrs).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/lib.sh "$@"
use_wheels "xgrammar, jsonschema"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
k=tests/kernels
groups=(
  "attention_kernel:$k/test_triton_paged_attention.py"
  "kernels:$k/test_triton_fused_moe.py $k/test_triton_gemv.py $k/test_pdl.py $k/test_mla_decode.py $k/test_triton_gumbel_sample.py $k/test_token_bitmask.py"
  "small_kernels:$k/test_triton_qk_norm_rope.py $k/test_triton_small_kernels.py tests/attention tests/quantization"
  "engine:tests/engine tests/pooling tests/kv_transfer tests/structured_output tests/sample tests/benchmarks tests/core tests/entrypoints tests/tools tests/test_demo_model.py"
  "models:tests/lora tests/models tests/spec_decode tests/distributed"
)
# Tests that size themselves from the GPU's free memory or allocate several GiB: run alone after the groups, since
# the other groups' engines hold most of the card meanwhile (each failed side by side with them, and passed alone).
alone=(  # group:test
  "kernels:tests/kernels/test_triton_gumbel_sample.py::test_gumbel_batch_past_int32_elements_gpu"
  "engine:tests/engine/test_gpu_engine.py::test_gpu_memory_utilization_sizes_cache_from_profile"
  "engine:tests/engine/test_llm_shutdown.py::test_gpu_memory_returns_after_shutdown"
  "engine:tests/structured_output/test_structured_output.py::test_gpu_constrained_tokens_match_between_sync_and_async_with_cuda_graphs"
)
deselect=(); for t in "${alone[@]}"; do deselect+=(--deselect "${t#*:}"); done
selected=()
for g in "${groups[@]}"; do want "${g%%:*}" && selected+=("$g"); done
groups=("${selected[@]}")
pids=()
for g in "${groups[@]}"; do
  name=${g%%:*}; paths=${g#*:}
  $py -m pytest -q -m gpu -p no:cacheprovider "${deselect[@]}" $paths > "$out/gpu_tests_$name.log" 2>&1 &
  pids+=($!)
done
rc=0; i=0
for g in "${groups[@]}"; do
  wait "${pids[$i]}" || rc=1
  echo "=== ${g%%:*}: $(tail -1 "$out/gpu_tests_${g%%:*}.log")"
  i=$((i + 1))
done
mine=(); for t in "${alone[@]}"; do want "${t%%:*}" && mine+=("${t#*:}"); done
if [ ${#mine[@]} -gt 0 ]; then
  $py -m pytest -q -m gpu -p no:cacheprovider "${mine[@]}" > "$out/gpu_tests_alone.log" 2>&1 || rc=1
  echo "=== alone: $(tail -1 "$out/gpu_tests_alone.log")"
fi
for g in "${groups[@]}" alone; do grep -sE "^(FAILED|ERROR)" "$out/gpu_tests_${g%%:*}.log"; done
exit $rc
