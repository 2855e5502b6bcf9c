#!/usr/bin/env bash
# GRPO on Qwen3-0.6B with a rule-based math reward, on one node of 8 GPUs.
#
#   bash scripts/run-qwen3-0.6B.sh             # fsdp2 backend (default)
#   bash scripts/run-qwen3-0.6B.sh megatron    # megatron backend (or BACKEND=megatron)
#
# Both backends train the same run: same rollouts, same loss, same schedule; only the
# sharding differs. Training and rollout are colocated: the 8 GPUs hold the training
# ranks and 8 single-GPU vLLM engines, which sleep in turn.
#
# Environment (defaults in brackets):
#   HF_CHECKPOINT  local HF folder of Qwen/Qwen3-0.6B [/root/models/Qwen3-0.6B]
#   PROMPT_DATA    jsonl with a "prompt" and a "label" (final answer) field per row
#                  [/root/data/dapo-math-17k.jsonl]
#   SAVE_DIR       checkpoints; a rerun resumes from the latest one [/root/ckpt/...]
#   OUTPUT_DIR     metrics.jsonl, plots, TensorBoard events [runs/qwen3-0.6B-grpo-BACKEND]
#   DRY_RUN=1      print the command, one argument a line, instead of running it
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=models/qwen3-0.6B.sh
source "${SCRIPT_DIR}/models/qwen3-0.6B.sh"

BACKEND="${1:-${BACKEND:-fsdp2}}"
HF_CHECKPOINT="${HF_CHECKPOINT:-/root/models/Qwen3-0.6B}"
PROMPT_DATA="${PROMPT_DATA:-/root/data/dapo-math-17k.jsonl}"
SAVE_DIR="${SAVE_DIR:-/root/ckpt/qwen3-0.6B-grpo-${BACKEND}}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/qwen3-0.6B-grpo-${BACKEND}}"

CLUSTER_ARGS=(
    --actor-num-nodes 1
    --actor-num-gpus-per-node 8
    --colocate
    --rollout-num-gpus-per-engine 1
)

DATA_ARGS=(
    --hf-checkpoint "${HF_CHECKPOINT}"
    --prompt-data "${PROMPT_DATA}"
    --input-key prompt
    --label-key label
    --apply-chat-template
    --num-rollout 300
    --seed 1234
)

# 32 prompts x 8 samples = 256 completions a rollout, trained in one optimizer step
# (so the old-policy log-probs equal the current ones and are not recomputed).
ROLLOUT_ARGS=(
    --rm-type math
    --rollout-batch-size 32
    --n-samples-per-prompt 8
    --rollout-max-prompt-len 1024
    --rollout-max-response-len 4096
    --rollout-temperature 1.0
    --rollout-top-p 1.0
)

ALGO_ARGS=(
    --advantage-estimator grpo
    --use-kl-loss
    --kl-loss-coef 0.001
    --kl-loss-type low_var_kl
    --entropy-coef 0
    --eps-clip 0.2
    --eps-clip-high 0.28
    --loss-agg-mode token-mean
    --global-batch-size 256
    # Rows packed by tokens: the cap fits one longest prompt + response with room to share.
    --use-dynamic-batch-size
    --max-tokens-per-gpu 10240
)

OPTIMIZER_ARGS=(
    --lr 1e-6
    --lr-decay-style constant
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.98
    --clip-grad 1.0
)

CHECKPOINT_ARGS=(
    --save "${SAVE_DIR}"
    --load "${SAVE_DIR}"
    --save-interval 20
    --keep-last-checkpoints 3
)

LOG_ARGS=(
    --output-dir "${OUTPUT_DIR}"
    --use-tensorboard
)

case "${BACKEND}" in
    fsdp2)
        # Full sharding leaves the memory to activations of 10k-token rows, which
        # recomputation keeps affordable; fp32 gradient reduction as in the megatron run.
        BACKEND_ARGS=(
            --fsdp-mode full
            --fsdp-param-dtype bfloat16
            --fsdp-reduce-dtype float32
            --gradient-checkpointing
        )
        ;;
    megatron)
        # No tensor/pipeline split at this size: all 8 ranks are data-parallel, as with fsdp2,
        # and each keeps the AdamW state of an eighth of the parameters.
        BACKEND_ARGS=(
            --megatron-tensor-parallel-size 1
            --megatron-pipeline-parallel-size 1
            --megatron-use-distributed-optimizer
            --megatron-recompute-granularity full
        )
        ;;
    *)
        echo "usage: $0 [fsdp2|megatron]  (got backend '${BACKEND}')" >&2
        exit 2
        ;;
esac

CMD=(
    vime-train
    --train-backend "${BACKEND}"
    "${MODEL_ARGS[@]}"
    "${CLUSTER_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${ROLLOUT_ARGS[@]}"
    "${ALGO_ARGS[@]}"
    "${OPTIMIZER_ARGS[@]}"
    "${CHECKPOINT_ARGS[@]}"
    "${LOG_ARGS[@]}"
    "${BACKEND_ARGS[@]}"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s\n' "${CMD[@]}"
    exit 0
fi
exec "${CMD[@]}"
