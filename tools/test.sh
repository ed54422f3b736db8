#!/usr/bin/env bash
# Set up and run the whole CPU test suite (what CI runs). Extra arguments go to pytest (and then only what they
# select runs, in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh serve,test
py="${PYTHON:-python3}"
"$py" -m ruff check pagedllm tests tools
if [ $# -gt 0 ]; then
  exec "$py" -m pytest -q -p no:cacheprovider "$@"
fi
# The fresh-environment check (a new virtual environment, the README's set-up in it, a served prompt) spends
# most of its minute in pip: it runs beside the rest of the suite, its output shown at the end.
fresh="tests/tools/test_fresh_setup.py"
log="$(mktemp)"
"$py" -m pytest -q -p no:cacheprovider "$fresh" > "$log" 2>&1 &
pid=$!
rc=0
"$py" -m pytest -q -p no:cacheprovider --ignore="$fresh" || rc=$?
wait "$pid" || rc=$(( rc ? rc : 1 ))
echo "--- $fresh"; cat "$log"; rm -f "$log"
exit "$rc"
