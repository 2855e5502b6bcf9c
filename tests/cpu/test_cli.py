"""`vime-train` as a user runs it: a subprocess per case.

Proves that every bad input the foundation issue names ends as exactly one
``vime-train: error: ...`` line on stderr with exit status 2 and no traceback,
that ``--help`` groups the common flags and lists the backends, that naming a
backend adds its flags, and that parsing imports neither torch nor a backend.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    # The installed console script, as a user runs it (not python -m, which adds cwd itself).
    script = Path(sys.executable).with_name("vime-train")
    if not script.exists():
        script = Path(shutil.which("vime-train") or "vime-train")
    return subprocess.run(
        [str(script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vime-train: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--train-backend", "deepspeed"], ["'deepspeed'", "fsdp2, megatron"]),
        (
            ["--megatron-tensor-parallel-size", "2"],
            ["--megatron-tensor-parallel-size", "megatron backend", "--train-backend megatron"],
        ),
        (
            ["--train-backend", "megatron", "--fsdp-mode", "hybrid"],
            ["--fsdp-mode", "fsdp2 backend", "--train-backend fsdp2"],
        ),
        (["--lr-decay", "cosine"], ["unknown flag --lr-decay", "did you mean --lr-decay-style?"]),
        (["--n-sample-per-prompt", "4"], ["did you mean --n-samples-per-prompt?"]),
        (["--zzzzzz"], ["unknown flag --zzzzzz", "--help"]),
        (["stray"], ["unexpected argument 'stray'"]),
        (
            [
                "--rollout-batch-size",
                "3",
                "--n-samples-per-prompt",
                "5",
                "--global-batch-size",
                "4",
            ],
            ["15", "multiple of --global-batch-size 4"],
        ),
        (
            ["--actor-num-gpus-per-node", "3", "--global-batch-size", "64"],
            ["--global-batch-size 64", "data-parallel size 3"],
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "4",
                "--megatron-tensor-parallel-size",
                "2",
                "--global-batch-size",
                "1",
                "--rollout-batch-size",
                "1",
                "--n-samples-per-prompt",
                "1",
            ],
            ["--global-batch-size 1", "data-parallel size 2"],
        ),
        (["--num-steps-per-rollout", "3"], ["--num-steps-per-rollout 3", "512 samples"]),
        (["--rollout-temperature", "0"], ["--rollout-temperature must be > 0"]),
        (["--rollout-temperature", "-1"], ["--rollout-temperature must be > 0"]),
        (["--rollout-top-p", "1.5"], ["--rollout-top-p"]),
        (["--eps-clip", "0"], ["--eps-clip must be in (0, 1)"]),
        (["--eps-clip", "1.2"], ["--eps-clip must be in (0, 1)"]),
        (["--eps-clip-high", "-0.1"], ["--eps-clip-high must be > 0"]),
        (["--eps-clip-c", "0.9"], ["--eps-clip-c", "> 1"]),
        (["--kl-loss-type", "k3"], ["--kl-loss-type k3 needs --use-kl-loss"]),
        (["--kl-loss-coef", "0.1"], ["needs --use-kl-loss"]),
        (["--hf-checkpoint", "/no/such/model"], ["--hf-checkpoint /no/such/model", "directory"]),
        (["--prompt-data", "/no/such.jsonl"], ["--prompt-data /no/such.jsonl: no such file"]),
        (["--load", "/no/such/ckpt"], ["--load /no/such/ckpt: no such directory"]),
        (
            ["--hf-checkpoint", ".", "--prompt-data", "builtin:add", "--use-dynamic-batch-size"],
            ["needs --max-tokens-per-gpu"],
        ),
        (["--save-interval", "5"], ["--save-interval needs --save"]),
        (["--lr", "abc"], ["--lr", "invalid float value"]),
        (["--rollout-batch-size", "0"], ["positive integer"]),
        (["--min-lr", "1"], ["--min-lr"]),
        (["--fsdp-mode", "hybrid"], ["--fsdp-shard-size"]),
        (["--fsdp-mode", "hybrid", "--fsdp-shard-size", "1"], ["at least 2 groups"]),
        (
            ["--train-backend", "megatron", "--megatron-tensor-parallel-size", "2"],
            ["does not divide the 1 training ranks"],
        ),
    ],
)
def test_bad_input_is_one_line_error(argv: list[str], fragments: list[str]) -> None:
    assert_one_line_error(run_cli(*argv), *fragments)


def test_defaults_validate_and_say_what_runs() -> None:
    result = run_cli("--dry-run")
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout
    assert "backend fsdp2" in result.stdout
    # The embedded default's settings apply when no --hf-checkpoint is given.
    assert "64 prompts x 8 samples" in result.stdout


def test_help_groups_common_flags_and_lists_backends() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    out = result.stdout
    for group in (
        "cluster:",
        "rollout:",
        "data:",
        "algorithm:",
        "optimizer:",
        "checkpoint:",
        "logging:",
    ):
        assert f"\n{group}" in out, group
    assert "fsdp2" in out and "megatron" in out
    assert "--fsdp-mode" not in out and "--megatron-tensor-parallel-size" not in out


@pytest.mark.parametrize(
    ("backend", "own", "other"),
    [
        ("megatron", "--megatron-tensor-parallel-size", "--fsdp-mode"),
        ("fsdp2", "--fsdp-mode", "--megatron-tensor-parallel-size"),
    ],
)
def test_naming_a_backend_adds_its_flags_to_help(backend: str, own: str, other: str) -> None:
    result = run_cli("--train-backend", backend, "--help")
    assert result.returncode == 0
    assert own in result.stdout
    assert other not in result.stdout


def test_parsing_imports_neither_torch_nor_a_backend() -> None:
    code = (
        "import sys\n"
        "from vime.config import parse_args, build_parser\n"
        "parse_args(['--train-backend', 'megatron'])\n"
        "parse_args(['--train-backend', 'fsdp2'])\n"
        "build_parser(None).format_help()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'megatron', 'vllm', 'ray'))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_custom_hooks_are_checked_at_start_up(tmp_path) -> None:
    (tmp_path / "myhooks.py").write_text(
        "def adv(rewards, n_samples_per_prompt, estimator='grpo', eps=1e-6):\n"
        "    return rewards\n"
        "def bad(x):\n"
        "    return x\n"
    )
    ok = run_cli("--dry-run", "--custom-advantage-function-path", "myhooks:adv", cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert_one_line_error(
        run_cli("--custom-advantage-function-path", "myhooks:bad", cwd=str(tmp_path)),
        "--custom-advantage-function-path myhooks:bad",
        "missing or misplaced",
    )
    assert_one_line_error(
        run_cli("--custom-loss-function-path", "no_such_module:fn", cwd=str(tmp_path)),
        "--custom-loss-function-path",
        "no_such_module",
    )
