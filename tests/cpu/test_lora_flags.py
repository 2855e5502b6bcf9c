"""``--lora-*`` flags: they reach ``LoraSettings``, and bad ones are one line.

Proves: every flag lands in the settings (rank, alpha -> scale, dropout, targets,
merge-on-sync, modules to save); the default targets are every linear projection of a
decoder block; a backend without LoRA (megatron) is refused naming it and fsdp2; LoRA
flags without ``--lora-rank`` and out-of-range values are refused, and so is
``--vllm-lora on`` where vLLM's LoRA cannot serve the run (the hf engine, a rank
past vLLM's, syncs of whole weights).
"""

from __future__ import annotations

import pytest

from vime.config import ConfigError, parse_args
from vime.config.train_settings import lora_settings
from vime.weights.lora import LoraSettings

BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]


def test_flags_reach_the_settings() -> None:
    args = parse_args(
        [
            *BASE,
            "--lora-rank",
            "8",
            "--lora-alpha",
            "4",
            "--lora-dropout",
            "0.1",
            "--lora-target-modules",
            "q_proj, v_proj",
            "--lora-merge-on-sync",
            "--lora-modules-to-save",
            "norm",
        ]
    )
    settings = lora_settings(args)
    assert settings == LoraSettings(8, 4.0, 0.1, ("q_proj", "v_proj"), True, ("norm",))
    assert settings.enabled and settings.scale == 0.5
    default = lora_settings(parse_args(BASE))
    assert not default.enabled
    assert default.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--train-backend", "megatron", "--lora-rank", "4"],
            "the megatron backend does not train LoRA adapters; use --train-backend fsdp2",
        ),
        (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R"),
        (["--lora-merge-on-sync"], "--lora-merge-on-sync needs --lora-rank R"),
        (["--lora-modules-to-save", "norm"], "--lora-modules-to-save needs --lora-rank R"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
        (["--vllm-lora", "off"], "--vllm-lora needs --lora-rank R"),
        (
            ["--lora-rank", "4", "--vllm-lora", "on", "--rollout-engine", "hf"],
            "--vllm-lora on needs --rollout-engine vllm",
        ),
        (
            ["--lora-rank", "1024", "--vllm-lora", "on"],
            "vLLM serves LoRA ranks up to 512, not 1024; use --vllm-lora off",
        ),
        (
            ["--lora-rank", "4", "--vllm-lora", "on", "--weight-sync", "disk"],
            "--vllm-lora on: vLLM's LoRA serves adapters alone, and --weight-sync disk sends",
        ),
        (
            ["--lora-rank", "4", "--vllm-lora", "on", "--lora-modules-to-save", "norm"],
            "and --lora-modules-to-save sends the engines whole weights; drop one of the two",
        ),
    ],
)
def test_bad_lora_flags_are_one_line(flags, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *flags])
    assert message in str(err.value) and "\n" not in str(err.value)
