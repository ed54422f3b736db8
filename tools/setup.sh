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
# Structured outputs need xgrammar. Its wheel requires triton (~1 GB) for a GPU kernel pagedllm does not use;
# without triton (CPU machines) install xgrammar and its one native dependency alone.
if ! "$py" -c "import xgrammar" 2>/dev/null; then
  if "$py" -c "import triton" 2>/dev/null; then
    "$py" -m pip install -q "xgrammar>=0.2"
  else
    "$py" -m pip install -q --no-deps "xgrammar>=0.2" "apache-tvm-ffi>=0.1.11"
  fi
fi
