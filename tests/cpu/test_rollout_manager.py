"""RolloutManager: dynamic sampling, failed rewards, and the batch it hands to training.

Proves, with the real prompt loader, character tokenizer, reward scorers
(``--rm-type exact`` and a ``--custom-rm-path`` function that raises or times
out) and advantage code, that:

- with ``--dynamic-sampling-filter`` groups whose rewards all agree are dropped
  and new prompts drawn until ``--rollout-batch-size`` groups are kept, with
  exact ``prompts_drawn`` / ``groups_filtered`` / ``groups_short`` counts, the
  rows trained named in ``rollout/prompt_indices``, and a new seed per round; at
  ``--dynamic-sampling-max-rounds`` the rounds stop and dropped groups fill the
  batch (advantage 0, counted as short); without the filter one round is all there is;
- with ``--over-sampling-factor`` F a round asks for ceil(F x missing) groups, keeps
  the first that pass and counts the passing rest as surplus (default 1.5 with the
  filter);
- ``--use-tis`` without the engine's per-token log-probs stops with one line;
- when the prompts run out the short batch is filled from dropped groups if it
  can be, else ``DataExhausted``; the default run length (``run_length``) is as many
  rollouts as the data feeds at the prompts one draws, over-sampling included, and an
  explicit --num-rollout the data cannot feed is refused;
- a sample whose reward raised or timed out has an all-zero loss mask and
  advantage 0, the others' advantages are those of the group with the failed
  sample scoring the mean of the rest (worked out by hand here), and
  ``rollout/reward_failures`` counts it, filtered groups included, with one
  warning per round that had failures.

The engine is a scripted stand-in (the engine is not under test here; the real
ones have their own tests): it answers each prompt with fixed responses.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from vime.config import parse_args
from vime.config.rollout_settings import reward_settings, rollout_settings
from vime.data.prompts import PromptSource, load_prompts, render_prompt
from vime.data.tasks import CHARSET
from vime.models.embedded import build_tokenizer
from vime.rollout.agent import AgentRollouts, Trajectory, Turn
from vime.rollout.manager import (
    PROMPT_INDICES_KEY,
    DataExhausted,
    RolloutManager,
    rollout_seed,
)
from vime.rollout.rewards import build_reward_scorer
from vime.rollout.types import Completion, SamplingParams

N = 4  # samples per prompt
RIGHT, WRONG = ["ab"] * N, ["x"] * N  # label "ab": all 1.0 / all 0.0 (they agree)
MIXED = ["ab", "x", "ab", "x"]  # rewards 1, 0, 1, 0: kept

FLAKY_REWARD = """
import asyncio

async def reward(args, sample):
    if sample.response == "boom":
        raise RuntimeError("reward service hiccup")
    if sample.response == "slow":
        await asyncio.sleep(30)
    return float(sample.response == sample.label)
"""


# An estimator that keeps and hands back the rewards it was given: what estimators see.
IDENTITY_ADVANTAGE = """
SEEN = []

def advantages(rewards, n_samples_per_prompt, estimator="grpo", eps=1e-6):
    SEEN.append(rewards.tolist())
    return rewards.clone()
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CHARSET)


