# qwen2.5-1.5B: architecture flags matching Qwen/Qwen2.5-1.5B (and -Instruct) config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# QKV projections carry a bias; vime reads that from config.json (no flag). Tied embeddings.
# Usage: source scripts/models/qwen2.5-1.5B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 1536
    --ffn-hidden-size 8960
    --num-attention-heads 12
    --num-query-groups 2
    --kv-channels 128
    --vocab-size 151936
    --rotary-base 1000000
    --norm-epsilon 1e-6
    --no-qk-layernorm
    --no-untie-embeddings-and-output-weights
)
