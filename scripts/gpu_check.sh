#!/usr/bin/env bash
# Check the CUDA attention kernels on this machine's GPU; writes docs/gpu_results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" scripts/gpu_check.py --out docs/gpu_results.json "$@"
