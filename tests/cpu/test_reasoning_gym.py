"""reasoning-gym tasks as prompt data (``vime.data.reasoning_gym``), scored by their scorer.

Proves: ``reasoning-gym:<task>`` loads a task's generated rows (questions as prompts,
a small picklable reference as the label, rebuilt to the same entry in a fresh
process); the dataset's scorer gives the entry's answer 1.0 and a wrong one less,
after ``</think>`` and inside ``<answer>`` tags too; the eval split shares no question
with the train split (a small universe loses its repeats, counted); bad specs and a
missing package end as one ``vime-train: error:`` line; and a real ``vime-train`` run
on the embedded model trains on such a task with fsdp2 and megatron, writing metrics
whose reward varies within a rollout and the held-out split's pass@1.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import vime_train_command
from tests.cpu.test_cli import assert_one_line_error, run_cli
from vime.config.flags import apply_gym_eval_default
from vime.config.parser import parse_args
from vime.data.prompts import load_prompts
from vime.data.reasoning_gym import EVAL_SIZE, GymReference, final_answer, gym_reward, gym_task
from vime.errors import ConfigError

pytest.importorskip("reasoning_gym")

TASKS = ["basic_arithmetic", "gcd", "leg_counting"]


@pytest.mark.parametrize("task", TASKS)
def test_a_task_loads_and_its_own_answer_scores_full_marks(task: str) -> None:
    """Rows are the generator's questions; the entry's answer gets 1.0, a wrong one less."""
    prompts = load_prompts(f"reasoning-gym:{task}?size=20&seed=3", seed=1)
    assert len(prompts) == 20
    assert sorted(p.index for p in prompts) == list(range(20))
    scorer = gym_task(f"reasoning-gym:{task}")
    for p in prompts[:5]:
        ref = p.label
        assert isinstance(ref, GymReference) and (ref.task, ref.size, ref.seed) == (task, 20, 3)
        assert isinstance(p.text, str) and p.text
        assert scorer.reward(ref.answer, ref) == 1.0 and scorer.is_correct(ref.answer, ref)
        assert scorer.reward(f"{ref.answer}zz99", ref) < 1.0
        assert scorer.reward("no idea", ref) < 1.0 and not scorer.is_correct("no idea", ref)
        assert str(ref) == ref.answer  # what --rm-type exact|math and --rm-url compare with


def test_the_answer_is_read_after_think_and_inside_answer_tags() -> None:
    """The final answer: after the last </think>, the last <answer> tag's contents."""
    assert final_answer("  42 \n") == "42"
    assert final_answer("<think>7?</think> <answer> 12 </answer>") == "12"
    assert final_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert final_answer("<think>still going") is None
    (p,) = load_prompts("reasoning-gym:gcd?size=1&seed=11", seed=0)
    right = p.label.answer
    assert gym_reward(f"<think>hmm {right}0</think><answer>{right}</answer>", p.label) == 1.0
    assert gym_reward(f"<think>{right}", p.label) == 0.0


def test_the_label_pickles_small_and_rebuilds_its_entry_in_a_fresh_process() -> None:
    """A reward in another process needs only the reference: it regenerates the entry."""
    prompts = load_prompts("reasoning-gym:basic_arithmetic?size=50&seed=8", seed=2)
    ref = prompts[7].label
    blob = pickle.dumps(ref)
    assert len(blob) < 300
    code = (
        "import pickle, sys\n"
        "from vime.data.reasoning_gym import gym_reward\n"
        "ref = pickle.loads(sys.stdin.buffer.read())\n"
        "print(gym_reward(ref.answer, ref), gym_reward(ref.answer + '1', ref))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, timeout=120, check=True
    )
    right, wrong = map(float, out.stdout.split())
    assert right == 1.0 and wrong < 1.0


@pytest.mark.parametrize("task", ["basic_arithmetic", "gcd"])
def test_train_and_eval_splits_share_no_question(task: str) -> None:
    """The eval split comes from other seeds: no question in both, none needed dropping."""
    spec = f"reasoning-gym:{task}?size=500&seed=4"
    train = {p.text for p in load_prompts(spec, seed=0)}
    said: list[str] = []
    held_out = load_prompts(f"reasoning-gym:{task}:eval?size=500&seed=4", seed=0, say=said.append)
    assert len(held_out) == EVAL_SIZE and not said
    assert not train & {p.text for p in held_out}