class ScriptedEngine:
    """A RolloutEngine answering prompt k with ``script[k]``, one completion per response.

    Each response ends with EOS; its log-probs are -0.1, -0.2, ... so that the
    batch can be checked to carry the engine's numbers.
    """

    weight_version = 0

    def __init__(self, tokenizer, script: list[list[str]], texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.by_text = dict(zip(texts, script, strict=True))
        self.calls: list[tuple[list[str], SamplingParams]] = []

    def response_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        texts = [self.tokenizer.decode(ids) for ids in prompts]
        self.calls.append((texts, params))
        out = []
        for ids, text in zip(prompts, texts, strict=True):
            responses = self.by_text[text]
            assert len(responses) == params.n
            group = []
            for response in responses:
                rids = self.response_ids(response)
                logps = [-0.1 * (k + 1) for k in range(len(rids))]
                group.append(Completion(list(ids), rids, logps, "stop"))
            out.append(group)
        return out

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        raise NotImplementedError

    def update_weights(self, buckets, version: int) -> None:
        raise NotImplementedError

    def sleep(self) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


def _setup(
    tmp_path: Path, tokenizer, script: list[list[str]], *flags: str, warn=None, agent_fn=None
):
    """A manager over prompts "q0=", "q1=", ... (label "ab"), drawn in file order;
    ``agent_fn``: multi-turn trajectories from that generate function."""
    texts = [f"q{i}=" for i in range(len(script))]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "label": "ab"}) + "\n" for t in texts))
    args = parse_args(
        [
            "--prompt-data",
            str(data),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            str(N),
            "--global-batch-size",
            str(2 * N),
            "--seed",
            "7",
            *flags,
        ]
    )
    prompts = load_prompts(str(data), require_label=True)
    ids = {p.index: render_prompt(p.text, tokenizer, False) for p in prompts}
    engine = ScriptedEngine(tokenizer, script, texts)
    manager = RolloutManager(
        rollout_settings(args),
        engine,
        tokenizer,
        build_reward_scorer(reward_settings(args)),
        PromptSource(prompts, shuffle=False),
        ids,
        warn=warn or (lambda line: None),
        agent=None if agent_fn is None else AgentRollouts(agent_fn, engine, 32),
    )
    return manager, engine


def _texts_of(manager: RolloutManager, batch) -> list[str]:
    """Each sample's prompt text, read back from its tokens."""
    return [
        manager.tokenizer.decode(t[:n])
        for t, n in zip(batch.tokens, batch.prompt_lengths, strict=True)
    ]


EXACT_ROUNDS = ("--dynamic-sampling-filter", "--over-sampling-factor", "1")


def test_dynamic_sampling_draws_until_the_batch_is_full(tmp_path, tokenizer) -> None:
    script = [RIGHT, MIXED, WRONG, MIXED, MIXED, MIXED]
    manager, engine = _setup(tmp_path, tokenizer, script, "--rm-type", "exact", *EXACT_ROUNDS)
    batch, metrics = manager.generate(0)
    # Round 0 draws q0 (agrees) and q1; round 1 draws q2 (agrees); round 2 draws q3.
    assert [texts for texts, _ in engine.calls] == [["q0=", "q1="], ["q2="], ["q3="]]
    assert [params.seed for _, params in engine.calls] == [rollout_seed(7, 0, r) for r in range(3)]
    assert len({params.seed for _, params in engine.calls}) == 3
    assert _texts_of(manager, batch) == ["q1="] * N + ["q3="] * N
    assert metrics["rollout/prompts_drawn"] == 4.0
    assert metrics[PROMPT_INDICES_KEY] == [1, 3]  # the rows trained, not those dropped
    assert metrics["rollout/groups_filtered"] == 2.0
    assert metrics["rollout/groups_short"] == 0.0
    assert metrics["rollout/reward_failures"] == 0.0
    assert metrics["rollout/reward_mean"] == 0.5  # kept groups only: the dropped ones scored 1, 0
    # Samples are prompt + response tokens, the engine's log-probs and a full mask.
    right = engine.response_ids("ab")
    assert batch.tokens[0] == manager.prompt_ids[1] + right
    assert batch.prompt_lengths == [3] * 2 * N
    assert batch.rollout_log_probs[0] == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.loss_masks == [[1] * len(right), [1, 1], [1] * len(right), [1, 1]] * 2
    # grpo on 1, 0, 1, 0: ±0.5 / std (Bessel: sqrt(1/3)).
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert batch.advantages == pytest.approx([a, -a, a, -a] * 2, rel=1e-9)

    # The next rollout continues after q3: q4 and q5 are kept in one round.
    batch, metrics = manager.generate(1)
    assert _texts_of(manager, batch) == ["q4="] * N + ["q5="] * N
    assert metrics["rollout/prompts_drawn"] == 2.0 and metrics["rollout/groups_filtered"] == 0.0
    assert metrics[PROMPT_INDICES_KEY] == [4, 5]
    assert len(engine.calls) == 4
    with pytest.raises(DataExhausted, match="the prompts ran out during rollout 2"):
        manager.generate(2)
    assert len(engine.calls) == 4  # nothing left to generate from


