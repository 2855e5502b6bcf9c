# qwen3-8B: architecture flags matching Qwen/Qwen3-8B config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# Untied embeddings (separate lm_head).
# Usage: source scripts/models/qwen3-8B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 36
    --hidden-size 4096
    --ffn-hidden-size 12288
    --num-attention-heads 32
    --num-query-groups 8
    --kv-channels 128
    --vocab-size 151936
    --rotary-base 1000000
    --norm-epsilon 1e-6
    --qk-layernorm
    --untie-embeddings-and-output-weights
)