def test_a_small_universe_loses_its_repeated_eval_rows_and_says_so() -> None:
    """coin_flip repeats questions: eval rows that are train questions go, and are counted."""
    spec = "reasoning-gym:coin_flip?size=1000"
    train = {p.text for p in load_prompts(spec, seed=0)}
    said: list[str] = []
    held_out = load_prompts("reasoning-gym:coin_flip:eval?size=1000", seed=0, say=said.append)
    assert 0 < len(held_out) < EVAL_SIZE
    assert not train & {p.text for p in held_out}
    assert len(said) == 1 and f"dropped {EVAL_SIZE - len(held_out)} eval rows" in said[0]


def test_the_eval_split_is_the_default_eval_data_with_any_model() -> None:
    """Training on reasoning-gym data holds its eval split out unless told otherwise."""
    args = parse_args(["--prompt-data", "reasoning-gym:gcd?size=300&seed=2"])
    assert args.eval_prompt_data == "reasoning-gym:gcd:eval?size=300&seed=2"
    assert args.rollout_max_prompt_len == 256  # the embedded model's default for these
    mine = parse_args(["--prompt-data", "reasoning-gym:gcd", "--rollout-max-prompt-len", "99"])
    assert mine.rollout_max_prompt_len == 99
    # What parse_args applies with --hf-checkpoint too; a given eval set stays.
    real = argparse.Namespace(prompt_data="reasoning-gym:gcd?seed=5", eval_prompt_data=None)
    apply_gym_eval_default(real)
    assert real.eval_prompt_data == "reasoning-gym:gcd:eval?size=1000&seed=5"
    given = argparse.Namespace(prompt_data="reasoning-gym:gcd", eval_prompt_data="x.jsonl")
    apply_gym_eval_default(given)
    assert given.eval_prompt_data == "x.jsonl"


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("reasoning-gym:basic_arithmetc", ["unknown reasoning-gym task", "basic_arithmetic"]),
        ("reasoning-gym:gcd?size=abc", ["size must be a whole number, got 'abc'"]),
        ("reasoning-gym:gcd?colour=red", ["bad query 'colour=red'"]),
        ("reasoning-gym:gcd?size=0", ["size must be 1 to"]),
        ("reasoning-gym:gcd:test", ["write reasoning-gym:<task>[:eval]"]),
    ],
)
def test_bad_specs_are_one_line_errors(spec: str, fragments: list[str]) -> None:
    """Each bad spec is refused while parsing, in one line naming the flag."""
    assert_one_line_error(run_cli("--prompt-data", spec, "--dry-run"), "--prompt-data", *fragments)


def test_eval_data_of_another_task_is_refused() -> None:
    """Eval is scored with the training task's scorer: another task's rows are refused."""
    result = run_cli(
        "--prompt-data", "reasoning-gym:gcd", "--eval-prompt-data", "reasoning-gym:lcm:eval"
    )
    assert_one_line_error(result, "another task", "reasoning-gym:gcd:eval?size=1000&seed=0")


def test_without_the_package_the_error_names_the_install(monkeypatch) -> None:
    """reasoning-gym missing: one ConfigError naming the extra that installs it."""
    for name in ("reasoning_gym", "reasoning_gym.factory"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it now fails
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[agents\]'"):
        parse_args(["--prompt-data", "reasoning-gym:gcd", "--dry-run"])


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_vime_train_runs_on_a_reasoning_gym_task(backend: str, tmp_path: Path) -> None:
    """The embedded model trains 2 rollouts on gcd; rewards vary and eval is scored."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    command = vime_train_command()
    flags = ["--train-backend", backend, "--prompt-data", "reasoning-gym:gcd?size=64&seed=1"]
    flags += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2"]
    flags += ["--max-tokens-per-gpu", "1024", "--seed", "7", "--output-dir", "out"]
    result = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=540, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = _metrics(tmp_path / "out")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/reward_failures"] == 0
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["data/prompts_dropped"] == 0  # every gcd question fits 256 characters
        assert r["train/skipped_steps"] == 0
    # The dataset's partial credit (the answer inside a longer text) varies the reward,
    # and a rollout whose rewards vary moves the weights.
    varied = [r for r in rows if r["rollout/reward_std"] > 0]
    assert varied and all(r["train/grad_norm"] > 0 for r in varied)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert 0.0 <= summary["final_eval"]["eval/pass@1"] <= 1.0  # the held-out split, scored
