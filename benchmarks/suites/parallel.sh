#!/usr/bin/env bash
# 2 GPUs: tensor, pipeline and data parallelism (Llama-3.1-8B at T=1/T=2/P=2/D=2, Llama-3.3-70B at T=2)
# On the 2-GPU kind (nvidia-h200-x2): the 2-GPU tests, then `pagedllm bench latency` (batch 1, 128 in / 128 out)
# and `bench throughput` (NUM_PROMPTS x (1024 in, 128 out), default 1000) on the Llama-3.1-8B shape at T=1, T=2, P=2
# and D=2, and on the Llama-3.3-70B shape at T=2, with dummy weights in bf16.
#   [CONFIGS="tp1 tp2 pp2 dp2"] [NUM_PROMPTS=1000] bash benchmarks/gpu.sh parallel [tests] [lat8] [tput8] [lat70] [tput70]
# With no arguments it runs everything. CONFIGS picks the 8B configurations (also tp1sync: --no-async-scheduling,
# tp2eager: -tp 2 --enforce-eager).
# Logs go to $OUT (or .out/) as bench_*.log and *.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: keep multicast off
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
$py -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
L8="$out/models/llama-3.1-8b"; L70="$out/models/llama-3.3-70b"
# Every bench runs with INFO logging (start-up phases, KV blocks, graph capture land in the logs).
cat >"$out/logged.py" <<'PYEOF'
import logging, runpy, sys
if __name__ == "__main__":  # not again in spawned workers, which import this file as __mp_main__
    logging.basicConfig(level=logging.INFO)
    mod = sys.argv.pop(1)
    sys.argv[0] = mod
    runpy.run_module(f"pagedllm.benchmarks.{mod}", run_name="__main__")
PYEOF
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
flags() {  # configuration name -> engine flags
  case $1 in tp1) echo "";; tp1sync) echo "--no-async-scheduling";; tp2) echo "-tp 2";; tp2eager) echo "-tp 2 --enforce-eager";;
    pp2) echo "-pp 2";; dp2) echo "-dp 2";; esac
}
if want tests; then
  echo "=== gpu tests (tests/distributed/test_tp_gpu.py)"
  t0=$(date +%s)
  timeout 300 $py -m pytest -q -m gpu tests/distributed/test_tp_gpu.py -p no:cacheprovider -rf -x \
    -o faulthandler_timeout=100 --log-cli-level=INFO >"$out/gpu_tests.log" 2>&1
  tail -15 "$out/gpu_tests.log"
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
lat="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5"
tput="--num-prompts ${NUM_PROMPTS:-1000} --input-len 1024 --output-len 128"
for c in ${CONFIGS:-tp1 tp2 pp2 dp2}; do
  want lat8 && row "l8_lat_$c" 200 $py "$out/logged.py" latency --model $L8 $common $(flags $c) $lat --output-json "$out/l8_lat_$c.json"
done
for c in ${CONFIGS:-tp1 tp2 pp2 dp2}; do
  want tput8 && row "l8_tput_$c" 240 $py "$out/logged.py" throughput --model $L8 $common $(flags $c) $tput --output-json "$out/l8_tput_$c.json"
done
want lat70 && row l70_lat_tp2 300 $py "$out/logged.py" latency --model $L70 $common -tp 2 $lat --output-json "$out/l70_lat_tp2.json"
want tput70 && row l70_tput_tp2 480 $py "$out/logged.py" throughput --model $L70 $common -tp 2 $tput --output-json "$out/l70_tput_tp2.json"
exit 0
