#!/usr/bin/env bash
# `pagedllm bench serve` against `pagedllm serve`: Qwen3-0.6B shape, 500 x (512 in, 128 out), rate inf
#   bash benchmarks/gpu.sh serve
# The rows' `serve` section (see rows.sh). The server's packages come from carried wheels when the image lacks them
# (.whl/, ../shared/device/gpu-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
use_wheels "fastapi, uvicorn"
exec bash benchmarks/suites/rows.sh serve
