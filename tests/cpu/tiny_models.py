"""Tiny random model configs shared by the CPU tests (no hub: everything built from a config).

Same shape everywhere: 2 layers, hidden 64, 2 query heads over 1 KV head of
head_dim 32 (vLLM's CPU attention needs head_dim >= 32).
"""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# Llama 3.1's RoPE scaling, the one llama3 variant megatron-core reproduces.
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def tiny_qwen3_config(
    vocab_size: int = 64, *, tie: bool = False, pad: int | None = None
) -> Qwen3Config:
    """``pad``: the config's pad_token_id, HF's embedding ``padding_idx`` (its row is
    initialised to zero and gets no gradient through the lookup)."""
    return Qwen3Config(
        vocab_size=vocab_size, head_dim=32, tie_word_embeddings=tie, pad_token_id=pad, **SHAPE
    )


def tiny_llama_config(vocab_size: int = 64, *, tie: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=tie, **SHAPE)


def tiny_qwen2_config(vocab_size: int = 64) -> Qwen2Config:
    """Qwen2: biases on the q/k/v projections (Qwen3 and Llama have none)."""
    return Qwen2Config(vocab_size=vocab_size, **SHAPE)


def save_tiny(path: str, config: PretrainedConfig, seed: int) -> str:
    """Write a randomly initialised model of ``config`` as an HF folder at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)
