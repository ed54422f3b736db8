# The shared preamble of the benchmarks/gpu_*.sh device scripts; each sources it from the repository root with its
# own arguments: `cd "$(dirname "$0")/.."; source benchmarks/lib.sh "$@"`. Sets $out (logs and JSON: $OUT, else
# .out/), $py, and `want SECTION` (true when the script was given no arguments or names SECTION among them).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
out="${OUT:-.out}"; mkdir -p "$out"
ARGS=("$@")
want() { [ ${#ARGS[@]} -eq 0 ] && return 0; for a in "${ARGS[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
py=python3