def test_round_bound_fills_with_agreeing_groups(tmp_path, tokenizer) -> None:
    script = [RIGHT, WRONG, RIGHT, WRONG, MIXED, MIXED]
    flags = ["--rm-type", "exact", *EXACT_ROUNDS, "--dynamic-sampling-max-rounds"]
    manager, engine = _setup(tmp_path, tokenizer, script, *flags, "2")
    batch, metrics = manager.generate(0)
    # Two rounds of two agreeing groups, then the bound: q4 and q5 are never drawn.
    assert [texts for texts, _ in engine.calls] == [["q0=", "q1="], ["q2=", "q3="]]
    assert _texts_of(manager, batch) == ["q0="] * N + ["q1="] * N  # the first dropped fill it
    assert batch.advantages == [0.0] * 2 * N
    assert all(set(mask) == {1} for mask in batch.loss_masks)
    assert metrics["rollout/prompts_drawn"] == 4.0
    assert metrics["rollout/groups_short"] == 2.0
    assert metrics["rollout/groups_filtered"] == 2.0  # q2 and q3: dropped and not used


def test_over_sampling_asks_for_more_and_keeps_the_first_that_pass(tmp_path, tokenizer) -> None:
    """A round asks for ceil(F x missing) groups, keeps the first that pass in prompt
    order and counts the passing rest as surplus; the next rollout starts after them."""
    script = [RIGHT, MIXED, MIXED, MIXED, WRONG, WRONG, MIXED, WRONG, WRONG, MIXED]
    flags = ["--rm-type", "exact", "--dynamic-sampling-filter", "--over-sampling-factor", "2"]
    manager, engine = _setup(tmp_path, tokenizer, script, *flags)
    batch, metrics = manager.generate(0)
    assert [texts for texts, _ in engine.calls] == [["q0=", "q1=", "q2=", "q3="]]
    assert _texts_of(manager, batch) == ["q1="] * N + ["q2="] * N
    assert metrics["rollout/prompts_drawn"] == 4.0
    assert metrics["rollout/groups_surplus"] == 1.0  # q3 passed, not needed
    assert metrics["rollout/groups_filtered"] == 1.0
    # Round 0 draws q4-q7 (q6 passes); round 1 asks ceil(2 x 1) = 2: q8 agrees, q9 passes.
    batch, metrics = manager.generate(1)
    assert [texts for texts, _ in engine.calls[1:]] == [
        ["q4=", "q5=", "q6=", "q7="],
        ["q8=", "q9="],
    ]
    assert _texts_of(manager, batch) == ["q6="] * N + ["q9="] * N
    assert metrics["rollout/prompts_drawn"] == 6.0 and metrics["rollout/groups_surplus"] == 0.0
    assert metrics["rollout/groups_filtered"] == 4.0


def test_correction_without_the_engines_log_probs_is_refused(tmp_path, tokenizer) -> None:
    """--use-tis where the rollout carries no per-token log-probs stops with one line."""
    from vime.errors import ConfigError

    manager, engine = _setup(tmp_path, tokenizer, [MIXED], "--rm-type", "exact", "--use-tis")
    real = engine.generate

    def without_log_probs(prompts, params):
        return [[c.__class__(c.prompt_ids, c.response_ids, [], c.finish_reason) for c in g]
                for g in real(prompts, params)]  # fmt: skip

    engine.generate = without_log_probs
    manager.settings = dataclasses.replace(manager.settings, batch_size=1)
    with pytest.raises(ConfigError, match="--use-tis weights each token by the engine's log-prob"):
        manager.generate(0)


def test_over_sampling_defaults_on_with_the_filter() -> None:
    flags = ["--prompt-data", "builtin:reverse", "--dynamic-sampling-filter"]
    assert parse_args(flags).over_sampling_factor == 1.5
    assert parse_args(["--prompt-data", "builtin:reverse"]).over_sampling_factor is None


