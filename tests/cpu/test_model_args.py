"""Architecture flags (scripts/models/*.sh) against HF config.json, and the Qwen3-0.6B recipe.

Proves that every ``MODEL_ARGS`` array, sourced by bash, parses and agrees with
the public model's config.json (written here independently of the scripts, in
HF field names), that each script sets every numeric architecture flag and the
boolean ones exactly when the model has them; that a mismatch is one line
naming the flag and both values; that the newer ``rope_parameters`` form and
the HF defaults (no num_key_value_heads / head_dim) are read; that floats
compare with a tolerance; that architecture flags without --hf-checkpoint are
refused; and that scripts/run-qwen3-0.6B.sh is valid bash whose every flag
exists for its backend and whose full command line validates for both backends.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vime.config import ConfigError, build_parser, parse_args
from vime.config.model_args import ARCH_FLAGS, check_model_args

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "scripts" / "models"
RUN_SCRIPT = ROOT / "scripts" / "run-qwen3-0.6B.sh"


def _hf(
    model_type: str,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    vocab: int,
    rope_theta: float,
    eps: float,
    tied: bool,
) -> dict[str, Any]:
    config = {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rope_theta": rope_theta,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tied,
    }
    return {key: value for key, value in config.items() if value is not None}


# The public config.json values, keyed by script name (no .sh). Qwen2.5 configs state no
# head_dim (it is hidden / heads), so those exercise the derived value.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6B": _hf("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, 1000000, 1e-06, True),
    "qwen3-1.7B": _hf("qwen3", 28, 2048, 6144, 16, 8, 128, 151936, 1000000, 1e-06, True),
    "qwen3-4B": _hf("qwen3", 36, 2560, 9728, 32, 8, 128, 151936, 1000000, 1e-06, True),
    "qwen3-8B": _hf("qwen3", 36, 4096, 12288, 32, 8, 128, 151936, 1000000, 1e-06, False),
    "qwen2.5-0.5B": _hf("qwen2", 24, 896, 4864, 14, 2, None, 151936, 1000000.0, 1e-06, True),
    "qwen2.5-1.5B": _hf("qwen2", 28, 1536, 8960, 12, 2, None, 151936, 1000000.0, 1e-06, True),
    "qwen2.5-7B": _hf("qwen2", 28, 3584, 18944, 28, 4, None, 152064, 1000000.0, 1e-06, False),
    "llama3.2-1B": _hf("llama", 16, 2048, 8192, 32, 8, 64, 128256, 500000.0, 1e-05, True),
    "llama3.2-3B": _hf("llama", 28, 3072, 8192, 24, 8, 128, 128256, 500000.0, 1e-05, True),
    "llama3.1-8B": _hf("llama", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 1e-05, False),
}


def _model_args(script: Path) -> list[str]:
    result = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\n" "${MODEL_ARGS[@]}"', "_", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout.splitlines()


def _checkpoint(folder: Path, config: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _namespace(**flags: Any) -> argparse.Namespace:
    args = argparse.Namespace(**dict.fromkeys(ARCH_FLAGS))
    for dest, value in flags.items():
        setattr(args, dest, value)
    return args


def test_every_model_script_has_a_reference_config() -> None:
    scripts = {path.stem for path in MODELS.glob("*.sh")}
    assert scripts == set(HF_CONFIGS)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_model_args_parse_and_match_the_hf_config(name: str, tmp_path: Path) -> None:
    config = HF_CONFIGS[name]
    flags = _model_args(MODELS / f"{name}.sh")
    cfg = parse_args([*flags, "--hf-checkpoint", _checkpoint(tmp_path / name, config)])
    for dest in ARCH_FLAGS:  # booleans too, in their --no- form where off
        assert getattr(cfg, dest) is not None, f"{name}.sh does not set {ARCH_FLAGS[dest].flag}"
    assert cfg.qk_layernorm is (config["model_type"] == "qwen3")
    assert cfg.untie_embeddings_and_output_weights is (not config["tie_word_embeddings"])


def test_model_args_of_one_model_fail_against_another(tmp_path: Path) -> None:
    flags = _model_args(MODELS / "qwen3-0.6B.sh")
    other = _checkpoint(tmp_path / "1.7B", HF_CONFIGS["qwen3-1.7B"])
    with pytest.raises(ConfigError) as err:
        parse_args([*flags, "--hf-checkpoint", other])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "--hidden-size 1024 does not match the checkpoint (config.json hidden_size = 2048)"
    )
    assert "--ffn-hidden-size" in message


@pytest.mark.parametrize(
    ("flags", "config", "expected"),
    [
        (
            {"num_query_groups": 8},
            {"num_attention_heads": 16, "num_key_value_heads": 2},
            "--num-query-groups 8 does not match the checkpoint (config.json "
            "num_key_value_heads = 2)",
        ),
        (
            {"norm_epsilon": 1e-5},
            {"rms_norm_eps": 1e-06},
            "--norm-epsilon 1e-05 does not match the checkpoint (config.json rms_norm_eps = 1e-06)",
        ),
        (
            {"qk_layernorm": True},
            {"model_type": "llama"},
            '--qk-layernorm (set) does not match the checkpoint (config.json model_type = "llama"',
        ),
        (
            {"untie_embeddings_and_output_weights": True},
            {"tie_word_embeddings": True},
            "--untie-embeddings-and-output-weights (set) does not match the checkpoint "
            "(config.json tie_word_embeddings = true",
        ),
        (
            {"untie_embeddings_and_output_weights": False},
            {"tie_word_embeddings": False},
            "--no-untie-embeddings-and-output-weights does not match the checkpoint "
            "(config.json tie_word_embeddings = false)",
        ),
        (
            {"qk_layernorm": False},
            {"model_type": "qwen3"},
            '--no-qk-layernorm does not match the checkpoint (config.json model_type = "qwen3")',
        ),
    ],
)
def test_mismatch_names_flag_and_both_values(
    flags: dict[str, Any], config: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_model_args(_namespace(**flags), config)
    assert str(err.value).startswith(expected)


def test_hf_defaults_for_missing_kv_heads_and_head_dim() -> None:
    config = {"hidden_size": 2048, "num_attention_heads": 16}
    check_model_args(_namespace(num_query_groups=16, kv_channels=128), config)
    with pytest.raises(ConfigError, match=r"--kv-channels 64 .*hidden_size / num_attention_heads"):
        check_model_args(_namespace(kv_channels=64), config)
    with pytest.raises(ConfigError, match=r"--num-query-groups 4 .* = 16"):
        check_model_args(_namespace(num_query_groups=4), config)


def test_rope_parameters_form_is_read() -> None:
    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    check_model_args(_namespace(rotary_base=1e6), config)
    with pytest.raises(ConfigError) as err:
        check_model_args(_namespace(rotary_base=10000.0), config)
    assert str(err.value) == (
        "--rotary-base 10000 does not match the checkpoint "
        "(config.json rope_parameters.rope_theta = 1000000.0)"
    )


def test_floats_compare_with_relative_tolerance() -> None:
    check_model_args(_namespace(norm_epsilon=1e-6 * (1 + 1e-9)), {"rms_norm_eps": 1e-06})
    check_model_args(_namespace(rotary_base=500000.0), {"rope_theta": 500000})
    with pytest.raises(ConfigError):
        check_model_args(_namespace(rotary_base=500000.0), {"rope_theta": 500001})


def test_only_given_flags_are_checked(tmp_path: Path) -> None:
    """A lone flag is checked alone; absent booleans do not assert the opposite."""
    untied = _checkpoint(tmp_path / "8B", HF_CONFIGS["qwen3-8B"])
    assert parse_args(["--hf-checkpoint", untied, "--num-layers", "36"]).num_layers == 36
    with pytest.raises(ConfigError, match="--num-layers 28 "):
        parse_args(["--hf-checkpoint", untied, "--num-layers", "28"])


def test_arch_flags_need_hf_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\(--num-layers\) describe --hf-checkpoint"):
        parse_args(["--num-layers", "28"])
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        parse_args(["--hf-checkpoint", str(tmp_path), "--num-layers", "28"])


def test_run_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(RUN_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_run_script_flags_exist_for_its_backend(backend: str) -> None:
    code = "\n".join(line.split("#", 1)[0] for line in RUN_SCRIPT.read_text().splitlines())
    # Common flags lie outside the `case`; each backend's own in its branch of it.
    before, rest = code.split('case "${BACKEND}" in', 1)
    branches, after = rest.split("esac", 1)
    branch = re.search(rf"^\s*{backend}\)(.*?);;", branches, re.S | re.M)
    assert branch, f"no {backend} branch in the case"
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    used = set(flag.findall(before + after + branch.group(1)))
    parser = build_parser(backend)
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert len(used) > 30
    assert used <= known, sorted(used - known)


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_run_script_command_validates(backend: str, tmp_path: Path) -> None:
    """The recipe's whole command line, with the real MODEL_ARGS, passes vime's validation."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {
        "PATH": "/usr/bin:/bin",
        "DRY_RUN": "1",
        "HF_CHECKPOINT": _checkpoint(tmp_path / "ckpt", HF_CONFIGS["qwen3-0.6B"]),
        "PROMPT_DATA": str(prompts),
        "SAVE_DIR": str(tmp_path / "save"),
        "OUTPUT_DIR": str(tmp_path / "out"),
    }
    result = subprocess.run(
        ["bash", str(RUN_SCRIPT), backend], capture_output=True, text=True, env=env, timeout=30
    )
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    assert argv[0] == "vime-train"
    cfg = parse_args(argv[1:])
    assert cfg.train_backend == backend
    assert cfg.data_parallel_size == 8
    assert cfg.rollout_batch_size * cfg.n_samples_per_prompt == 256
    assert cfg.qk_layernorm is True


def test_run_script_rejects_unknown_backend() -> None:
    result = subprocess.run(
        ["bash", str(RUN_SCRIPT), "deepspeed"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"},
        timeout=30,
    )
    assert result.returncode == 2
    assert "fsdp2|megatron" in result.stderr
