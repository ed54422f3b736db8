#!/usr/bin/env bash
# Set up and run the whole CPU test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh serve,test
py="${PYTHON:-python3}"
"$py" -m ruff check pagedllm tests tools
"$py" -m pytest -q -p no:cacheprovider "$@"