def test_without_the_filter_agreeing_groups_are_trained_on(tmp_path, tokenizer) -> None:
    manager, engine = _setup(tmp_path, tokenizer, [RIGHT, WRONG, MIXED], "--rm-type", "exact")
    batch, metrics = manager.generate(0)
    assert len(engine.calls) == 1
    assert _texts_of(manager, batch) == ["q0="] * N + ["q1="] * N
    assert batch.advantages == [0.0] * 2 * N
    assert metrics["rollout/prompts_drawn"] == 2.0
    assert "rollout/groups_filtered" not in metrics and "rollout/groups_short" not in metrics
    # One prompt left, two wanted: the data ran out mid-rollout.
    with pytest.raises(DataExhausted, match="during rollout 1"):
        manager.generate(1)
    assert engine.calls[-1][0] == ["q2="]


def test_prompts_running_out_fill_from_dropped_groups(tmp_path, tokenizer) -> None:
    script = [RIGHT, MIXED, WRONG]
    manager, engine = _setup(tmp_path, tokenizer, script, "--rm-type", "exact", *EXACT_ROUNDS)
    batch, metrics = manager.generate(0)
    # Round 1 gets the last prompt, which agrees; no more rounds are possible.
    assert [texts for texts, _ in engine.calls] == [["q0=", "q1="], ["q2="]]
    assert _texts_of(manager, batch) == ["q1="] * N + ["q0="] * N
    assert metrics["rollout/groups_short"] == 1.0 and metrics["rollout/groups_filtered"] == 1.0
    assert batch.advantages[N:] == [0.0] * N


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_failed_rewards_are_excluded_from_the_loss(tmp_path, tokenizer, estimator) -> None:
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    script = [["ab", "boom", "x", "slow"], ["ab", "x", "x", "ab"]]
    lines: list[str] = []
    flags = ["--custom-rm-path", f"{tmp_path / 'flaky.py'}:reward", "--rm-timeout", "0.2"]
    manager, _ = _setup(
        tmp_path, tokenizer, script, *flags, "--advantage-estimator", estimator, warn=lines.append
    )
    batch, metrics = manager.generate(0)
    assert metrics["rollout/reward_failures"] == 2.0
    assert metrics["rollout/reward_mean"] == 0.5  # the 6 rewards that did not fail: 1,0 and 1,0,0,1
    # The failed samples ("boom", "slow": 5 tokens with EOS) train on nothing.
    assert batch.loss_masks[1] == [0] * 5 and batch.loss_masks[3] == [0] * 5
    assert batch.advantages[1] == 0.0 and batch.advantages[3] == 0.0
    assert all(set(batch.loss_masks[i]) == {1} for i in (0, 2, 4, 5, 6, 7))
    # Group 0 is trained as if only its scored samples (1 and 0) had been drawn: a group
    # of two, whose std is sqrt(0.5) and whose rloo factor is 2/1. Group 1: four scored.
    if estimator == "grpo":
        g0 = 0.5 / (math.sqrt(0.5) + 1e-6)
        g1 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    elif estimator == "rloo":
        g0, g1 = 1.0, 0.5 * 4 / 3
    else:
        g0 = g1 = 0.5
    expected = [g0, 0.0, -g0, 0.0, g1, -g1, -g1, g1]
    assert batch.advantages == pytest.approx(expected, rel=1e-9)
    assert len(lines) == 1
    assert lines[0].startswith("vime: rollout 0: reward (custom ")
    assert "2 of 8 samples failed" in lines[0]
    assert "sample 1: raised RuntimeError: reward service hiccup" in lines[0]
    assert "sample 3: timed out after 0.2 s (--rm-timeout)" in lines[0]


