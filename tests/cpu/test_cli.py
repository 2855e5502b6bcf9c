"""`vime-train` as a user runs it: a subprocess per case.

Proves that every bad input the foundation issue names ends as exactly one
``vime-train: error: ...`` line on stderr with exit status 2 and no traceback,
that ``--help`` groups the common flags and lists the backends, that naming a
backend adds its flags, and that parsing imports neither torch nor a backend.
The same holds, already while parsing (so ``--dry-run`` catches them), for what
used to fail only once the run started: an engine layout the rollout devices do
not split into, an unknown built-in task, eval prompts of another task or without
any, cuda-ipc weight sync without CUDA or colocation, flash-attention without its
package, a checkpoint the megatron backend cannot build or split -- the
embedded default model too, when no --hf-checkpoint is given -- and a --tool-parser
that is unknown or cannot read the embedded model's turns. An asynchronous run
that opts out of its behaviour correction (--no-use-tis) is told so in one line.
"""

from __future__ import annotations

import importlib.util
import json
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
        (["--tis-clip", "3"], ["--tis-clip needs --use-tis"]),
        (
            ["--max-staleness", "1", "--no-use-tis", "--tis-clip", "3"],
            ["--tis-clip needs --use-tis"],
        ),
        (["--tis-mode", "mask"], ["--tis-mode needs --use-tis"]),
        (["--use-tis", "--tis-clip", "0"], ["--tis-clip must be > 0"]),
        (
            ["--use-tis", "--tis-clip-low", "0.5"],
            ["--tis-clip-low applies only to --tis-mode mask"],
        ),
        (
            ["--use-tis", "--tis-mode", "mask", "--tis-clip-low", "3"],
            ["--tis-clip-low must be in [0, --tis-clip=2.0)"],
        ),
        (["--over-sampling-factor", "2"], ["--over-sampling-factor needs --dynamic-sampling"]),
        (
            ["--dynamic-sampling-filter", "--over-sampling-factor", "0.5"],
            ["--over-sampling-factor must be >= 1"],
        ),
        (["--loss-agg-norm-len", "64"], ["--loss-agg-norm-len applies only to", "token-mean"]),
        (["--hf-checkpoint", "/no/such/model"], ["--hf-checkpoint /no/such/model", "directory"]),
        (["--prompt-data", "/no/such.jsonl"], ["--prompt-data /no/such.jsonl: no such file"]),
        (["--load", "/no/such/ckpt"], ["--load /no/such/ckpt: no such directory"]),
        (["--auto-resume", "2"], ["--auto-resume needs --save DIR"]),
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
        (
            ["--train-backend", "megatron", "--megatron-pipeline-parallel-size", "0"],
            ["--megatron-pipeline-parallel-size must be >= 1"],
        ),
        (
            ["--train-backend", "megatron", "--megatron-sequence-parallel"],
            ["--megatron-sequence-parallel needs --megatron-tensor-parallel-size > 1"],
        ),
        (
            ["--dry-run", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            ["--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"],
        ),
        (
            ["--actor-num-gpus-per-node", "2", "--colocate", "--rollout-num-gpus", "4"],
            ["--colocate", "2 training device(s)", "--rollout-num-gpus 4 does not fit"],
        ),
        (
            ["--dry-run", "--prompt-data", "builtin:nosuch"],
            ["--prompt-data builtin:nosuch: unknown built-in task 'nosuch'", "reverse"],
        ),
        (
            ["--eval-prompt-data", "builtin:add:test"],
            ["--eval-prompt-data builtin:add:test: no split 'test'"],
        ),
        (
            ["--prompt-data", "builtin:add", "--eval-prompt-data", "builtin:reverse:eval"],
            ["another task than --prompt-data builtin:add", "use builtin:add:eval"],
        ),
        (
            ["--hf-checkpoint", ".", "--prompt-data", "builtin:add", "--eval-interval", "5"],
            ["--eval-interval 5 needs --eval-prompt-data"],
        ),
        (
            ["--weight-sync", "cuda-ipc"],
            ["--weight-sync cuda-ipc needs --colocate and --rollout-num-gpus-per-engine 1"],
        ),
        (
            ["--rollout-engine", "hf", "--rollout-num-gpus-per-engine", "2"],
            ["--rollout-num-gpus-per-engine 2 needs the vllm engine", "runs on one device"],
        ),
        (["--tool-parser", "qwen"], ["--tool-parser", "'qwen'", "'hermes', 'llama3_json'"]),
        (
            ["--dry-run", "--prompt-data", "builtin:lookup", "--tool-parser", "hermes"],
            ["--tool-parser hermes reads turns a chat template frames", "embedded model"],
        ),
    ],
)
def test_bad_input_is_one_line_error(argv: list[str], fragments: list[str]) -> None:
    assert_one_line_error(run_cli(*argv), *fragments)


def test_missing_prompt_data_fails_while_parsing() -> None:
    assert_one_line_error(
        run_cli("--dry-run", "--hf-checkpoint", "."),
        "--prompt-data is required with --hf-checkpoint",
    )


