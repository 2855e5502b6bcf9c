# qwen3-4B: architecture flags matching Qwen/Qwen3-4B config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# head_dim 128 is set explicitly (32 x 128 = 4096 != hidden 2560); tied embeddings.
# Usage: source scripts/models/qwen3-4B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 36
    --hidden-size 2560
    --ffn-hidden-size 9728
    --num-attention-heads 32
    --num-query-groups 8
    --kv-channels 128
    --vocab-size 151936
    --rotary-base 1000000
    --norm-epsilon 1e-6
    --qk-layernorm
    --no-untie-embeddings-and-output-weights
)
