#!/usr/bin/env bash
# MoE / MLA shapes (Qwen3-30B-A3B, DeepSeek-V2-Lite): batch-1 latency, throughput, bandwidth floor
# The MoE / MLA shapes with dummy weights. `pagedllm bench latency` (batch 1, 128 in /
# 128 out) and `bench throughput` (NUM_PROMPTS, default 1000, x (1024 in, 128 out)) on the Qwen3-30B-A3B and
# DeepSeek-V2-Lite shapes (pagedllm.benchmarks.shapes), with each shape's bytes read per decode step (weights
# outside the experts + top_k of the routed experts + shared experts + the LM head) for the bandwidth floor.
#   [MODELS="qwen3-30b-a3b deepseek-v2-lite"] [NUM_PROMPTS=1000] bash benchmarks/gpu.sh moe [latency] [throughput]
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
models="${MODELS:-qwen3-30b-a3b deepseek-v2-lite}"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
$py - "$out/models" $models <<'PYEOF'
import sys
import torch
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.model_loader import _default_dtype
from pagedllm.models.registry import get_model_class

for name in sys.argv[2:]:  # built on the meta device: shapes only
    mc = ModelConfig(model=f"{sys.argv[1]}/{name}", dtype="bfloat16", load_format="dummy")
    cfg = mc.hf_config
    with _default_dtype(torch.bfloat16), torch.device("meta"):
        model = get_model_class(cfg.architectures[0])(cfg, TorchAttentionBackend())
    total = sum(p.numel() for p in model.parameters()) * 2  # the per-expert parameters are views of w13 / w2
    routed = active = 0
    for m in model.modules():
        if isinstance(m, FusedMoE):  # stacked experts: buffers w13 / w2
            experts = (m.w13.numel() + m.w2.numel()) * 2
            routed += experts
            active += experts * m.top_k // m.num_experts
    embed = model.model.embed_tokens.weight.numel() * 2
    read = total - routed + active - embed  # the input embedding is a gather, not a read of the table
    print(f"{name}: all weights {total / 1e9:.2f} GB, routed experts {routed / 1e9:.2f} GB; read per decode step "
          f"{read / 1e9:.3f} GB -> floor {read / 3.35e12 * 1e3:.2f} ms/token at 3.35 TB/s")
PYEOF
common="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9"
for m in $models; do
  if want latency; then
    row ${m}_lat 150 $py -m pagedllm.benchmarks.latency --model "$out/models/$m" $common --batch-size 1 \
      --input-len 128 --output-len 128 --num-iters-warmup 2 --num-iters 5 --output-json "$out/${m}_lat.json"
  fi
done
for m in $models; do
  if want throughput; then
    row ${m}_tp 200 $py -m pagedllm.benchmarks.throughput --model "$out/models/$m" $common \
      --num-prompts ${NUM_PROMPTS:-1000} --input-len 1024 --output-len 128 --output-json "$out/${m}_tp.json"
  fi
done
