# qwen2.5-7B: architecture flags matching Qwen/Qwen2.5-7B (and -Instruct) config.json.
# vime builds the model from --hf-checkpoint's config.json and checks these flags
# against it at start-up, so a recipe pointed at the wrong checkpoint fails at once.
# QKV projections carry a bias; vime reads that from config.json (no flag). Untied embeddings;
# vocab 152064 (padded), unlike the 151936 of the smaller Qwen2.5 models.
# Usage: source scripts/models/qwen2.5-7B.sh; vime-train "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 3584
    --ffn-hidden-size 18944
    --num-attention-heads 28
    --num-query-groups 4
    --kv-channels 128
    --vocab-size 152064
    --rotary-base 1000000
    --norm-epsilon 1e-6
    --untie-embeddings-and-output-weights
    --no-qk-layernorm
)
