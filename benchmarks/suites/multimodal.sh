#!/usr/bin/env bash
# Qwen2.5-VL-7B shape serving chat requests with one 1024x768 image each: pagedllm vs vLLM (or transformers)
#   [NUM_PROMPTS=500] [INPUT_LEN=64] [OUTPUT_LEN=64] [UNIQUE=50] [HF_NUM_PROMPTS=$NUM_PROMPTS] [HF_BATCH=16]
#   [SERVE_ARGS="..."] [VLLM_ARGS="..."] bash benchmarks/gpu.sh multimodal [ours] [hits] [vllm] [hf]
# Model: the qwen2.5-vl-7b shape (`python -m pagedllm.benchmarks.shapes`: Qwen2.5-VL-7B-Instruct's config, a
# stand-in tokenizer with Qwen's special ids and chat template, Qwen2-VL's image processor), dummy random weights,
# bfloat16, max model len 8192, at most one image per prompt.
# Workload (one `pagedllm bench serve` command for every server, so the definitions match): openai-chat on
# /v1/chat/completions, dataset random-mm, NUM_PROMPTS requests of ~INPUT_LEN random text tokens plus one random
# 1024x768 JPEG (999 image tokens), OUTPUT_LEN tokens out (--ignore-eos), all sent at t=0 (--request-rate inf),
# seed 0; reports requests/s, output tokens/s, TTFT / TPOT / E2EL mean, p50, p99.
#   ours:  `pagedllm serve` (SERVE_ARGS added), a 16-request warm-up, then the workload.
#   hits:  the same server (started if `ours` did not run), the workload again with the images drawn from a pool of
#          UNIQUE (--random-mm-num-unique-images, seed 1): the encoder cache's hit rate (and the prefix cache's)
#          from the /metrics deltas around the run (pagedllm:encoder_cache_{queries,hits}_total; the front-end's
#          processor cache, pagedllm:mm_cache_{queries,hits}_total, as vLLM's vllm:mm_cache_*). An entry no
#          running request needs stays until a new image needs its room (least recently released first), so a
#          repeat hits while the cache (max_num_batched_tokens rows) still holds it; a repeated image wholly inside
#          a prefix-cache hit needs no lookup at all (not a query).
#   vllm:  when `import vllm` works (../shared/device/vllm: `source install.sh` first), `vllm serve` of the same
#          directory (VLLM_ARGS added), warm-up, the workload, then the repeated-images run; skipped otherwise.
#          `--chat-template-content-format string` makes vLLM render a message as pagedllm does (the image mark, a
#          newline, the text: vLLM's layout for string templates), so both prefill the same prompt and a repeated
#          image can be a prefix-cache hit on both; its cache counters (vllm:prefix_cache_*, vllm:mm_cache_*: the
#          processor's cache, not an encoder cache) are printed as found.
#   hf:    benchmarks/vl_hf_bench.py: transformers' Qwen2_5_VLForConditionalGeneration with random weights, static
#          batches of HF_BATCH, HF_NUM_PROMPTS of the same requests; TTFT as bench serve's at rate inf (its
#          docstring says how). One JSON line. Given no section, the suite runs it only when the vllm section got
#          no result (the baseline is vLLM when vLLM runs the model, else transformers); named, it always runs.
# Needs pillow (and the server wheels, opentelemetry-api among them: fastapi imports it) on the GPU machine:
# `../shared/device/gpu-wheels.sh pillow`, carry .whl. The tree and every server wheel leave little of the 64 MiB
# a device call carries: keep only the server's wheels in .whl for this suite (pillow is 7 MB).
# vLLM loads Qwen2.5-VL's whole HF processor, whose video processor needs torchvision under transformers 5: where
# the image lacks it, add torchvision==0.26.0 (torch 2.11's) the same way; a .whl/torchvision-*.whl is installed
# when torchvision does not import (then every engine's image processor uses its torchvision backend).
# MODEL=DIR serves another Qwen2.5-VL directory instead of the shape (a quick check of the suite itself).
# Logs and result JSON go to $OUT (or .out/) as mm_*; each server's log is mm_<engine>_server.log.
# Multimodal rows (measured numbers belong in docs/benchmarks.md): pagedllm vs vLLM req/s and TTFT p50/p99, and
# the encoder-cache hit rate with UNIQUE images over NUM_PROMPTS requests.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
use_wheels "fastapi, uvicorn, httpx"
one_wheel() {  # MODULE GLOB: when MODULE does not import, installs the carried .whl/GLOB alone (not every wheel:
  # after install.sh, /tmp/site holds vLLM's own pins, which use_wheels' --upgrade of all .whl could replace)
  if ! $py -c "import $1" 2>/dev/null && compgen -G ".whl/$2" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/$2 \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
}
one_wheel PIL "[Pp]illow-*.whl"
one_wheel torchvision "torchvision-*.whl"
if ! $py -c "import PIL" 2>/dev/null; then
  echo "pillow is missing: images cannot be made or read. Run ../shared/device/gpu-wheels.sh pillow here and"
  echo "carry .whl (the suite installs .whl/pillow-*.whl when PIL does not import)."
  exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
