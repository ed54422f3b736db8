#!/usr/bin/env bash
# The one entry to the GPU benchmarks: bash benchmarks/gpu.sh SUITE [SECTION...]   (no suite: the list)
# SUITE is benchmarks/suites/SUITE.sh, whose header names its sections and environment variables; a suite given no
# section runs all of them. `tests` runs benchmarks/gpu_tests.sh (the GPU tests) and `ab` benchmarks/gpu_ab.sh (an
# A/B of two checkouts). Logs and JSON go to $OUT (or .out/). docs/benchmarks.md gives each row's suite command.
set -uo pipefail
cd "$(dirname "$0")/.."
suites() {
  echo "usage: bash benchmarks/gpu.sh SUITE [SECTION...]   (logs and JSON in \$OUT, else .out/)"
  echo "suites:"
  local f
  for f in benchmarks/suites/*.sh; do
    printf '  %-19s %s\n' "$(basename "$f" .sh)" "$(sed -n '2s/^# *//p' "$f")"
  done
  printf '  %-19s %s\n' tests "the GPU tests (pytest -m gpu) as parallel groups: benchmarks/gpu_tests.sh" \
    ab "the headline rows, this tree against another checkout, order rotating: benchmarks/gpu_ab.sh"
}
suite="${1:-}"
[ $# -gt 0 ] && shift
case "$suite" in
  "" | -h | --help | help) suites; exit 0 ;;
  tests) exec bash benchmarks/gpu_tests.sh "$@" ;;
  ab) exec bash benchmarks/gpu_ab.sh "$@" ;;
esac
if [[ ! "$suite" =~ ^[a-z0-9-]+$ ]] || [ ! -f "benchmarks/suites/$suite.sh" ]; then
  echo "unknown suite: $suite"; suites; exit 2
fi
exec bash "benchmarks/suites/$suite.sh" "$@"
