#!/usr/bin/env bash
# `pagedllm serve` start-up: seconds to the first completed request, Llama-3.1-8B shape
#   bash benchmarks/gpu.sh startup
# The rows' `startup` section (see rows.sh): `pagedllm bench startup --num-runs 2`. The server's packages come from
# carried wheels when the image lacks them (.whl/, ../shared/device/gpu-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
use_wheels "fastapi, uvicorn"
exec bash benchmarks/suites/rows.sh startup
