#!/usr/bin/env bash
# Check the CUDA attention kernels on this machine's GPU; writes docs/gpu_results.json and
# docs/calibration.json (and copies both to $OUT after every check when that is set).
#
#   bash scripts/gpu_check.sh --prepare   # where the tokenizer and corpus packages are installed:
#                                         # cache the real corpora's document lengths in .cache/megatron_sap
#   bash scripts/gpu_check.sh             # on the GPU machine, with .cache/ copied along
#   bash scripts/gpu_check.sh --only CHECK[,CHECK...]   # rerun those checks into the last report
set -euo pipefail
cd "$(dirname "$0")/.."
export MEGATRON_SAP_CACHE="${MEGATRON_SAP_CACHE:-$PWD/.cache/megatron_sap}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 || echo python )}"
if [ "${1:-}" = "--prepare" ]; then
    exec "$PYTHON" -m megatron_sap.bench.data --cache "$MEGATRON_SAP_CACHE"
fi
status=0
"$PYTHON" scripts/gpu_check.py --out docs/gpu_results.json ${OUT:+--mirror "$OUT"} "$@" || status=$?
exit "$status"
