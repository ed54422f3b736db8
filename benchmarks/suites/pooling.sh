#!/usr/bin/env bash
# Pooling models and beam search against their usual baselines on the same GPU
#   bash benchmarks/gpu.sh pooling [embed] [beam]
# embed: 20,000 texts of 32-256 tokens embedded by pagedllm and by sentence-transformers (batch 128 and 256, the
#        better counts), on a bge-base-shaped and a Qwen3-Embedding-0.6B-shaped checkpoint with random weights,
#        bfloat16: benchmarks/embed_bench.py.
# beam:  beam search, width 4, Qwen3-0.6B shape, 32 prompts x (128 in, 128 out), against transformers'
#        generate(num_beams=4) in batches of 8: benchmarks/beam_bench.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
if want embed; then
  for shape in bge-base qwen3-embedding-0.6b; do
    echo "=== embed $shape"
    timeout 400 $py benchmarks/embed_bench.py --shape "$shape" --model-dir "$out/embed-models" \
      > "$out/embed_$shape.log" 2>&1; echo "    exit $?"
    grep -E '^\{|Error|Traceback' "$out/embed_$shape.log" | tail -8
  done
fi
if want beam; then
  echo "=== beam search width 4"
  timeout 400 $py benchmarks/beam_bench.py --model-dir "$out/beam-models" > "$out/beam.log" 2>&1; echo "    exit $?"
  grep -E '^\{|Error|Traceback' "$out/beam.log" | tail -8
fi
