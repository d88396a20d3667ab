# Megatron-LM flags for a Llama-3.1-8B-like model (Llama-3 8B with the 3.1 RoPE scaling, for long
# context) trained on packed documents with SAP context parallelism. Sourced by train_sap_slurm.sbatch and train_sap_local.sh; override the
# variables below in the environment.
#
# Packed pretraining data: Megatron's GPT dataset with --reset-position-ids --reset-attention-mask,
# whose position ids restart at 0 after every EOD and whose documents attend only within
# themselves; SAP recovers the document boundaries (cu_seqlens) from the position ids. The data must
# end each document with EOD: preprocess it with tools/preprocess_data.py --append-eod (else a row is one document).
# --calculate-per-token-loss makes the loss and gradients identical to CP=1. SAP needs no attention
# mask: --no-create-attention-mask-in-dataloader keeps the loader from building an S x S one (64 GiB
# per sample at 128K tokens); the launcher hooks turn it off too.
# Optional: SAVE_DIR (checkpoints every SAVE_INTERVAL iterations, resumed from there),
# EXIT_MINUTES (stop and save before the job's time limit), and SAP_CALIBRATION_FILE (rates
# measured by scripts/gpu_check.sh on your GPUs, docs/calibration.json, instead of the
# SAP_COST_PRESET preset).

: "${SEQ_LENGTH:=131072}"          # tokens per packed row (Megatron wants it divisible by 2 * CP)
: "${TP:=2}"                       # tensor parallel size
: "${PP:=1}"                       # pipeline stages (any number; the middle ones get each row's documents from the first)
: "${SAP_INNER:=4}"                # SAP inner level U (TP*U GPUs must sit on one node)
: "${SAP_OUTER:=4}"                # SAP outer level R
: "${GLOBAL_BATCH:=16}"
: "${TRAIN_ITERS:=1000}"
: "${DATA_PATH:?set DATA_PATH to a Megatron .bin/.idx prefix (tools/preprocess_data.py output), or a blend: weight prefix weight prefix ...}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a Hugging Face tokenizer directory or name}"
: "${SAP_COST_PRESET:=h100}"
: "${SAP_LOG_INTERVAL:=100}"       # a line about SAP's plans in the log every so many micro-batches (0: none)
: "${SAP_CHOOSE_BY:=estimate}"    # timeline: time the near candidate plans (better plans, more planning in the loader workers)

CP=$((SAP_INNER * SAP_OUTER))
read -r -a DATA_PATHS <<< "$DATA_PATH"  # one prefix, or Megatron's blend "0.7 /data/a 0.3 /data/b" (no spaces in paths)

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
    --transformer-impl transformer_engine --bf16
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP" --hierarchical-context-parallel-sizes "$SAP_INNER" "$SAP_OUTER"
    --cp-comm-type sap
    --use-distributed-optimizer --overlap-grad-reduce
)

SAP_ARGS=(
    --sap-inner-size "$SAP_INNER" --sap-outer-size "$SAP_OUTER" --sap-backend auto
    --sap-log-interval "$SAP_LOG_INTERVAL" --sap-choose-by "$SAP_CHOOSE_BY"
)
if [[ -n "${SAP_CALIBRATION_FILE:-}" ]]; then
    SAP_ARGS+=(--sap-calibration-file "$SAP_CALIBRATION_FILE")
else
    SAP_ARGS+=(--sap-cost-preset "$SAP_COST_PRESET")
fi

DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}" --split 100,0,0
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --reset-position-ids --reset-attention-mask --eod-mask-loss --calculate-per-token-loss --no-create-attention-mask-in-dataloader
    --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH"
)

TRAIN_ARGS=(
    --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --log-interval 1 --eval-iters 0 --eval-interval "$TRAIN_ITERS" --distributed-timeout-minutes 30
    ${SAVE_DIR:+--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-200}"}
    ${EXIT_MINUTES:+--exit-duration-in-mins "$EXIT_MINUTES"}
)

SAP_TRAINING_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${SAP_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}")
