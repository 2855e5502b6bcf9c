"""The README's two demos learn: the main job and the tool-using lookup task.

Proves, by running the embedded default as a user does (tiny Qwen3, character
tokenizer, string reversal, Ray, the fsdp2 trainer) for its default 400 rollouts,
that the mean reward of the last 10 rollouts exceeds the first 10 by at least 0.3
and that greedy accuracy on the 100 held-out prompts, evaluated at the end, is at
least 50 %. The engine is transformers, so the test is the same with or without
vLLM installed, or the one ``VIME_TEST_ROLLOUT_ENGINE`` names (the vLLM CI step
runs it with ``vllm``). The budget is a rollout count, not a time: how long the
rollouts take on a given machine is measured and reported (issue notes), not
asserted here.

The second demo, ``vime-train --prompt-data builtin:lookup``, must learn to call its
tool. It starts with its recipe's supervised warm start (``--sft-warmup-steps 30``); its
first 180 rollouts of 500 are run (the run is the same rollout for rollout whatever its
length: a constant lr): the share of trajectories that call the tool goes from under 1 %
in the first 10 rollouts to over 5 % in the last 10 (0.07-0.24 over six seeds, rising),
and greedy decoding calls it on nearly all of the 100 held-out keys, whose values only
the tool knows (from rollout 120 for the default seed, by 160 for all six, 2026-12-05).
Copying the tool's
answer (greedy accuracy) is not asserted here: it comes later, between rollouts 260 and
400 for five seeds on one CPU, and a CPU's arithmetic moves it (bench/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.commands import vime_train_command

# hf here keeps the CPU suite's time the same with or without vLLM (a vLLM run of the
# default takes longer on 2 cores); .buildkite's vLLM step sets vllm.
ENGINE = os.environ.get("VIME_TEST_ROLLOUT_ENGINE", "hf")


def _run(tmp_path: Path, *flags: str) -> tuple[Path, list[dict]]:
    """``vime-train`` as a user runs it, with ``flags``; its output folder and metrics."""
    command = vime_train_command()
    out = tmp_path / "run"
    result = subprocess.run(
        [*command, *flags, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


@pytest.mark.slow
def test_embedded_default_learns_string_reversal(tmp_path: Path) -> None:
    out, rows = _run(tmp_path, "--rollout-engine", ENGINE)
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    summary = json.loads((out / "summary.json").read_text())
    accuracy = summary["final_eval"]["eval/pass@1"]
    report = f"{ENGINE}: reward {first:.3f} -> {last:.3f}, greedy accuracy {accuracy:.2f}"
    print(report)
    assert last - first >= 0.3, report
    assert accuracy >= 0.5, report
    assert summary["final_eval"]["eval/num_prompts"] == 100
    assert (out / "progress.png").exists() and (out / "model" / "config.json").exists()


@pytest.mark.slow
def test_the_lookup_task_learns_to_call_its_tool(tmp_path: Path) -> None:
    out, rows = _run(tmp_path, "--prompt-data", "builtin:lookup", "--num-rollout", "180")
    assert len(rows) == 180 and rows[0]["warmup/steps"] == 30
    calling = [r["agent/calling_frac"] for r in rows]
    first, last = sum(calling[:10]) / 10, sum(calling[-10:]) / 10
    final = json.loads((out / "summary.json").read_text())["final_eval"]
    report = f"calling {first:.2f} -> {last:.2f}, greedy calling {final['eval/calling_frac']:.2f}"
    print(report)
    assert first < 0.01 and last > 0.05, report
    assert final["eval/calling_frac"] >= 0.9, report
    assert final["eval/num_prompts"] == 100
