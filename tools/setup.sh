#!/usr/bin/env bash
# Install pagedllm (editable) with the given extras into the current Python.
# torch comes first, pinned to the local CPU build when absent: a bare "torch" requirement would pull a
# multi-GB CUDA build. A machine that already has torch (the GPU image: 2.11+cu130) keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e ".${extras:+[$extras]}"
