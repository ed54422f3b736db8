#!/usr/bin/env bash
# Set up and complete a prompt with the bundled demo model (CPU is fine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec pagedllm generate "${@:-def fibonacci(n):}" --max-tokens 64
