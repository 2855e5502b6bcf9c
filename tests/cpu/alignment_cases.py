"""Random fsdp2-vs-megatron alignment cases for ``test_alignment_sampled.py``, one per seed.

``draw(seed)`` picks a tiny model (architecture family, tied or untied embeddings, GQA
ratio, head_dim, norm eps, RoPE, the pad id) and a run's flags (advantage estimator,
every loss-flag family, aggregation, batching into several optimizer steps, multi-turn
samples from ``agent``); ``write_case`` writes what the run reads: an HF folder with a
character tokenizer, the prompts, and this file as the reward / agent / custom-loss
module. ``DRAWN_FLAGS`` / ``EXCLUDED_FLAGS`` and ``DRAWN_MODEL_FIELDS`` /
``EXCLUDED_MODEL_FIELDS`` are what the guard tests compare with the algorithm flags
and with the HF config fields the megatron backend reads.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.algo import policy_loss
from vime.models.embedded import EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID
from vime.rollout.agent import Trajectory

BOS_ID = SPECIAL_TOKENS.index("<bos>")
SPECIAL_IDS = frozenset(range(len(SPECIAL_TOKENS)))
DIGITS = "0123456789"
EXTRA_CHARS = "+-=*/()<>abcdefghijklmnopqrstuvwxyz"
# Environment tokens the agent writes between model turns: special ids among them.
ENV_IDS = (PAD_ID, 5, UNK_ID, BOS_ID)

# Algorithm flags a case draws (every one appears in some seed's flags: the guard test).
DRAWN_FLAGS = {
    "--advantage-estimator",
    "--custom-loss-function-path",
    "--eps-clip",
    "--eps-clip-high",
    "--eps-clip-c",
    "--policy-loss-level",
    "--use-kl-loss",
    "--kl-loss-coef",
    "--kl-loss-type",
    "--entropy-coef",
    "--loss-agg-mode",
    "--loss-agg-norm-len",
    "--use-tis",
    "--no-use-tis",
    "--tis-level",
    "--tis-mode",
    "--tis-clip",
    "--tis-clip-low",
    "--global-batch-size",
    "--shuffle-updates",
    "--micro-batch-size",
    "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
}
# Algorithm flags no case draws, and why they cannot tell the backends apart.
EXCLUDED_FLAGS = {
    # Runs on the driver before the batch is split; both backends get its advantages.
    "--custom-advantage-function-path",
    # Another way to say --global-batch-size (rollout / steps), which is drawn.
    "--num-steps-per-rollout",
}
# HF config fields the megatron backend reads that a case draws.
DRAWN_MODEL_FIELDS = {
    "model_type",  # qwen3 (qk-norm), qwen2 (qkv bias), llama (neither)
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_parameters",  # rope_theta, and llama3 scaling for llama
    "rope_theta",
    "max_position_embeddings",
    "pad_token_id",
}
# Fields the megatron backend reads that no case draws, and why.
EXCLUDED_MODEL_FIELDS = {
    # Refused by check_architecture unless at the default every case keeps.
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "num_experts",
    "num_local_experts",
    "partial_rotary_factor",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    # Dropout draws its masks per backend: runs are comparable only at 0 (every case).
    "attention_dropout",
    # Megatron's random init, which the loaded checkpoint overwrites.
    "initializer_range",
    # The older name of rope_parameters (transformers 5 writes rope_parameters; drawn).
    "rope_scaling",
}
# test_backend_losses.py's learning rate, at which its weight tolerance (5e-5) holds. At
# 3e-2 Adam's first steps turn fp32 summation-order noise in gradient elements near its
# eps (1e-8) into weight differences of ~lr/100: seed 241 (Qwen2, one step) has the same
# loss, grad norm and metrics to every printed digit, yet a k_proj.bias element (a key
# bias moves a query's scores almost alike: its gradient is nearly 0) differs by 1.1e-4.
LR = 1e-3
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,  # the one megatron-core reproduces
}


@dataclass(frozen=True)
class Case:
    """One seed's model and run."""

    seed: int
    model: dict[str, Any]  # HF config fields
    charset: str
    eos_scale: float  # the EOS head row scaled by this (more responses end by EOS)
    multiturn: bool
    flags: list[str] = field(default_factory=list)  # everything but paths and backend

    def describe(self) -> str:
        m = self.model
        arch = (
            f"{m['model_type']} tie={m['tie_word_embeddings']} heads={m['num_attention_heads']}"
            f"/{m['num_key_value_heads']} head_dim={m['head_dim']} hidden={m['hidden_size']} "
            f"vocab={m['vocab_size']} pad={m['pad_token_id']}"
        )
        return f"seed {self.seed}: {arch} multiturn={self.multiturn} {' '.join(self.flags)}"


