#!/usr/bin/env bash
# Serving under load, pagedllm or vLLM behind the same `pagedllm bench serve` client: burst, SLO sweep, datasets
#   ENGINE=pagedllm|vllm [SERVE_ARGS="..."] [TAG=name] bash benchmarks/gpu.sh serve-load [burst] [slo] [datasets]
# burst:    Qwen3-0.6B shape, 500 x (512 in, 128 out), request rate inf; pagedllm's server also writes its request
#           timeline (PAGEDLLM_REQUEST_TIMELINE) and benchmarks/burst_timeline.py prints where TTFT went.
# slo:      the same server at 10, 20, 40 and 60 requests/s (400 requests each), goodput = TTFT <= 500 ms and
#           TPOT <= 50 ms.
# datasets: Llama-3.1-8B shape, vLLM's three serving datasets: ShareGPT-shaped (a generated file whose lengths follow
#           ShareGPT's, see pagedllm/benchmarks/datasets.py), sonnet prefill-heavy (~462 in / 16 out) and sonnet
#           decode-heavy (~462 / 256), each at QPS ${QPS:-4 16 inf} (200 requests at a finite QPS, 500 at inf).
# VLLM_CLIENT=1 also runs the burst from `vllm bench serve`. ENGINE=vllm and VLLM_CLIENT need vLLM importable
# (../shared/device/vllm: `source install.sh` first). SERVE_ARGS are added to the server's command line (the knobs
# under test); TAG prefixes the result files in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
use_wheels "fastapi, uvicorn"
ENGINE="${ENGINE:-pagedllm}"; TAG="${TAG:-$ENGINE}"; SERVE_ARGS="${SERVE_ARGS:-}"
$py -m pagedllm.benchmarks.shapes "$out/models" >/dev/null
Q="$out/models/qwen3-0.6b"; L="$out/models/llama-3.1-8b"
port=8765
bench() { $py -m pagedllm.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --disable-tqdm "$@"; }

start_server() {  # model; sets $spid, returns non-zero when the server died before answering /health
  local model=$1 t0=$(date +%s)
  if [ "$ENGINE" = vllm ]; then
    $py -m vllm.entrypoints.cli.main serve "$model" --load-format dummy --max-model-len 4096 \
      --gpu-memory-utilization 0.9 --port $port --seed 0 $SERVE_ARGS > "$out/${TAG}_server.log" 2>&1 &
  else
    PAGEDLLM_REQUEST_TIMELINE="$out/${TAG}_timeline.jsonl" $py -m pagedllm.entrypoints.cli serve "$model" \
      --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9 --port $port --disable-log-requests \
      $SERVE_ARGS > "$out/${TAG}_server.log" 2>&1 &
  fi
  spid=$!
  for _ in $(seq 900); do
    curl -sf localhost:$port/health >/dev/null && { echo "    $ENGINE up in $(( $(date +%s) - t0 )) s"; return 0; }
    kill -0 $spid 2>/dev/null || { echo "    $ENGINE server died:"; tail -20 "$out/${TAG}_server.log"; return 1; }
    sleep 0.5
  done
  return 1
}
stop_server() { kill $spid 2>/dev/null; wait $spid 2>/dev/null; }
summary() {  # the result lines worth reading from a bench log
  grep -E "throughput \(req/s\)|Output token throughput|(P50|P99|Mean) (TTFT|TPOT)|goodput|Benchmark duration" "$1" \
    | sed 's/  */ /g' | paste -sd';' | cut -c1-400
}

if want burst || want slo; then
  echo "=== $TAG: Qwen3-0.6B shape ($ENGINE $SERVE_ARGS)"
  if start_server "$Q"; then
    bench --model "$Q" --tokenizer "$Q" --num-prompts 64 --random-input-len 512 --random-output-len 128 --ignore-eos \
      --request-rate inf > "$out/${TAG}_warmup.log" 2>&1
    : > "$out/${TAG}_timeline.jsonl"  # the server holds it open (append): empty it, keep the file
    if want burst; then
      bench --model "$Q" --tokenizer "$Q" --num-prompts 500 --random-input-len 512 --random-output-len 128 \
        --ignore-eos --request-rate inf --metric-percentiles 50,99 --goodput ttft:500 tpot:50 \
        --save-result "$out/${TAG}_burst.json" > "$out/${TAG}_burst.log" 2>&1
      echo "burst: $(summary "$out/${TAG}_burst.log")"
      [ -s "$out/${TAG}_timeline.jsonl" ] && $py benchmarks/burst_timeline.py "$out/${TAG}_timeline.jsonl"
      if [ -n "${VLLM_CLIENT:-}" ]; then  # the same burst from vLLM's own client (vLLM importable)
        $py -m vllm.entrypoints.cli.main bench serve --backend vllm --port $port --model "$Q" --tokenizer "$Q" \
          --dataset-name random --num-prompts 500 --random-input-len 512 --random-output-len 128 --ignore-eos \
          --request-rate inf --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
          --goodput ttft:500 tpot:50 > "$out/${TAG}_burst_vllm_client.log" 2>&1
        echo "burst, vLLM's client: $(summary "$out/${TAG}_burst_vllm_client.log")"
      fi
    fi
    if want slo; then
      for rate in 10 20 40 60; do
        bench --model "$Q" --tokenizer "$Q" --num-prompts 400 --random-input-len 512 --random-output-len 128 \
          --ignore-eos --request-rate $rate --seed $rate --metric-percentiles 50,99 --goodput ttft:500 tpot:50 \
          --save-result "$out/${TAG}_rate$rate.json" > "$out/${TAG}_rate$rate.log" 2>&1
        echo "rate $rate: $(summary "$out/${TAG}_rate$rate.log")"
      done
    fi
  fi
  stop_server
fi

if want datasets; then
  echo "=== $TAG: Llama-3.1-8B shape, three datasets ($ENGINE $SERVE_ARGS)"
  $py -m pagedllm.benchmarks.datasets sharegpt-file "$out/sharegpt.json" --tokenizer "$L" --num 1000 --seed 0
  if start_server "$L"; then
    bench --model "$L" --tokenizer "$L" --num-prompts 32 --random-input-len 512 --random-output-len 64 --ignore-eos \
      --request-rate inf > "$out/${TAG}_warmup8b.log" 2>&1
    for qps in ${QPS:-4 16 inf}; do
      n=200; [ "$qps" = inf ] && n=500
      bench --model "$L" --tokenizer "$L" --dataset-name sharegpt --dataset-path "$out/sharegpt.json" \
        --num-prompts $n --request-rate $qps --seed 0 --metric-percentiles 50,99 \
        --save-result "$out/${TAG}_sharegpt_qps$qps.json" > "$out/${TAG}_sharegpt_qps$qps.log" 2>&1
      echo "sharegpt qps $qps: $(summary "$out/${TAG}_sharegpt_qps$qps.log")"
      for kind in prefill:16 decode:256; do
        bench --model "$L" --tokenizer "$L" --dataset-name sonnet --sonnet-input-len 470 --sonnet-prefix-len 200 \
          --sonnet-output-len ${kind#*:} --num-prompts $n --request-rate $qps --seed 0 --metric-percentiles 50,99 \
          --save-result "$out/${TAG}_sonnet_${kind%:*}_qps$qps.json" > "$out/${TAG}_sonnet_${kind%:*}_qps$qps.log" 2>&1
        echo "sonnet ${kind%:*}-heavy qps $qps: $(summary "$out/${TAG}_sonnet_${kind%:*}_qps$qps.log")"
      done
    done
  fi
  stop_server
fi
