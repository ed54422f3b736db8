#!/usr/bin/env bash
# windowed (hybrid) KV cache on against off: Gemma-3-12B shape at 32k, KV per sequence and latency
#   bash benchmarks/gpu.sh hybrid-kv [check] [on] [off]
# check: a tiny Gemma 3 (window 16, bf16, Triton attention, CUDA graphs, async scheduling) generates the same greedy
#        tokens with the windowed cache and without it (--disable-hybrid-kv-cache-manager), on prompts far longer than
#        the window, in chunks, with prefix hits. Both runs schedule alike (a pool nothing runs out of), so the same
#        kernels see the same batches and only the block ids differ: the tokens must match exactly.
# on / off: `bench latency` on the Gemma-3-12B shape (dummy weights) at 32k context (32000 in / 128 out, batch 1) with
#        the windowed cache and without it, INFO logging on, so the engine's "KV cache (...)" lines show the blocks, the
#        maximum concurrency and the KV memory one 32768-token sequence takes with and without the windowed cache.
# With no arguments it runs everything. Logs go to $OUT (or .out/) as bench_*.log and *.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if want check; then
  echo "=== check: tiny Gemma 3 on cuda, windowed cache on vs off"
  t0=$(date +%s)
  timeout 300 $py - "$out/tiny_gemma3" <<'PYEOF' 2>&1 | tee "$out/hybrid_check.log" | grep -vE "^(INFO|DEBUG)" | tail -15
import random, sys
from pagedllm import LLM, SamplingParams
from tests.utils import make_tiny_model

path = make_tiny_model("gemma3", sys.argv[1])  # layer 0 slides over 16 tokens, layer 1 is global
rng = random.Random(0)
shared = [rng.randrange(3, 400) for _ in range(96)]
prompts = [shared + [rng.randrange(3, 400) for _ in range(n)] for n in (5, 40, 17, 70)]
prompts += [[rng.randrange(3, 400) for _ in range(n)] for n in (150, 33)]
params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
results = {}
for off in (False, True):
    llm = LLM(path, dtype="bfloat16", device="cuda", block_size=16, max_model_len=512, max_num_batched_tokens=64,
              kv_cache_memory_bytes=64 << 20, disable_hybrid_kv_cache_manager=off)
    core = llm.llm_engine.engine_core
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    results[off] = [o.outputs[0].token_ids for o in outs]
    print(f"windowed cache {'off' if off else 'on'}: groups {core.kv_cache_info['group_windows']}, "
          f"{core.kv_cache_info['num_blocks']} blocks, graphs {core.runner.graph_runner is not None}, "
          f"preemptions {stats.num_preemptions}, prefix hits {stats.prefix_cache_hits} tokens")
    del llm
same = results[False] == results[True]
print("greedy tokens identical with and without the windowed cache:", same)
sys.exit(0 if same else 1)
PYEOF
  echo "    ($(( $(date +%s) - t0 )) s)"
fi
$py -c "from pagedllm.benchmarks.shapes import write_shape_dir; write_shape_dir('gemma-3-12b', '$out/models/gemma-3-12b')"
G="$out/models/gemma-3-12b"
logged="import logging, runpy, sys; logging.basicConfig(level=logging.INFO); sys.argv[0] = 'latency'; runpy.run_module('pagedllm.benchmarks.latency', run_name='__main__')"
lat="--load-format dummy --max-model-len 32768 --input-len 32000 --output-len 128 --batch-size 1 --num-iters-warmup 1 --num-iters 2"
run() {  # name, extra flags...
  local name=$1; shift
  echo "=== $name: bench latency $lat $*"
  local t0=$(date +%s)
  timeout 280 $py -c "$logged" --model "$G" $lat "$@" --output-json "$out/$name.json" > "$out/bench_$name.log" 2>&1
  echo "    rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "KV cache|memory profile|^Latency|Error|Traceback" "$out/bench_$name.log" | sed 's/^/    /' | head -12
}
want on && run gemma3_12b_32k_windowed
want off && run gemma3_12b_32k_full --disable-hybrid-kv-cache-manager
exit 0
