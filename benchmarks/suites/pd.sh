#!/usr/bin/env bash
# 2 GPUs: disaggregated prefill/decode (producer GPU0 + consumer GPU1 behind disagg-proxy) vs data parallel 2
# On the 2-GPU kind (nvidia-h200-x2 / nvidia-h100-x2), model shape $SHAPE (default qwen3-0.6b, dummy weights):
#   check: one greedy completion through the proxy equals one instance's own (tokens; logprob difference printed),
#          and the decode instance loaded the prompt's KV over NCCL (external_prefix_cache_hits)
#   pd:    (A) prefill server on GPU0 (P2pConnector kv_producer) + decode server on GPU1 (kv_consumer) behind
#          `pagedllm disagg-proxy`
#   dp:    (B) one server with --data-parallel-size 2 on both GPUs
# each loaded by `pagedllm bench serve` with NUM_PROMPTS (default 400) x (INPUT_LEN 2048 in, OUTPUT_LEN 256 out) at
# each rate of RATES (default "8 16 32" requests/s) with BURSTINESS (default 0.5: gamma arrival gaps, bursts of
# prefills), reporting TTFT and TPOT p50/p99.
#   [SHAPE=qwen3-0.6b] [RATES="8 16 32"] [NUM_PROMPTS=400] [INPUT_LEN=2048] [OUTPUT_LEN=256] [BURSTINESS=0.5]
#   [SERVE_ARGS="..."] bash benchmarks/gpu.sh pd [check] [pd] [dp]
# SHAPE is a directory name that `python -m pagedllm.benchmarks.shapes` writes (llama-3.1-8b, qwen3-30b-a3b, ...).
# Logs and result JSON go to $OUT (or .out/) as pd_* and dp_*.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
use_wheels "fastapi, uvicorn, httpx"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: keep multicast off
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
SHAPE="${SHAPE:-qwen3-0.6b}"; M="$out/models/$SHAPE"
[ -d "$M" ] || { echo "unknown SHAPE $SHAPE: $(ls "$out/models" | tr '\n' ' ')"; exit 2; }
RATES="${RATES:-8 16 32}"; NUM_PROMPTS="${NUM_PROMPTS:-400}"; INPUT_LEN="${INPUT_LEN:-2048}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"; BURSTINESS="${BURSTINESS:-0.5}"; SERVE_ARGS="${SERVE_ARGS:-}"
front=8765; p_port=8100; d_port=8200; kv_port=14579  # the proxy (or the DP server), prefill, decode, KV (+1: store)
common="--load-format dummy --max-model-len $(( INPUT_LEN + OUTPUT_LEN + 64 )) --gpu-memory-utilization 0.9 --disable-log-requests"
pids=()