def draw(seed: int) -> Case:
    """The case of ``seed``: every choice from one ``random.Random(seed)``."""
    rng = random.Random(seed)
    charset = DIGITS + EXTRA_CHARS[: rng.randint(2, len(EXTRA_CHARS))]
    model_type = rng.choice(["qwen3", "qwen2", "llama"])
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 4])
    hidden = rng.choice([64, 96, 128])
    head_dim = rng.choice([32, 48])  # vs hidden / heads: equal only by chance
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rng.choice([1e4, 1e6])}
    llama3 = model_type == "llama" and rng.random() < 0.5
    if llama3:
        rope = {**LLAMA3_ROPE, "rope_theta": 5e5}
    model = {
        "model_type": model_type,
        "vocab_size": len(SPECIAL_TOKENS) + len(charset),
        "hidden_size": hidden,
        "intermediate_size": rng.choice([96, 192]),
        "num_hidden_layers": rng.choice([1, 2]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": rng.random() < 0.5,
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "rope_parameters": rope,
        # Past llama3's original 8192 (transformers warns otherwise).
        "max_position_embeddings": rng.choice([128, 256]) * (128 if llama3 else 1),
        "pad_token_id": PAD_ID if rng.random() < 0.8 else None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    n = rng.choice([2, 4])
    prompts = rng.choice([2, 3, 4])
    total = n * prompts
    steps = rng.choice([d for d in (1, 2, 3, 4) if total % d == 0])
    flags = ["--rollout-batch-size", str(prompts), "--n-samples-per-prompt", str(n)]
    flags += ["--global-batch-size", str(total // steps)]
    flags += ["--rollout-max-response-len", str(rng.randint(4, 8))]
    flags += ["--rollout-temperature", str(rng.choice([1.0, 0.8]))]
    flags += ["--lr", str(LR), "--seed", str(seed)]
    flags += ["--weight-decay", str(rng.choice([0.0, 0.1]))]
    if rng.random() < 0.5:
        flags += ["--shuffle-updates"]
    if rng.random() < 0.5:
        flags += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(rng.choice([32, 64]))]
    else:
        flags += ["--micro-batch-size", str(rng.choice([1, 2, 4]))]
    flags += _loss_flags(rng)
    eos_scale, multiturn = rng.choice([1.0, 4.0, 8.0]), rng.random() < 0.4
    # Drawn last, so that every earlier draw of a seed is what it was before the flag.
    flags += ["--lm-head-tail", rng.choice(["logits", "fused"])]
    return Case(seed, model, charset, eos_scale, multiturn, flags)


def _loss_flags(rng: random.Random) -> list[str]:
    flags = ["--advantage-estimator", rng.choice(ADVANTAGE_ESTIMATORS)]
    flags += ["--eps-clip", str(rng.choice([0.1, 0.2, 0.3]))]
    if rng.random() < 0.4:
        flags += ["--eps-clip-high", str(rng.choice([0.25, 0.4]))]
    if rng.random() < 0.4:
        flags += ["--eps-clip-c", str(rng.choice([1.5, 3.0]))]
    if rng.random() < 0.3:
        flags += ["--policy-loss-level", "sequence"]  # GSPO
    mode = rng.choice(AGGREGATION_MODES)
    flags += ["--loss-agg-mode", mode]
    if mode == "seq-mean-token-sum-norm" and rng.random() < 0.5:
        flags += ["--loss-agg-norm-len", str(rng.randint(4, 12))]
    if rng.random() < 0.8:
        flags += ["--use-kl-loss", "--kl-loss-coef", str(rng.choice([0.1, 0.5]))]
        flags += ["--kl-loss-type", rng.choice(KL_TYPES)]
    if rng.random() < 0.7:
        flags += ["--entropy-coef", str(rng.choice([0.01, 0.05]))]
    if rng.random() < 0.6:
        tis_mode = rng.choice(CORRECTION_MODES)
        flags += ["--use-tis", "--tis-level", rng.choice(CORRECTION_LEVELS)]
        flags += ["--tis-mode", tis_mode, "--tis-clip", str(rng.choice([1.2, 2.0]))]
        if tis_mode == "mask" and rng.random() < 0.5:
            flags += ["--tis-clip-low", str(rng.choice([0.5, 0.8]))]
    elif rng.random() < 0.3:
        flags += ["--no-use-tis"]  # at --max-staleness 0 the same as leaving it out
    if rng.random() < 0.25:
        flags += ["--custom-loss-function-path", "CUSTOM_LOSS"]
    return flags


# Imported late in spirit: the choices are the parser's own, so a new choice is drawn.
from vime.config.algo_flags import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_TYPES,
)


def write_case(case: Case, folder: Path) -> dict[str, str]:
    """The HF folder, prompts and hooks of ``case`` under ``folder``; returns their paths."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from vime.models.embedded import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    model_dir = folder / "model"
    fields = dict(case.model)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(case.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS_ID] *= case.eos_scale
    model.save_pretrained(model_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(
        model_dir
    )
    build_tokenizer(case.charset).save_pretrained(model_dir)
    rng = random.Random(case.seed)
    rows = []
    for _ in range(16):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(model_dir), "prompts": str(prompts), "hooks": __file__}


def case_flags(case: Case, hooks: str = __file__) -> list[str]:
    """The case's own flags, its hooks (custom loss, agent) in ``hooks``."""
    flags = [f"{hooks}:custom_loss" if f == "CUSTOM_LOSS" else f for f in case.flags]
    if case.multiturn:
        flags += ["--custom-generate-function-path", f"{hooks}:agent"]
    return flags


def argv(case: Case, paths: dict[str, str], backend: str, output_dir: str) -> list[str]:
    """``vime-train``'s flags for ``case`` on ``backend``."""
    hooks = paths["hooks"]
    flags = case_flags(case, hooks)
    flags += ["--train-backend", backend, "--hf-checkpoint", paths["model"]]
    flags += ["--prompt-data", paths["prompts"], "--custom-rm-path", f"{hooks}:reward"]
    flags += ["--rollout-engine", "hf", "--num-rollout", "1", "--output-dir", output_dir]
    flags += ["--actor-num-gpus-per-node", "1", "--rollout-max-prompt-len", "8"]
    return flags


def reward(args: Any, sample: Any) -> float:
    """A reward with spread within a group: a hash of the whole response text."""
    return (sum(map(ord, sample.trajectory)) % 7) / 6.0


async def agent(sample: Any, engine: Any) -> Trajectory:
    """Two model turns with environment tokens (mask 0, special ids among them) between,
    and after the second when it was cut: loss masks with holes."""
    traj = Trajectory()
    first = await engine.generate(sample.prompt_ids, max_new_tokens=2)
    traj.add_turn(first)
    traj.add_env(ENV_IDS[: 2 + sample.sample_index % 3])
    rest = engine.room(sample.prompt_ids + traj.response_ids)
    if rest > 0:
        second = await engine.generate(sample.prompt_ids + traj.response_ids)
        traj.add_turn(second)
        if second.finish_reason == "length" and sample.sample_index % 2:
            traj.add_env(ENV_IDS[:1])  # ends on environment tokens
    return traj


def custom_loss(logp, old_logp, advantages, mask, **kwargs):
    """A custom policy loss (``--custom-loss-function-path``): 0.75 times the built-in."""
    loss, stats = policy_loss(logp, old_logp, advantages, mask, **kwargs)
    return 0.75 * loss, stats
