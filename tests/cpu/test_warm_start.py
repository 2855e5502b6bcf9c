"""``--sft-warmup-steps``: the built-in tasks' demonstrations and the warm start's batches.

Proves: a lookup demonstration is token for token the trajectory the tool loop builds
when the model makes the right call and answer (the tool's answer masked out), and the
task's reward gives it 1.0; the batches are the flags' number and size, advantage 1,
drawn by seed without touching the RL prompt order, marked as no engine's; the flag is
refused where it cannot work; and in a run it trains before the first rollout (greedy
decoding then calls the tool, which the untrained model never does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_tool_loop import ScriptedEngine, _run

from vime.config.parser import parse_args
from vime.data.prompts import Prompt, PromptSource
from vime.data.tasks import CHARSET, LOOKUP_TOOLS, TASKS
from vime.errors import ConfigError
from vime.models.embedded import EOS_ID, build_tokenizer
from vime.rollout.decoding import decode_turns
from vime.rollout.tools.loop import ToolLoop, ToolLoopSettings
from vime.rollout.tools.toolbox import Toolbox
from vime.setup.settings import WarmStartSettings
from vime.setup.warm_start import build_warm_start, demonstration_ids


@pytest.fixture(scope="module")
def chars():
    return build_tokenizer(CHARSET)


def _rows(task: str, n: int) -> list[Prompt]:
    rows = TASKS[task].make_examples("train", 0)[:n]
    return [Prompt(text=r["prompt"], label=r["label"], index=i) for i, r in enumerate(rows)]


def test_a_lookup_demonstration_is_the_tool_loops_right_trajectory(chars) -> None:
    """The ids and mask equal the tool loop's for the scripted right turns, and the
    trajectory, decoded as the reward reads it, scores 1.0."""
    task = TASKS["lookup"]
    box = Toolbox(LOOKUP_TOOLS)
    try:
        for prompt in _rows("lookup", 5):
            ids, mask = demonstration_ids(task, prompt, chars)
            key, value = prompt.label.split()
            loop = ToolLoop(box, chars, ToolLoopSettings(), stop_token_ids=[EOS_ID])
            engine = ScriptedEngine(chars, [[f"get {key}", value]], EOS_ID)
            (c,), _ = _run(loop, engine, [prompt.text])
            assert (ids, mask) == (c.response_ids, c.loss_mask)
            assert 0 in mask and mask[-1] == 1 and ids[-1] == EOS_ID
            (text,) = decode_turns(chars, [ids], {EOS_ID})
            assert task.reward(text, prompt.label) == 1.0
    finally:
        box.close()


def test_a_plain_tasks_demonstration_is_its_label_then_eos(chars) -> None:
    for prompt in _rows("reverse", 3):
        ids, mask = demonstration_ids(TASKS["reverse"], prompt, chars)
        assert ids == [*chars.encode(prompt.label, add_special_tokens=False), EOS_ID]
        assert mask == [1] * len(ids)


def test_the_batches_are_the_flags_and_leave_the_prompt_order_alone(chars) -> None:
    """``steps`` batches of ``batch_size`` samples (prompt ids, then the demonstration),
    advantage 1, the same for the same seed and other for another; the RL source's
    position is untouched."""
    prompts = _rows("lookup", 40)
    ids = {p.index: [1, *chars.encode(p.text, add_special_tokens=False)] for p in prompts}
    source = PromptSource(prompts, seed=3)
    settings = WarmStartSettings(steps=3, batch_size=8, seed=3)
    batches = build_warm_start(settings, TASKS["lookup"], chars, source.prompts, ids)
    assert len(batches) == 3 and all(len(b) == 8 for b in batches)
    by_text = {tuple(ids[p.index]): p for p in prompts}
    for batch in batches:
        assert batch.advantages == [1.0] * 8 and batch.demonstrations
        for tokens, length, mask in zip(
            batch.tokens, batch.prompt_lengths, batch.loss_masks, strict=True
        ):
            prompt = by_text[tuple(tokens[:length])]
            assert (tokens[length:], mask) == demonstration_ids(TASKS["lookup"], prompt, chars)
    again = build_warm_start(settings, TASKS["lookup"], chars, source.prompts, ids)
    other = build_warm_start(
        WarmStartSettings(3, 8, seed=4), TASKS["lookup"], chars, source.prompts, ids
    )
    assert [b.tokens for b in again] == [b.tokens for b in batches]
    assert [b.tokens for b in other] != [b.tokens for b in batches]
    assert (source.epoch, source.position) == (0, 0)
    assert build_warm_start(None, TASKS["lookup"], chars, prompts, ids) == []


def test_the_flag_is_refused_where_it_cannot_work() -> None:
    """Demonstrations come from a built-in task; with --max-staleness (its rollout
    correction on) the warm start is taken: no correction weighs demonstrations."""
    line = (
        "--sft-warmup-steps trains the demonstrations of a built-in task (--prompt-data "
        "builtin:NAME); drop it for other prompt data"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        parse_args(["--prompt-data", "reasoning-gym:gcd", "--sft-warmup-steps", "2"], for_run=True)
    args = parse_args(["--prompt-data", "builtin:lookup", "--max-staleness", "1"], for_run=True)
    assert args.use_tis and args.sft_warmup_steps == 30


def test_the_lookup_demo_warms_up_by_default() -> None:
    args = parse_args(["--prompt-data", "builtin:lookup"], for_run=True)
    assert args.sft_warmup_steps == 30
    assert parse_args([], for_run=True).sft_warmup_steps == 0


def test_a_run_trains_the_demonstrations_before_its_first_rollout(tmp_path: Path) -> None:
    """After the warm start and one rollout, greedy decoding calls the tool on many held-out
    keys (0.44 measured); the same run without it calls on none (0.00, eval reward 0.00:
    measured 2026-12-05), nor does the untrained model in test_embedded_learning."""
    from tests.cpu.test_trainer import _train

    out = tmp_path / "o"
    _train(
        *("--prompt-data", "builtin:lookup", "--sft-warmup-steps", "30"),
        *("--rollout-batch-size", "16", "--num-rollout", "1", "--output-dir", str(out)),
        cwd=tmp_path,
    )
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first["warmup/steps"] == 30 and first["warmup/grad_norm"] > 0
    final = json.loads((out / "summary.json").read_text())["final_eval"]
    assert final["eval/calling_frac"] >= 0.2 and final["eval/reward_mean"] > 0.1
