# llama3.2-1B: architecture flags matching meta-llama/Llama-3.2-1B (and -Instruct) config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# Tied embeddings. The llama3 rope_scaling (factor 32) comes from config.json (no flag).
# Usage: source scripts/models/llama3.2-1B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 32
    --num-query-groups 8
    --kv-channels 64
    --vocab-size 128256
    --rotary-base 500000
    --norm-epsilon 1e-5
    --no-qk-layernorm
    --no-untie-embeddings-and-output-weights
)
