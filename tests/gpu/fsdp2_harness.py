"""What the fsdp2 GPU tests share: a random Qwen3 on disk, the actor's flags, a rollout.

Imported inside the tests' functions' modules only; nothing here touches CUDA, so the
modules still import on a CPU-only machine (``conftest.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

VOCAB = 512


def write_qwen3(path: Path, *, hidden: int, intermediate: int, layers: int, heads: int) -> str:
    """A random Qwen3 (seed 0, head_dim 64, half as many key/value heads) saved at ``path``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def fsdp2_args(hf: str, *extra: str) -> Any:
    """One GPU, bf16 compute, 8 samples a rollout; ``extra`` flags win over these."""
    from vime.config import parse_args

    return parse_args(
        [
            *("--hf-checkpoint", hf, "--prompt-data", "builtin:reverse"),
            *("--actor-num-gpus-per-node", "1", "--fsdp-param-dtype", "bfloat16"),
            *("--rollout-batch-size", "4", "--n-samples-per-prompt", "2"),
            *("--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3"),
            *extra,
        ]
    )


def random_batch(rollout_id: int) -> Any:
    """8 samples of random tokens: prompts of 4-12, responses of 8-40, random advantages."""
    from vime.data.batch import RolloutBatch

    rng = random.Random(rollout_id)
    tokens, prompts, masks = [], [], []
    for _ in range(8):
        p, r = rng.randint(4, 12), rng.randint(8, 40)
        tokens.append([rng.randrange(VOCAB) for _ in range(p + r)])
        prompts.append(p)
        masks.append([1] * r)
    adv = [rng.gauss(0, 1) for _ in range(8)]
    return RolloutBatch(tokens=tokens, prompt_lengths=prompts, loss_masks=masks, advantages=adv)