def _skip_where_cuda_is(what: str) -> None:
    """These refusals are for machines without CUDA; with it, ``what`` is a valid choice."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip(f"CUDA is available here, so {what} is a valid choice")


def test_tensor_parallel_engines_without_gpus_fail_while_parsing() -> None:
    _skip_where_cuda_is("a tensor-parallel engine")
    assert_one_line_error(
        run_cli("--dry-run", "--rollout-engine", "vllm", "--rollout-num-gpus-per-engine", "2"),
        "--rollout-num-gpus-per-engine 2 spreads each engine over GPUs, and none is visible here",
    )


def test_cuda_ipc_without_cuda_fails_while_parsing() -> None:
    _skip_where_cuda_is("cuda-ipc")
    assert_one_line_error(
        run_cli("--dry-run", "--weight-sync", "cuda-ipc", "--colocate"),
        "--weight-sync cuda-ipc needs CUDA GPUs",
    )


def test_flash_attention_without_flash_attn_fails_while_parsing() -> None:
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    assert_one_line_error(
        run_cli("--dry-run", "--attn-implementation", "flash_attention_2"),
        "--attn-implementation flash_attention_2 needs the flash-attn package",
    )


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"model_type": "gemma3_text"}, ["unsupported model_type 'gemma3_text'", "fsdp2"]),
        ({"num_key_value_heads": 1}, ["tensor-parallel size 2", "must divide the 1 KV heads"]),
    ],
)
def test_megatron_checkpoint_it_cannot_build_fails_while_parsing(
    tmp_path: Path, changes: dict, fragments: list[str]
) -> None:
    config = {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        **changes,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--dry-run", "--train-backend", "megatron", "--hf-checkpoint", str(tmp_path)]
    argv += ["--prompt-data", "builtin:add", "--actor-num-gpus-per-node", "2"]
    result = run_cli(*argv, "--megatron-tensor-parallel-size", "2")
    assert_one_line_error(result, f"{tmp_path}: megatron backend", *fragments)


@pytest.mark.parametrize(
    ("flag", "size", "problem"),
    [
        ("--megatron-tensor-parallel-size", 4, "tensor-parallel size 4"),
        ("--megatron-pipeline-parallel-size", 3, "the model's 4 layers do not split evenly"),
    ],
)
def test_megatron_split_of_the_embedded_default_fails_while_parsing(
    flag: str, size: int, problem: str
) -> None:
    """Without --hf-checkpoint the run trains the embedded default (2 KV heads, 4 layers):
    a TP size that does not divide its KV heads, or a PP size its layers do not split
    over, is refused while parsing, not later inside the actor."""
    argv = ["--dry-run", "--train-backend", "megatron", "--actor-num-gpus-per-node", str(size)]
    result = run_cli(*argv, flag, str(size))
    line = assert_one_line_error(result, "the embedded default model", problem)
    if flag == "--megatron-tensor-parallel-size":
        assert "must divide the 2 KV heads" in line


def test_defaults_validate_and_say_what_runs() -> None:
    result = run_cli("--dry-run")
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout
    assert "backend fsdp2" in result.stdout
    # The embedded default's settings apply when no --hf-checkpoint is given.
    assert "64 prompts x 8 samples" in result.stdout


def test_uncorrected_asynchronous_loss_is_said_at_start_up() -> None:
    """--max-staleness >= 1 with --no-use-tis trains older weights' samples without the
    behaviour correction: one line at start-up says so; the corrected default says nothing."""
    corrected = run_cli("--dry-run", "--max-staleness", "1")
    assert corrected.returncode == 0, corrected.stderr
    assert "uncorrected" not in corrected.stdout + corrected.stderr
    result = run_cli("--dry-run", "--max-staleness", "1", "--no-use-tis")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "--no-use-tis" in line]
    assert len(notes) == 1, result.stdout
    assert "--max-staleness 1" in notes[0] and "uncorrected" in notes[0], notes[0]


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


def test_parsing_imports_neither_torch_nor_a_backend(tmp_path: Path) -> None:
    # A checkpoint folder, so the megatron architecture rules run on its config.json.
    config = {"model_type": "qwen3", "num_attention_heads": 2, "intermediate_size": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    code = (
        "import sys\n"
        "from vime.config import parse_args, build_parser\n"
        "parse_args(['--train-backend', 'megatron'])\n"
        f"parse_args(['--train-backend', 'megatron', '--hf-checkpoint', {str(tmp_path)!r}])\n"
        "parse_args(['--train-backend', 'fsdp2', '--prompt-data', 'builtin:add'])\n"
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


def test_ctrl_c_swallowed_while_ray_starts_still_stops_the_run(tmp_path, monkeypatch, capsys):
    """A Ctrl-C whose exception is lost while Ray starts (one landing in an at-fork
    handler is printed as "Exception ignored") still stops the run before it trains:
    exit 130, the one line, no output folder."""
    import os
    import signal
    import time

    import vime.trainer
    from vime import cli
    from vime.ray import cluster

    def start_ray_swallowing(address, min_cpus) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # what Python does with an exception raised in an at-fork handler

    def never(*args, **kwargs):
        raise AssertionError("the run went on after Ctrl-C")

    monkeypatch.setattr(cluster, "start_ray", start_ray_swallowing)
    monkeypatch.setattr(vime.trainer, "run", never)
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "out"
    try:
        status = cli.main(["--rollout-engine", "hf", "--output-dir", str(out)])
    finally:
        signal.signal(signal.SIGINT, before)
    assert status == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "vime-train: interrupted while starting; nothing was kept", last
    assert not out.exists()
