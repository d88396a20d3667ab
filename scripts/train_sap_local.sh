#!/bin/bash
# Local SAP training on one machine.
#
#   scripts/train_sap_local.sh              # CPU: tiny Megatron-Core GPT, 4 gloo ranks, SAP 2x2
#   DEVICE=cuda MEGATRON_LM_PATH=... DATA_PATH=... TOKENIZER_MODEL=... scripts/train_sap_local.sh
#                                           # GPUs: the SLURM job's Megatron-LM training, one node
#
# CPU variables: NPROC (4), SAP_INNER (2), SAP_OUTER (NPROC / SAP_INNER), STEPS (20).
# CUDA variables: those of sap_llama3_8b_flags.sh, with one node's defaults in place of its
# own: NPROC the visible GPU count, TP (2 on two GPUs or more, else 1: the 8B model's weights,
# gradients and optimizer state at TP 1 leave too little of an 80 GB GPU for activations),
# SAP_INNER (NPROC / TP), SAP_OUTER (1) and SEQ_LENGTH (32768).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
: "${PYTHON:=python}"

positive_ints() {  # exit unless each named variable holds a positive integer
    for name in "$@"; do
        if ! [[ "${!name}" =~ ^[0-9]+$ ]] || (( 10#${!name} < 1 )); then
            echo "$name=${!name} must be a positive integer" >&2
            exit 2
        fi
    done
}
if [ -z "${DEVICE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi

case "$DEVICE" in
    cpu)
        : "${NPROC:=4}"
        : "${SAP_INNER:=2}"
        positive_ints NPROC SAP_INNER
        : "${SAP_OUTER:=$((NPROC / SAP_INNER))}"
        : "${STEPS:=20}"
        positive_ints SAP_OUTER STEPS
        if (( NPROC < 1 || SAP_INNER < 1 || SAP_OUTER < 1 || NPROC % (SAP_INNER * SAP_OUTER) )); then
            echo "NPROC=$NPROC must be a positive multiple of SAP_INNER*SAP_OUTER=$SAP_INNER*$SAP_OUTER (the rest is data parallelism)" >&2
            exit 2
        fi
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
        exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
            -m megatron_sap.megatron.demo_train --inner-size "$SAP_INNER" --outer-size "$SAP_OUTER" --steps "$STEPS"
        ;;
    cuda)
        : "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.13 to core_v0.19)}"
        : "${NPROC:=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}"  # the visible GPUs
        : "${TP:=$(( NPROC >= 2 ? 2 : 1 ))}"
        positive_ints NPROC TP
        : "${SAP_INNER:=$((NPROC / TP))}"
        : "${SAP_OUTER:=1}"
        : "${SEQ_LENGTH:=32768}"
        positive_ints SAP_INNER SAP_OUTER SEQ_LENGTH
        # shellcheck source=sap_llama3_8b_flags.sh
        source "$SCRIPT_DIR/sap_llama3_8b_flags.sh"
        export CUDA_DEVICE_MAX_CONNECTIONS=1
        export PYTHONPATH="$MEGATRON_LM_PATH${PYTHONPATH:+:$PYTHONPATH}"
        exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
            -m megatron_sap.launch "$MEGATRON_LM_PATH/pretrain_gpt.py" "${SAP_TRAINING_ARGS[@]}"
        ;;
    *)
        echo "DEVICE must be cpu or cuda, got '$DEVICE'" >&2
        exit 2
        ;;
esac