def test_estimators_see_a_failed_sample_as_its_groups_mean(tmp_path, tokenizer) -> None:
    """The rule itself, through a custom estimator: the failed sample's reward is replaced
    by the mean of its group's scored rewards, and its advantage is 0 whatever comes back."""
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    (tmp_path / "adv.py").write_text(IDENTITY_ADVANTAGE)
    script = [["ab", "boom", "ab", "x"], ["boom"] * N]
    flags = [
        "--custom-rm-path",
        f"{tmp_path / 'flaky.py'}:reward",
        "--custom-advantage-function-path",
        f"{tmp_path / 'adv.py'}:advantages",
    ]
    manager, _ = _setup(tmp_path, tokenizer, script, *flags)
    batch, metrics = manager.generate(0)
    # Group 0 scored 1, 1, 0: the failed one counts as 2/3; group 1 has no score: 0.
    assert manager.advantage_fn.__globals__["SEEN"] == [[1.0, 2 / 3, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert batch.advantages == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [sum(m) for m in batch.loss_masks] == [3, 0, 3, 2, 0, 0, 0, 0]
    assert metrics["rollout/reward_failures"] == 5.0


def test_failures_in_filtered_groups_are_counted_and_reported(tmp_path, tokenizer) -> None:
    """Round 0's failures stay in the count and the warnings after round 1 scores clean."""
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    script = [["boom"] * N, MIXED, MIXED]
    lines: list[str] = []
    flags = ["--custom-rm-path", f"{tmp_path / 'flaky.py'}:reward", *EXACT_ROUNDS]
    manager, engine = _setup(tmp_path, tokenizer, script, *flags, warn=lines.append)
    batch, metrics = manager.generate(0)
    assert len(engine.calls) == 2
    assert _texts_of(manager, batch) == ["q1="] * N + ["q2="] * N
    assert metrics["rollout/reward_failures"] == 4.0
    assert metrics["rollout/groups_filtered"] == 1.0  # a group with no reward carries no signal
    assert len(lines) == 1 and lines[0].startswith("vime: rollout 0: reward (custom ")
    assert "4 of 8 samples failed" in lines[0]


def test_reward_sees_a_chat_message_prompt_as_the_text_the_model_was_given(
    tmp_path, tokenizer
) -> None:
    """A row of chat messages reaches the reward as text (``RewardInput.prompt`` is a
    string): the templated prompt, decoded from the ids the engine was given; a string
    row reaches it as written."""
    from vime.data.prompts import Prompt

    manager, _ = _setup(tmp_path, tokenizer, [RIGHT], "--rm-type", "exact")
    messages = Prompt(text=[{"role": "user", "content": "q9="}], label="ab", index=0)
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "<q9="]
    assert manager._prompt_text(messages, ids) == tokenizer.decode(ids)
    assert isinstance(manager._prompt_text(messages, ids), str)
    assert manager._prompt_text(Prompt(text="q0=", label="ab", index=0), ids) == "q0="


TRAJECTORY_REWARD = """
def reward(args, sample):
    # The final answer is the response; the whole trajectory and its metadata come too.
    if sample.trajectory != "calc<eos> 4=" + sample.response or sample.metadata != {"turns": 2}:
        raise ValueError(f"unexpected {sample.trajectory!r} {sample.metadata!r}")
    return float(sample.response == sample.label)
"""


def test_trajectories_train_the_models_tokens_and_reward_the_final_answer(
    tmp_path, tokenizer
) -> None:
    """A multi-turn trajectory's environment tokens reach the batch with mask 0; the
    reward reads the final answer as the response, and the trajectory whole; a reward
    the generate function gives itself replaces the scorer's; the agent metrics count
    turns, calls and model against environment tokens."""
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    async def gen(sample, engine):
        traj = Trajectory(metadata={"turns": 2}, tool_calls=1)
        traj.add_turn(Turn([*ids("calc"), eos], [-0.5] * 5, "stop"))
        traj.add_env(ids(" 4="))
        answer = "ab" if sample.sample_index % 2 == 0 else "x"
        traj.add_turn(Turn([*ids(answer), eos], [-0.25] * (len(answer) + 1), "stop"))
        if sample.sample_index == 3:
            traj.reward = 0.5
        return traj

    rm = tmp_path / "rm.py"
    rm.write_text(TRAJECTORY_REWARD)
    manager, _ = _setup(
        tmp_path, tokenizer, [RIGHT] * 2, "--custom-rm-path", f"{rm}:reward", agent_fn=gen
    )
    batch, metrics = manager.generate(0)
    assert metrics["rollout/reward_failures"] == 0
    assert metrics["rollout/reward_mean"] == pytest.approx((1 + 0 + 1 + 0.5) / 4)
    for k, mask in enumerate(batch.loss_masks):
        answer = 3 if k % 2 == 0 else 2
        assert mask == [1] * 5 + [0] * 3 + [1] * answer
        assert batch.rollout_log_probs[k] == [-0.5] * 5 + [0.0] * 3 + [-0.25] * answer
    assert batch.advantages[0] > 0 > batch.advantages[1]
    assert metrics["agent/turns_mean"] == 2 and metrics["agent/tool_calls"] == 8
    assert metrics["agent/calling_frac"] == 1.0 and metrics["agent/env_tokens_mean"] == 3
    assert metrics["agent/model_tokens_mean"] == pytest.approx(5 + 2.5)


def test_a_trajectory_with_its_own_prompt_trains_after_it(tmp_path, tokenizer) -> None:
    """A generate function that rendered its own prompt (the OpenAI endpoint's agents,
    one per sample) has each sample trained after its prompt, not its group's first."""
    eos = tokenizer.eos_token_id

    async def gen(sample, engine):
        traj = Trajectory(reward=1.0 if sample.sample_index else 0.0)
        traj.prompt_ids = [*sample.prompt_ids, *[eos] * sample.sample_index]
        traj.add_turn(Turn([eos], [-0.5], "stop"))
        return traj

    manager, _ = _setup(tmp_path, tokenizer, [RIGHT] * 2, "--rm-type", "exact", agent_fn=gen)
    batch, _ = manager.generate(0)
    for k, (tokens, length) in enumerate(zip(batch.tokens, batch.prompt_lengths, strict=True)):
        extra = k % N
        assert tokens[length - extra : length] == [eos] * extra and tokens[length:] == [eos]
        assert batch.loss_masks[k] == [1]


def test_default_num_rollout_is_what_over_sampling_can_feed(tmp_path, tokenizer) -> None:
    """With --over-sampling-factor 1.5 a rollout of 2 groups draws 3 prompts: the default
    run length over 12 prompts is 4 rollouts, every one of them full, not 12 / 2 = 6."""
    from vime.data.prompts import prompts_per_rollout, run_length

    flags = ["--rm-type", "exact", "--dynamic-sampling-filter", "--over-sampling-factor", "1.5"]
    manager, _ = _setup(tmp_path, tokenizer, [MIXED] * 12, *flags)
    settings = manager.settings
    per_rollout = prompts_per_rollout(settings.batch_size, settings.over_sampling_factor)
    num_rollout = run_length(manager.source, per_rollout)
    assert (per_rollout, num_rollout) == (3, 4)
    for rollout_id in range(num_rollout):
        _, metrics = manager.generate(rollout_id)
        assert metrics["rollout/prompts_drawn"] == 3.0
    assert manager.source.exhausted  # the run uses all the data it was given
    with pytest.raises(DataExhausted):
        manager.generate(num_rollout)


def test_num_rollout_the_data_cannot_feed_is_refused(tmp_path, tokenizer) -> None:
    """An explicit --num-rollout needing more prompts than --num-epoch passes hold stops
    the run before it starts (one line), rather than ending it early mid-LR-schedule."""
    from vime.data.prompts import prompts_per_rollout, run_length
    from vime.errors import ConfigError

    flags = ["--rm-type", "exact", "--dynamic-sampling-filter"]
    manager, _ = _setup(tmp_path, tokenizer, [MIXED] * 12, *flags)
    per_rollout = prompts_per_rollout(2, manager.settings.over_sampling_factor)
    assert run_length(manager.source, per_rollout, requested=4) == 4
    with pytest.raises(ConfigError, match=r"--num-rollout 5 needs 15 prompts .* hold 12;"):
        run_length(manager.source, per_rollout, requested=5)
    # Without over-sampling a rollout draws --rollout-batch-size prompts.
    assert run_length(manager.source, prompts_per_rollout(2, None)) == 6
    with pytest.raises(ConfigError, match="make no full rollout"):
        run_length(manager.source, prompts_per_rollout(13, None))
