"""Configuration parsing in-process: derived settings, read-only config, and choices.

Proves that the global batch size and the number of optimizer steps are derived
from each other consistently, that the data-parallel size follows the backend
(world / (TP x PP) for megatron), that --load may name the --save folder before
it exists (auto-resume), that the parsed Config refuses writes, and that the
choices the CLI offers are exactly the ones ``vime.algo`` implements. Also that
the embedded default's eval set is the eval split of the built-in task it trains
on (none for a user's own file), that a run's configuration needs --prompt-data
with --hf-checkpoint, and that the megatron backend's architecture rules judge the
checkpoint's raw config.json while the flags are parsed (unsupported model type,
activation, sliding windows, a TP size that does not split the KV heads or the MLP)
and agree with their verdict on the transformers config the actor loads. And that a run
joining a Ray cluster is not refused for what its driver lacks (CUDA, TransformerEngine,
flash-attn), while GPU-only flags are refused once the joined cluster has no GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tiny_models import LLAMA31_ROPE

from vime.backends.megatron.flags import check_architecture
from vime.config import ConfigError, algo_flags, parse_args


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
            "2",
        ]
    )
    # TP 2: the embedded default trained here has 2 KV heads, so TP 4 could not split it.
    assert cfg.data_parallel_size == 4
    assert cfg.megatron_tensor_parallel_size == 2


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
    assert algo_flags.ADVANTAGE_ESTIMATORS == algo.ADVANTAGE_ESTIMATORS
    assert algo_flags.KL_TYPES == algo.KL_TYPES
    assert algo_flags.AGGREGATION_MODES == algo.AGGREGATION_MODES
    from vime.algo import correction, losses

    assert algo_flags.POLICY_LOSS_LEVELS == losses.POLICY_LOSS_LEVELS
    assert algo_flags.CORRECTION_LEVELS == correction.CORRECTION_LEVELS
    assert algo_flags.CORRECTION_MODES == correction.CORRECTION_MODES


def test_embedded_eval_follows_the_training_task(tmp_path) -> None:
    default = parse_args([])
    assert (default.eval_prompt_data, default.eval_interval) == ("builtin:reverse:eval", 20)
    add = parse_args(["--prompt-data", "builtin:add"])
    assert (add.eval_prompt_data, add.eval_interval) == ("builtin:add:eval", 20)
    assert parse_args(["--prompt-data", "builtin:add", "--eval-interval", "5"]).eval_interval == 5
    # A user's own prompt file: no built-in task's eval split is scored against it.
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    own = parse_args(["--prompt-data", str(data), "--rm-type", "exact"])
    assert (own.eval_prompt_data, own.eval_interval) == (None, None)
    # With a checkpoint nothing is defaulted.
    real = parse_args(["--hf-checkpoint", str(tmp_path), "--prompt-data", "builtin:add"])
    assert (real.eval_prompt_data, real.eval_interval) == (None, None)


def test_a_run_needs_prompt_data_with_a_checkpoint(tmp_path) -> None:
    # A configuration for one part (a train actor) need not name prompts...
    assert parse_args(["--hf-checkpoint", str(tmp_path)]).prompt_data is None
    # ...a whole run does.
    with pytest.raises(ConfigError, match="--prompt-data is required with --hf-checkpoint"):
        parse_args(["--hf-checkpoint", str(tmp_path)], for_run=True)
    assert parse_args([], for_run=True).prompt_data == "builtin:reverse"


QWEN3 = {
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "hidden_act": "silu",
}


def _megatron(tmp_path: Path, config: dict[str, Any], tp: int) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return parse_args(
        [
            "--train-backend",
            "megatron",
            "--hf-checkpoint",
            str(tmp_path),
            "--prompt-data",
            "builtin:add",
            "--actor-num-gpus-per-node",
            str(tp),
            "--megatron-tensor-parallel-size",
            str(tp),
        ]
    )


@pytest.mark.parametrize(
    ("changes", "tp", "message"),
    [
        ({"model_type": "gemma3_text"}, 1, "unsupported model_type 'gemma3_text'"),
        ({"num_key_value_heads": 1}, 2, "tensor-parallel size 2 .* must divide the 1 KV heads"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, 2, "must divide the 3 KV heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, 1, "6 attention heads not div"),
        ({"intermediate_size": 97}, 2, "must divide intermediate_size 97"),
        ({"hidden_act": "gelu"}, 1, "hidden_act 'gelu'"),
        ({"num_experts": 8}, 1, "mixture-of-experts"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, 1, "sliding-window layers"),
        (
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
            1,
            "sliding-window attention",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 1, "rope scaling type 'yarn'"),
    ],
)
def test_megatron_architecture_is_checked_at_parse_time(
    tmp_path: Path, changes: dict[str, Any], tp: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _megatron(tmp_path, {**QWEN3, **changes}, tp)
    assert str(err.value).startswith(f"{tmp_path}: megatron backend: unsupported")


def test_megatron_parse_accepts_what_it_can_split(tmp_path: Path) -> None:
    assert _megatron(tmp_path, QWEN3, 2).megatron_tensor_parallel_size == 2
    # Qwen2's flag alone makes no sliding layer when they would all start past the last one.
    late = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert _megatron(tmp_path, {**QWEN3, "model_type": "qwen2", **late}, 1).data_parallel_size == 1
    # Not an HF config at all: the model loader reports it, not the parser.
    assert _megatron(tmp_path, {"num_hidden_layers": 2}, 2).data_parallel_size == 1


def _verdict(config: Any, tp: int) -> str:
    """The RoPE settings of an accepted config, or the reason it is refused."""
    try:
        return repr(check_architecture(config, tp))
    except ValueError as err:
        return f"refused: {err}"


@pytest.mark.parametrize(
    ("cls", "kwargs", "tp"),
    [
        ("Qwen3Config", {"num_attention_heads": 4, "num_key_value_heads": 2}, 2),
        ("Qwen3Config", {"num_attention_heads": 4, "num_key_value_heads": 1}, 2),
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 16}, 1),
        (
            "Qwen2Config",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
            1,
        ),
        ("LlamaConfig", {"hidden_act": "gelu"}, 1),
        (
            "LlamaConfig",
            {
                "rope_parameters": dict(LLAMA31_ROPE),
                "max_position_embeddings": 16384,
            },
            1,
        ),
    ],
)
def test_raw_config_json_gets_the_actors_verdict(cls: str, kwargs: dict, tp: int) -> None:
    """What the parser reads (config.json, also as an older transformers wrote it, without
    layer_types) is judged as the actor judges the loaded transformers config."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, cls)(num_hidden_layers=2, intermediate_size=96, **kwargs)
    raw = json.loads(config.to_json_string())
    loaded = _verdict(config, tp)
    assert _verdict(SimpleNamespace(**raw), tp) == loaded
    # Without layer_types the reason is worded from the flag; the verdict is the same.
    raw.pop("layer_types", None)
    older = _verdict(SimpleNamespace(**raw), tp)
    assert older.startswith("refused") if loaded.startswith("refused") else older == loaded


