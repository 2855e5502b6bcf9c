# qwen3-1.7B: architecture flags matching Qwen/Qwen3-1.7B config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# Tied embeddings.
# Usage: source scripts/models/qwen3-1.7B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 16
    --num-query-groups 8
    --kv-channels 128
    --vocab-size 151936
    --rotary-base 1000000
    --norm-epsilon 1e-6
    --qk-layernorm
    --no-untie-embeddings-and-output-weights
)