NUM_PROMPTS="${NUM_PROMPTS:-500}"; INPUT_LEN="${INPUT_LEN:-64}"; OUTPUT_LEN="${OUTPUT_LEN:-64}"
UNIQUE="${UNIQUE:-50}"; HF_NUM_PROMPTS="${HF_NUM_PROMPTS:-$NUM_PROMPTS}"; HF_BATCH="${HF_BATCH:-16}"
SERVE_ARGS="${SERVE_ARGS:-}"; VLLM_ARGS="${VLLM_ARGS:-}"
M="${MODEL:-$out/models/qwen2.5-vl-7b}"
[ -n "${MODEL:-}" ] || $py -c "from pagedllm.benchmarks.shapes import write_shape_dir as w; w('qwen2.5-vl-7b', '$M')" \
  || { echo "could not write the shape directory"; exit 2; }
port=8765; spid=""; vllm_ok=0; suite_t0=$(date +%s)
stop_server() { [ -n "$spid" ] && { kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }; spid=""; }
trap stop_server EXIT

start_server() {  # ENGINE (pagedllm | vllm): serves $M on $port in the background; non-zero when it died first
  local engine=$1 log="$out/mm_$1_server.log" t0=$(date +%s)
  if [ "$engine" = vllm ]; then
    $py -m vllm.entrypoints.cli.main serve "$M" --load-format dummy --dtype bfloat16 --max-model-len 8192 \
      --limit-mm-per-prompt '{"image": 1, "video": 0}' --chat-template-content-format string \
      --gpu-memory-utilization 0.9 --port $port --seed 0 \
      $VLLM_ARGS > "$log" 2>&1 &
  else
    $py -m pagedllm.entrypoints.cli serve "$M" --load-format dummy --dtype bfloat16 --max-model-len 8192 \
      --limit-mm-per-prompt '{"image": 1}' --gpu-memory-utilization 0.9 --port $port --seed 0 \
      --disable-log-requests $SERVE_ARGS > "$log" 2>&1 &
  fi
  spid=$!
  for _ in $(seq 1200); do
    curl -sf "localhost:$port/health" >/dev/null && { echo "    $engine up in $(( $(date +%s) - t0 )) s"; return 0; }
    kill -0 "$spid" 2>/dev/null || { echo "    $engine server died:"; tail -25 "$log"; spid=""; return 1; }
    sleep 0.5
  done
  echo "    $engine not up after 600 s:"; tail -25 "$log"; stop_server; return 1
}
bench() {  # LOG ARGS...: the workload's command (extra ARGS win), its output in LOG; non-zero on failure
  local log=$1; shift
  timeout "${BENCH_TIMEOUT:-400}" $py -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
    --backend openai-chat --endpoint /v1/chat/completions --model "$M" --tokenizer "$M" --dataset-name random-mm \
    --num-prompts "$NUM_PROMPTS" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos \
    --random-mm-base-items-per-request 1 --random-mm-limit-mm-per-prompt '{"image": 1}' \
    --random-mm-bucket-config '{(768, 1024, 1): 1.0}' --request-rate inf --seed 0 \
    --percentile-metrics ttft,tpot,e2el --metric-percentiles 50,99 --disable-tqdm "$@" > "$log" 2>&1 \
    || { echo "    bench failed ($log):"; tail -15 "$log"; return 1; }
}
summary() {  # the result lines worth reading from a bench log
  grep -E "Successful requests|Failed requests|Benchmark duration|throughput \(req/s\)|Output token throughput|(Mean|P50|P99) (TTFT|TPOT|E2EL)" \
    "$1" | sed 's/  */ /g' | paste -sd';' | cut -c1-500
}
counter() {  # NAME: the sum of /metrics series NAME{...} (0 when absent)
  curl -s "localhost:$port/metrics" | awk -v n="$1" '
    index($0, n) == 1 && substr($0, length(n) + 1, 1) ~ /[{ ]/ {s += $NF} END {printf "%d", s}'
}
ratio() { awk -v h="$1" -v q="$2" 'BEGIN {if (q > 0) printf "%.3f", h / q; else printf "n/a"}'; }
workload() {  # ENGINE TAG: warm-up, then the workload; its summary
  local engine=$1
  bench "$out/mm_${engine}_warmup.log" --num-prompts 16 --seed 100 || return 1
  bench "$out/mm_${engine}.log" --save-result "$out/mm_${engine}.json" || return 1
  echo "$engine, $NUM_PROMPTS requests: $(summary "$out/mm_${engine}.log")"
}
repeated() {  # ENGINE PREFIX: the workload with UNIQUE images, and the cache counters' deltas (PREFIX pagedllm: / vllm:)
  local engine=$1 p=$2 names=() before=() after=() i
  names=("${p}encoder_cache_queries_total" "${p}encoder_cache_hits_total" "${p}prefix_cache_queries_total"
         "${p}prefix_cache_hits_total" "${p}mm_cache_queries_total" "${p}mm_cache_hits_total")
  for i in "${!names[@]}"; do before[$i]=$(counter "${names[$i]}"); done
  bench "$out/mm_${engine}_hits.log" --random-mm-num-unique-images "$UNIQUE" --seed 1 \
    --save-result "$out/mm_${engine}_hits.json" || return 1
  for i in "${!names[@]}"; do after[$i]=$(counter "${names[$i]}"); done
  echo "$engine, $NUM_PROMPTS requests over $UNIQUE images: $(summary "$out/mm_${engine}_hits.log")"
  for i in 0 2 4; do
    local q=$(( after[i] - before[i] )) h=$(( after[i+1] - before[i+1] ))
    [ "$q" -gt 0 ] && echo "    ${names[$i]%_queries_total}: $h hits / $q queries = $(ratio $h $q)"
  done
  return 0
}

if want ours || want hits; then
  t0=$(date +%s)
  echo "=== pagedllm: qwen2.5-vl-7b shape, $NUM_PROMPTS x (~$INPUT_LEN text + 1024x768 image, $OUTPUT_LEN out) ($SERVE_ARGS)"
  if start_server pagedllm; then
    if want ours; then workload pagedllm || tail -25 "$out/mm_pagedllm_server.log"; fi
    if want hits; then
      want ours || bench "$out/mm_pagedllm_warmup.log" --num-prompts 16 --seed 100
      repeated pagedllm pagedllm: || tail -25 "$out/mm_pagedllm_server.log"
    fi
    grep -E "Traceback|Error" "$out/mm_pagedllm_server.log" | head -5
  fi
  stop_server
  echo "    ($(( $(date +%s) - t0 )) s)"
fi

if want vllm; then
  t0=$(date +%s)
  if $py -c "import vllm" 2>/dev/null; then
    echo "=== vLLM $($py -c 'import vllm; print(vllm.__version__)'): the same workloads ($VLLM_ARGS)"
    if start_server vllm; then
      if workload vllm; then vllm_ok=1; repeated vllm vllm:; else tail -25 "$out/mm_vllm_server.log"; fi
    fi
    stop_server
  else
    echo "=== vllm: skipped (vLLM does not import here: source ../shared/device/vllm/install.sh first)"
  fi
  echo "    ($(( $(date +%s) - t0 )) s)"
fi

named_hf=0; for a in "${ARGS[@]}"; do [ "$a" = hf ] && named_hf=1; done
if [ "$named_hf" = 1 ] || { [ ${#ARGS[@]} -eq 0 ] && [ "$vllm_ok" = 0 ]; }; then
  t0=$(date +%s)
  echo "=== transformers: $HF_NUM_PROMPTS requests, static batches of $HF_BATCH"
  timeout "${HF_TIMEOUT:-480}" $py benchmarks/vl_hf_bench.py --model "$M" --num-prompts "$HF_NUM_PROMPTS" \
    --batch-size "$HF_BATCH" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" > "$out/mm_hf.log" 2>&1
  echo "    exit $?"
  grep -E '^\{|Error|Traceback' "$out/mm_hf.log" | tail -8
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
echo "multimodal suite: $(( $(date +%s) - suite_t0 )) s"
exit 0
