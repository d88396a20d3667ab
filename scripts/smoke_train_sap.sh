#!/bin/bash
# A short Megatron-LM training run with SAP on this machine's GPUs: tiny GPT, mock packed data.
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/smoke_train_sap.sh [extra Megatron flags]
#
# CP = all visible GPUs (NPROC), split SAP_INNER x (NPROC / SAP_INNER). Mock documents of random
# lengths end in EOD; --reset-position-ids --reset-attention-mask make them separate documents. Fails unless
# every logged loss is finite and the last one is below the first.
#
# Variables: NPROC (the visible GPUs), SAP_INNER (2 where NPROC is even, else 1), SEQ_LENGTH
# (about 8K, a multiple of 2 x CP), TRAIN_ITERS (30), LOG (the run's output, default
# ./smoke_train_sap.log), PYTHON (python).
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.13 to core_v0.19)}"
: "${PYTHON:=python}"
: "${NPROC:=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}"  # the visible GPUs
if ! [[ "${NPROC:-}" =~ ^[0-9]+$ ]] || [ "$NPROC" -lt 1 ]; then echo "no visible GPU (NPROC=${NPROC:-})" >&2; exit 2; fi
: "${SAP_INNER:=$(( NPROC % 2 == 0 ? 2 : 1 ))}"
if ! [[ "$SAP_INNER" =~ ^[0-9]+$ ]] || [ "$SAP_INNER" -lt 1 ] || [ $(( NPROC % SAP_INNER )) -ne 0 ]; then
    echo "SAP_INNER=$SAP_INNER must be a positive divisor of NPROC=$NPROC" >&2; exit 2
fi
: "${SEQ_LENGTH:=$(( 8192 / (2 * NPROC) * 2 * NPROC ))}"  # about 8K, divisible by 2 x CP as Megatron-LM requires
if [ $(( SEQ_LENGTH % (2 * NPROC) )) -ne 0 ]; then
    echo "SEQ_LENGTH=$SEQ_LENGTH must be divisible by 2 x CP = $(( 2 * NPROC ))" >&2; exit 2
fi
: "${TRAIN_ITERS:=30}"
SAP_OUTER=$((NPROC / SAP_INNER))
LOG="${LOG:-smoke_train_sap.log}"

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH="$MEGATRON_LM_PATH${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m megatron_sap.launch "$MEGATRON_LM_PATH/pretrain_gpt.py" \
    --num-layers 2 --hidden-size 256 --ffn-hidden-size 1024 \
    --num-attention-heads 8 --group-query-attention --num-query-groups 4 \
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --transformer-impl transformer_engine \
    --context-parallel-size "$NPROC" --cp-comm-type sap --sap-inner-size "$SAP_INNER" --sap-outer-size "$SAP_OUTER" \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 \
    --reset-position-ids --reset-attention-mask --eod-mask-loss --calculate-per-token-loss --no-create-attention-mask-in-dataloader \
    --micro-batch-size 1 --global-batch-size 4 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --lr-warmup-iters 5 --log-interval 1 --eval-iters 0 --eval-interval "$TRAIN_ITERS" \
    "$@" 2>&1 | tee "$LOG"

"$PYTHON" - "$LOG" <<'PY'
import math, re, sys
losses = [float(x) for x in re.findall(r"lm loss: ([-+0-9.eEnaif]+)", open(sys.argv[1]).read())]
if not losses:
    sys.exit("smoke run logged no 'lm loss'")
if not all(math.isfinite(x) for x in losses):
    sys.exit(f"non-finite loss in {losses}")
if losses[-1] >= losses[0]:
    sys.exit(f"loss did not decrease: first {losses[0]}, last {losses[-1]}")
print(f"SAP smoke training OK: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
PY
