#!/usr/bin/env bash
# structured outputs: throughput with every request constrained to a JSON schema against unconstrained
# What constraining every request to a JSON schema costs. `pagedllm bench throughput` on a Qwen3-0.6B-shaped
# dummy-weight model, without and with `--json-schema default`, RUNS (default 2) times each, alternating, after an
# untimed warm-up of both (WARMUP=0 skips it), then once with "maxLength" on the string (MAXLEN=0 skips it).
#   [RUNS=2] [WARMUP=1] [MAXLEN=1] bash benchmarks/gpu.sh structured [demo-tokenizer | profile]
# The shape directory's stand-in tokenizer (the letters a-z) cannot spell JSON, and xgrammar's work per token
# grows with the vocabulary, so the model gets a byte-level BPE tokenizer of Qwen3's size (151,643 tokens) trained
# here on the image's Python sources (about a minute). `demo-tokenizer` uses the bundled demo
# model's 4,096-token tokenizer instead (no training; the bitmask still spans the model's 151,936 ids).
# `profile` prints step profiles and a cProfile of the constrained run instead. The GPU image has no xgrammar:
# carry its wheels (../shared/device/gpu-wheels.sh, carry .whl); they are installed into /tmp/site here.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
use_wheels xgrammar
$py -c "import xgrammar" || { echo "xgrammar is missing: carry its wheels (../shared/device/gpu-wheels.sh)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$py -c "import torch, transformers; from importlib.metadata import version as v; print('torch', torch.__version__, 'transformers', transformers.__version__, 'xgrammar', v('xgrammar'))"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
Q="$out/models/qwen3-0.6b"
tok="$out/models/bpe-151643"
if [ "${1:-}" = demo-tokenizer ]; then  # (or: profile, below)
  tok=pagedllm/demo_model
else
  t0=$(date +%s)
  # ~120 MB of Python source in sorted order, the standard library's then the installed packages' (the same image
  # gives the same tokenizer); the trainer is grammar_fill_bench.py's, which measures the same tokenizer.
  $py -c "import sys; sys.path.insert(0, 'benchmarks'); from grammar_fill_bench import train_tokenizer
train_tokenizer(sys.argv[1], 151643, 120)" "$tok"
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
# Decode-heavy (256 rows decoding together most of the run), where the per-step bitmask work shows most.
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9 --tokenizer $tok"
work="--num-prompts 256 --input-len 256 --output-len 512"
if [ "${1:-}" = profile ]; then  # where a constrained step's time goes: step profiles, then cProfile
  for flag in "" "--json-schema default"; do
    echo "=== --profile-steps $flag"
    timeout 120 $py -m pagedllm.benchmarks.throughput --model $Q $common $work $flag --profile-steps 2>&1 \
      | grep -v "it/s" | tail -14
  done
  timeout 150 $py -m cProfile -s tottime -m pagedllm.benchmarks.throughput --model $Q $common $work \
    --json-schema default 2>&1 | grep -A30 "Ordered by" | cut -c1-150
  exit 0
fi
# An untimed warm-up of both (Triton's JIT for the shapes a full run meets) so that the first run is not a cold one.
if [ "${WARMUP:-1}" = 1 ]; then
  for flag in "" "--json-schema default"; do
    timeout 150 $py -m pagedllm.benchmarks.throughput --model $Q $common --num-prompts 256 --input-len 256 \
      --output-len 64 $flag 2>&1 | grep -E "^Throughput" | sed 's/^/    warm-up: /'
  done
fi
for i in $(seq 1 "${RUNS:-2}"); do
  for so in plain json; do
    flag=""; [ $so = json ] && flag="--json-schema default"
    name="qwen_so_${so}_$i"
    echo "=== $name: bench throughput --model $Q $common $work $flag"
    t0=$(date +%s)
    timeout 240 $py -m pagedllm.benchmarks.throughput --model $Q $common $work $flag --output-json "$out/$name.json" \
      2>&1 | tee "$out/bench_$name.log" | grep -E "^(Throughput|WARNING)|Error|error|Traceback" | head -20
    echo "    ($(( $(date +%s) - t0 )) s)"
  done
done
# The same records with "maxLength": 24 on the string: what that keyword costs in xgrammar (once; MAXLEN=0 skips).
if [ "${MAXLEN:-1}" = 1 ]; then
$py -c "
import json, sys
from pagedllm.benchmarks.throughput import DEFAULT_JSON_SCHEMA as s
s = json.loads(json.dumps(s)); s['items']['properties']['name']['maxLength'] = 24
json.dump(s, open(sys.argv[1], 'w'))" "$out/maxlength.json"
name="qwen_so_maxlength_1"
echo "=== $name: bench throughput --model $Q $common $work --json-schema $out/maxlength.json"
t0=$(date +%s)
timeout 200 $py -m pagedllm.benchmarks.throughput --model $Q $common $work --json-schema "$out/maxlength.json" \
  --output-json "$out/$name.json" 2>&1 | tee "$out/bench_$name.log" | grep -E "^(Throughput|WARNING)|Error|error|Traceback" | head -20
echo "    ($(( $(date +%s) - t0 )) s)"
fi
$py - "$out" <<'EOF'
import json, sys
from pathlib import Path

rows = {}
for path in sorted(Path(sys.argv[1]).glob("qwen_so_*.json")):
    r = json.loads(path.read_text())
    rows.setdefault(r.get("structured_outputs") or "unconstrained", []).append(r["output_tokens_per_s"])
for what, tps in rows.items():
    print(f"{what:>24}: output tok/s " + " / ".join(f"{t:,.0f}" for t in tps))
mean = {what: sum(tps) / len(tps) for what, tps in rows.items()}
if "unconstrained" in mean and "json schema default" in mean:
    print(f"constrained / unconstrained: {mean['json schema default'] / mean['unconstrained']:.3f}")
EOF
