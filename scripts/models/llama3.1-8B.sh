# llama3.1-8B: architecture flags matching meta-llama/Llama-3.1-8B (and -Instruct) config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# Untied embeddings. The llama3 rope_scaling (factor 8) comes from config.json (no flag).
# Usage: source scripts/models/llama3.1-8B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --num-query-groups 8
    --kv-channels 128
    --vocab-size 128256
    --rotary-base 500000
    --norm-epsilon 1e-5
    --untie-embeddings-and-output-weights
    --no-qk-layernorm
)
