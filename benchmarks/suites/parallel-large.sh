#!/usr/bin/env bash
# 4-8 GPUs: Llama-3.3-70B at T=4/T=8, Qwen3-235B-A22B at T=8 with and without expert parallelism, D=4
# On a 4- or 8-GPU kind (nvidia-h200-x4/x8 or nvidia-h100-x4/x8): dummy weights in bf16.
#   [TPS="4 8"] [NUM_PROMPTS=1000] bash benchmarks/gpu.sh parallel-large [bytes] [lat70] [tput70] [qwen235] [dp4]
#   lat70 / tput70: Llama-3.3-70B shape at each of TPS (default "4 8", capped at the GPUs present), `bench latency`
#                   (batch 1, 128 in / 128 out) and `bench throughput` (NUM_PROMPTS x (1024 in, 128 out), default 1000)
#   qwen235:        Qwen3-235B-A22B shape at T=8, with and without --enable-expert-parallel, the same two rows
#   dp4:            Llama-3.1-8B shape throughput at D=4 x T=1 against one engine (D=1)
#   bytes:          the weight bytes each GPU reads per decode step (the bandwidth floor's numerator)
# With no arguments it runs everything the GPUs allow. Logs go to $OUT (or .out/) as bench_*.log and *.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: keep multicast off
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
echo "gpus: $gpus"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
M="$out/models"
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
lat="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5"
tput="--num-prompts ${NUM_PROMPTS:-1000} --input-len 1024 --output-len 128"
if want bytes; then
  $py - "$M" <<'PYEOF'
import sys
import torch
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.model_loader import _default_dtype
from pagedllm.models.registry import get_model_class

for name, tps in (("llama-3.3-70b", (4, 8)), ("qwen3-235b-a22b", (8,))):
    mc = ModelConfig(model=f"{sys.argv[1]}/{name}", dtype="bfloat16", load_format="dummy")
    cfg = mc.hf_config
    with _default_dtype(torch.bfloat16), torch.device("meta"):
        model = get_model_class(cfg.architectures[0])(cfg, TorchAttentionBackend())
    total = sum(p.numel() for p in model.parameters()) * 2
    routed = active = 0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            experts = (m.w13.numel() + m.w2.numel()) * 2
            routed += experts
            active += experts * m.top_k // m.num_experts
    read = total - routed + active - model.model.embed_tokens.weight.numel() * 2
    for t in tps:
        print(f"{name}: weights {total / 1e9:.1f} GB; read per decode step {read / 1e9:.2f} GB, "
              f"{read / t / 1e9:.2f} GB per GPU at T={t} (floor: that / the GPU's bandwidth)")
PYEOF
fi
for t in ${TPS:-4 8}; do
  [ "$t" -le "$gpus" ] || { echo "skip T=$t: $gpus GPUs"; continue; }
  want lat70 && row llama70b_tp${t}_lat 400 $py -m pagedllm.benchmarks.latency --model "$M/llama-3.3-70b" $common -tp $t $lat \
    --output-json "$out/llama70b_tp${t}_lat.json"
  want tput70 && row llama70b_tp${t}_tput 580 $py -m pagedllm.benchmarks.throughput --model "$M/llama-3.3-70b" $common \
    -tp $t $tput --output-json "$out/llama70b_tp${t}_tput.json"
done
if want qwen235 && [ "$gpus" -ge 8 ]; then
  for ep in "" "--enable-expert-parallel"; do
    tag=$([ -n "$ep" ] && echo ep || echo tp)
    row qwen235b_${tag}8_lat 400 $py -m pagedllm.benchmarks.latency --model "$M/qwen3-235b-a22b" $common -tp 8 $ep $lat \
      --output-json "$out/qwen235b_${tag}8_lat.json"
    row qwen235b_${tag}8_tput 580 $py -m pagedllm.benchmarks.throughput --model "$M/qwen3-235b-a22b" $common -tp 8 $ep \
      $tput --output-json "$out/qwen235b_${tag}8_tput.json"
  done
fi
if want dp4 && [ "$gpus" -ge 4 ]; then
  row llama8b_dp1_tput 300 $py -m pagedllm.benchmarks.throughput --model "$M/llama-3.1-8b" $common $tput \
    --output-json "$out/llama8b_dp1_tput.json"
  row llama8b_dp4_tput 300 $py -m pagedllm.benchmarks.throughput --model "$M/llama-3.1-8b" $common -dp 4 $tput \
    --output-json "$out/llama8b_dp4_tput.json"
fi
exit 0
