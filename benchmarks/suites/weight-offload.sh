#!/usr/bin/env bash
# weight offload: output tokens/s with --cpu-offload-gb 0 / 4 / 8 at batch 1 and BATCH, Llama-3.1-8B shape
# `pagedllm bench latency` on the Llama-3.1-8B shape (pagedllm.benchmarks.shapes) with dummy weights in bf16,
# 128 in / OUTPUT_LEN out, at batch 1 and batch BATCH, for each budget in GIBS (0: every weight on the GPU). The
# offloaded layers (whole decoder layers from the first, 0.41 GiB each in bf16) are copied from pinned host memory
# for every step, so those rows are bound by the host-to-device bandwidth: `copy` measures it and prints each
# budget's floor per step. `latency` ends with the table: tokens/s per row and its ratio to the row without offload.
#   [GIBS="0 4 8"] [BATCH=32] [OUTPUT_LEN=32] bash benchmarks/gpu.sh weight-offload [tests] [copy] [latency]
# `latency` takes about a minute a row at 8 GiB on a PCIe Gen5 host (6 rows); each row's log holds the engine's
# "cpu_offload_gb=...: N decoder layers ... offloaded" line, printed under the row.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
gibs="${GIBS:-0 4 8}"
batch="${BATCH:-32}"
olen="${OUTPUT_LEN:-32}"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
L="$out/models/llama-3.1-8b"
if want tests; then
  echo "=== gpu tests (tests/engine/test_weight_offload.py)"
  t0=$(date +%s)
  timeout 240 $py -m pytest -q -m gpu tests/engine/test_weight_offload.py -p no:cacheprovider -rf 2>&1 \
    | tee "$out/gpu_tests_weight_offload.log" | tail -8
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
if want copy; then
  echo "=== host-to-device copy of one decoder layer (pinned), and each budget's floor per step"
  $py - "$L" $gibs <<'PYEOF'
import sys
import time

import torch

from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import _default_dtype
from pagedllm.models.registry import get_model_class
from pagedllm.worker.weight_offload import plan_offload

mc = ModelConfig(model=sys.argv[1], dtype="bfloat16", load_format="dummy")
with _default_dtype(torch.bfloat16), torch.device("meta"):  # shapes only
    model = get_model_class(mc.hf_config.architectures[0])(mc.hf_config, TorchAttentionBackend())
layer_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers]
n = layer_bytes[0]
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(3):
    dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
reps = 20
start = time.perf_counter()
for _ in range(reps):
    dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
per_copy = (time.perf_counter() - start) / reps
print(f"one layer ({n / 2**30:.3f} GiB): {per_copy * 1e3:.2f} ms, {n / per_copy / 1e9:.1f} GB/s")
for gib in sys.argv[2:]:
    chosen = plan_offload(layer_bytes, int(float(gib) * 2**30))
    print(f"cpu_offload_gb {gib}: {len(chosen)} layers, {sum(layer_bytes[i] for i in chosen) / 2**30:.2f} GiB "
          f"-> floor {len(chosen) * per_copy * 1e3:.1f} ms of copies per step")
PYEOF
fi
if want latency; then
  # INFO logging so that the engine's offload summary reaches the row's log
  logged="import logging, runpy, sys; logging.basicConfig(level=logging.INFO); sys.argv[0] = 'latency'; runpy.run_module('pagedllm.benchmarks.latency', run_name='__main__')"
  common="--model $L --load-format dummy --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.9"
  work="--input-len 128 --output-len $olen --num-iters-warmup 1 --num-iters 3"
  for bs in 1 "$batch"; do
    for gib in $gibs; do
      name="offload_${gib}gb_bs${bs}"
      row "$name" 300 $py -c "$logged" $common $work --batch-size "$bs" --cpu-offload-gb "$gib" \
        --output-json "$out/$name.json"
      grep -m1 -o "cpu_offload_gb=.*offloaded.*" "$out/bench_$name.log" | sed 's/^/    /'
    done
  done
  echo "=== output tokens/s (Llama-3.1-8B shape, bf16, 128 in / $olen out)"
  $py - "$out" "$batch" $gibs <<'PYEOF'
import json
import sys
from pathlib import Path

out, batch, gibs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
print(f"{'cpu_offload_gb':>14} {'batch':>6} {'tokens/s':>10} {'vs all-in-GPU':>14}")
for bs in dict.fromkeys(["1", batch]):
    base = None
    for gib in gibs:
        path = out / f"offload_{gib}gb_bs{bs}.json"
        if not path.exists():
            print(f"{gib:>14} {bs:>6} {'(failed)':>10}")
            continue
        tok_s = json.loads(path.read_text())["output_tokens_per_s"]
        if float(gib) == 0:
            base = tok_s
        ratio = f"{tok_s / base:.2f}x" if base else "-"
        print(f"{gib:>14} {bs:>6} {tok_s:>10.1f} {ratio:>14}")
PYEOF
fi