serve() {  # NAME PORT GPUS ARGS...: a server in the background, waited for; non-zero when it died first
  local name=$1 port=$2 gpus=$3 t0=$(date +%s); shift 3
  CUDA_VISIBLE_DEVICES=$gpus $py -m pagedllm.entrypoints.cli serve "$M" $common --port "$port" $SERVE_ARGS "$@" \
    > "$out/${name}_server.log" 2>&1 &
  pids+=($!)
  wait_up "$name" "$port" $! "$out/${name}_server.log" "$t0"
}
wait_up() {  # NAME PORT PID LOG T0
  for _ in $(seq 1200); do
    curl -sf "localhost:$2/health" >/dev/null && { echo "    $1 up in $(( $(date +%s) - $5 )) s"; return 0; }
    kill -0 "$3" 2>/dev/null || { echo "    $1 died:"; tail -20 "$4"; return 1; }
    sleep 0.5
  done
  echo "    $1 not up after 600 s"; return 1
}
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done; pids=(); }
trap stop_all EXIT
bench() { $py -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$front" --disable-tqdm \
  --model "$M" --tokenizer "$M" "$@"; }
summary() {  # the result lines worth reading from a bench log
  grep -E "throughput \(req/s\)|Output token throughput|(P50|P99|Mean) (TTFT|TPOT)|Benchmark duration|Failed" "$1" \
    | sed 's/  */ /g' | paste -sd';' | cut -c1-400
}
hits() { curl -s "localhost:$1/metrics" | grep -E '^pagedllm:external_prefix_cache_hits_total' | awk '{print $NF}'; }
load() {  # TAG: warm-up, then one run per rate
  local tag=$1
  bench --num-prompts 32 --random-input-len "$INPUT_LEN" --random-output-len 32 --ignore-eos --request-rate inf \
    > "$out/${tag}_warmup.log" 2>&1 || { echo "    warm-up failed:"; tail -5 "$out/${tag}_warmup.log"; }
  for rate in $RATES; do
    bench --num-prompts "$NUM_PROMPTS" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
      --ignore-eos --request-rate "$rate" --burstiness "$BURSTINESS" --seed "$rate" \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
      --save-result "$out/${tag}_rate$rate.json" > "$out/${tag}_rate$rate.log" 2>&1
    echo "$tag rate $rate: $(summary "$out/${tag}_rate$rate.log")"
  done
}
start_pd() {
  local cfg='{"kv_connector":"P2pConnector","kv_role":"%s","kv_connector_extra_config":{%s}}'
  serve pd_prefill $p_port 0 --kv-transfer-config "$(printf "$cfg" kv_producer "\"kv_port\":$kv_port")" &&
  serve pd_decode $d_port 1 --kv-transfer-config \
    "$(printf "$cfg" kv_consumer "\"remote_host\":\"127.0.0.1\",\"remote_port\":$kv_port")" || return 1
  local t0=$(date +%s)
  $py -m pagedllm.entrypoints.cli disagg-proxy --prefill "http://127.0.0.1:$p_port" \
    --decode "http://127.0.0.1:$d_port" --port $front --uvicorn-log-level warning > "$out/pd_proxy.log" 2>&1 &
  pids+=($!)
  wait_up proxy $front $! "$out/pd_proxy.log" "$t0"
}

if want check || want pd; then
  echo "=== (A) P/D: prefill GPU0 + decode GPU1 behind disagg-proxy, $SHAPE ($SERVE_ARGS)"
  if start_pd; then
    if want check; then
      $py - "$M" $front $d_port "$INPUT_LEN" $p_port <<'PYEOF'
import sys, httpx
model, front, decode, input_len, prefill = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
body = {"model": model, "prompt": list(range(1000, 1000 + min(777, input_len))), "max_tokens": 16,
        "temperature": 0, "logprobs": 1, "ignore_eos": True}  # 777: not a multiple of the block size
def complete(port):
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        sys.exit(f"check: FAILED, port {port} answered {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]
alone = complete(prefill)  # the reference first: one instance computing the whole prompt (same dummy weights)
via = complete(front)
hits = [l for l in httpx.get(f"http://127.0.0.1:{decode}/metrics").text.splitlines()
        if l.startswith("pagedllm:external_prefix_cache_hits_total")]
same = via["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
diff = max(abs(a - b) for a, b in zip(via["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"]))
print(f"check: tokens {'equal' if same else 'DIFFER'}, max logprob diff {diff:.2e}, decode {hits}")
PYEOF
    fi
    if want pd; then
      load pd
      echo "    decode instance: external_prefix_cache_hits_total $(hits $d_port) (prompt tokens loaded, not recomputed)"
      grep -cE "pulling its KV failed|not loading its KV" "$out/pd_decode_server.log" | sed 's/^/    failed or refused loads: /'
    fi
  fi
  stop_all
fi

if want dp; then
  echo "=== (B) data parallel 2 on GPU0+1, $SHAPE ($SERVE_ARGS)"
  serve dp $front 0,1 --data-parallel-size 2 && load dp
  stop_all
fi
exit 0
