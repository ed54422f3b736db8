# The shared preamble of the GPU scripts (benchmarks/suites/*.sh, gpu_tests.sh, gpu_ab.sh); each sources it from
# the repository root with its own arguments: `source benchmarks/lib.sh "$@"`. Sets $out (logs and JSON: $OUT,
# else .out/), $py, and `want SECTION` (true when the script was given no arguments or names SECTION among them).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
out="${OUT:-.out}"; mkdir -p "$out"
ARGS=("$@")
want() { [ ${#ARGS[@]} -eq 0 ] && return 0; for a in "${ARGS[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
py=python3

# use_wheels "MODULE[, MODULE...]": when that import fails and wheels were carried (.whl/, from
# ../shared/device/gpu-wheels.sh), installs them into /tmp/site and puts it on PYTHONPATH (for the scripts this one
# runs too). The GPU image lacks the server's packages (fastapi, uvicorn), xgrammar and jsonschema.
use_wheels() {
  if [ -d .whl ] && ! $py -c "import $1" 2>/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
}

# row NAME SECONDS COMMAND...: runs one benchmark row under a time limit, its whole output in $out/bench_NAME.log;
# prints the result lines (and errors), then how long the row took.
row() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$out/bench_$name.log" | grep -E "^(Throughput|Latency|Avg|WARNING)|Error|error|Traceback" | head -20
  echo "    ($(( $(date +%s) - t0 )) s)"
}
