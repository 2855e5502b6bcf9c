"""Configuration parsing in-process: derived settings, read-only config, and choices.

Proves that the global batch size and the number of optimizer steps are derived
from each other consistently, that the data-parallel size follows the backend
(world / (TP x PP) for megatron), that --load may name the --save folder before
it exists (auto-resume), that the parsed Config refuses writes, and that the
choices the CLI offers are exactly the ones ``vime.algo`` implements.
"""

from __future__ import annotations

import pytest

from vime.config import ConfigError, parse_args
from vime.config import flags as common_flags


def test_global_batch_size_defaults_to_whole_rollout() -> None:
    cfg = parse_args(["--rollout-batch-size", "4", "--n-samples-per-prompt", "3"])
    assert cfg.global_batch_size == 12
    assert cfg.num_steps_per_rollout == 1


def test_steps_per_rollout_derive_global_batch_size() -> None:
    cfg = parse_args(
        ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "4"]
    )
    assert cfg.global_batch_size == 4


def test_global_batch_size_derives_steps() -> None:
    cfg = parse_args(
        ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8"]
    )
    assert cfg.num_steps_per_rollout == 2


def test_megatron_data_parallel_size() -> None:
    cfg = parse_args(
        [
            "--train-backend",
            "megatron",
            "--actor-num-gpus-per-node",
            "8",
            "--megatron-tensor-parallel-size",
            "4",
        ]
    )
    assert cfg.data_parallel_size == 2
    assert cfg.megatron_tensor_parallel_size == 4


def test_fsdp2_hybrid_keeps_every_rank_data_parallel() -> None:
    cfg = parse_args(
        [
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "4",
            "--fsdp-mode",
            "hybrid",
            "--fsdp-shard-size",
            "4",
        ]
    )
    assert cfg.data_parallel_size == 8


def test_load_may_name_save_folder_before_first_checkpoint(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    cfg = parse_args(["--save", ckpt, "--load", ckpt])
    assert cfg.load == ckpt
    with pytest.raises(ConfigError, match="no such directory"):
        parse_args(["--load", ckpt])


def test_kl_type_defaults_when_kl_is_on() -> None:
    assert parse_args(["--use-kl-loss"]).kl_loss_type == "low_var_kl"
    assert parse_args([]).kl_loss_type is None


def test_config_is_read_only() -> None:
    cfg = parse_args([])
    with pytest.raises(AttributeError, match="read-only"):
        cfg.lr = 1.0


def test_builtin_prompt_data_needs_no_file() -> None:
    assert parse_args(["--prompt-data", "builtin:reverse"]).prompt_data == "builtin:reverse"


def test_cli_choices_match_algo() -> None:
    algo = pytest.importorskip("vime.algo")
    assert common_flags.ADVANTAGE_ESTIMATORS == algo.ADVANTAGE_ESTIMATORS
    assert common_flags.KL_TYPES == algo.KL_TYPES
    assert common_flags.AGGREGATION_MODES == algo.AGGREGATION_MODES