GPU_ONLY = {
    "cuda-ipc": ["--colocate", "--weight-sync", "cuda-ipc"],
    "tensor-parallel engines": ["--rollout-engine", "vllm", "--rollout-num-gpus-per-engine", "2"],
    "transformer engine": [
        *("--train-backend", "megatron", "--megatron-transformer-impl", "transformer_engine"),
    ],
    "flash attention": ["--attn-implementation", "flash_attention_2"],
}


@pytest.mark.parametrize("what", sorted(GPU_ONLY))
def test_a_run_joining_a_cluster_leaves_device_checks_to_the_cluster(
    what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This driver's lacks (no CUDA, no TransformerEngine, no flash-attn) refuse a local
    run while parsing, but not a run that joins a Ray cluster (by flag or by RAY_ADDRESS):
    a driver on a CPU-only head node trains on the workers' GPUs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the local run would not be refused")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError):
        parse_args(GPU_ONLY[what])
    parse_args([*GPU_ONLY[what], "--ray-address", "10.0.0.1:6379"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    parse_args(GPU_ONLY[what])


def test_gpu_only_flags_are_refused_on_a_cluster_without_gpus() -> None:
    """Once Ray is joined, the cluster's GPUs decide, and the error names the cluster."""
    from vime.config.validate import check_cluster_devices

    lacking = "the Ray cluster at 10.0.0.1:6379 has none"
    for what in ("cuda-ipc", "tensor-parallel engines"):
        args = parse_args([*GPU_ONLY[what], "--ray-address", "10.0.0.1:6379"])
        check_cluster_devices(args, True, lacking)
        with pytest.raises(ConfigError, match=f"and {lacking}; use "):
            check_cluster_devices(args, False, lacking)
    check_cluster_devices(parse_args([]), False, lacking)  # nothing GPU-only asked


def test_broadcast_sync_that_nccl_cannot_form_is_refused_on_gpus() -> None:
    """On GPUs the broadcast group holds training rank 0 and one rank per engine actor:
    colocated engines would share rank 0's GPU, and a tensor-parallel engine's actor has
    no GPU; both are refused with the transport that works. On the CPU (gloo) both run."""
    from vime.config.validate import check_cluster_devices

    colocated = parse_args(["--colocate", "--weight-sync", "broadcast"])
    tensor_parallel = parse_args(
        ["--weight-sync", "broadcast", "--rollout-num-gpus-per-engine", "2", "--ray-address", "h:1"]
    )
    with pytest.raises(ConfigError, match="--weight-sync broadcast with --colocate on GPUs"):
        check_cluster_devices(colocated, True, "")
    with pytest.raises(ConfigError, match="does not reach tensor-parallel engines"):
        check_cluster_devices(tensor_parallel, True, "")
    check_cluster_devices(colocated, False, "none is visible here")
    check_cluster_devices(parse_args(["--weight-sync", "broadcast"]), True, "")


def test_vllm_memory_share_defaults_by_placement_and_is_checked() -> None:
    """vLLM takes most of a GPU of its own, half of one it shares with a training rank."""
    assert parse_args([]).rollout_gpu_memory_utilization == 0.85
    assert parse_args(["--colocate"]).rollout_gpu_memory_utilization == 0.5
    given = parse_args(["--colocate", "--rollout-gpu-memory-utilization", "0.3"])
    assert given.rollout_gpu_memory_utilization == 0.3
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(ConfigError, match="--rollout-gpu-memory-utilization must be in"):
            parse_args(["--rollout-gpu-memory-utilization", bad])
