"""The multi-turn seam (``vime.rollout.agent``): lock-step turns, seeds, trajectories.

Proves that every engine call holds every live sample's turn, in sample order,
each named by (sample, turn) in ``prompt_indices`` whatever the order the samples
asked in; that a turn sampled with a larger budget is cut to its own; that a
generate function's trajectory becomes a ``Completion`` with its mask, log-probs,
weight versions and stats, and a malformed one is refused naming the function
and sample; and, on the real hf engine, token in / token out: each model turn is
exactly what the engine draws for that context and seed, and its log-probs are
the engine's own scores of those tokens.
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch
from tiny_models import save_tiny, tiny_qwen3_config

from vime.data.prompts import Prompt
from vime.errors import ConfigError
from vime.rollout.agent import (
    CALLS_PER_SAMPLE,
    AgentRollouts,
    Trajectory,
    load_generate_function,
)
from vime.rollout.engines.hf import HFEngine
from vime.rollout.types import Completion, SamplingParams

EOS = 1
ENV = [7, 8, 9]  # what the test's environment appends after a turn


class Recorder:
    """An engine stand-in that answers turn t of a sample with t + 1 copies of token
    10 + sample, then EOS, and records every call."""

    def __init__(self, versions: tuple[int, int] = (3, 3)) -> None:
        self.calls: list[tuple[tuple[int, ...], list[list[int]], int]] = []
        self.versions = versions

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        assert params.n == 1 and params.prompt_indices is not None
        self.calls.append(
            (params.prompt_indices, [list(p) for p in prompts], params.max_new_tokens)
        )
        out = []
        for prompt, stream in zip(prompts, params.prompt_indices, strict=True):
            sample, turn = divmod(stream, CALLS_PER_SAMPLE)
            ids = [10 + sample] * (turn + 1) + [EOS]
            ids = ids[: params.max_new_tokens]
            finish = "stop" if ids[-1] == EOS else "length"
            logps = [-0.5] * len(ids)
            out.append([Completion(prompt, ids, logps, finish, weight_versions=self.versions)])
        return out


def _turns(
    count_of: dict[int, int], delays: dict[int, float] | None = None, per_turn: int | None = None
):
    """A generate function: sample i takes ``count_of[i]`` turns (of ``per_turn`` tokens
    at most), the environment appending ``ENV`` after each but the last, after ``delays``
    seconds."""

    async def fn(sample, engine):
        traj = Trajectory()
        for t in range(count_of[sample.index]):
            if t:
                await asyncio.sleep((delays or {}).get(sample.index, 0.0) * random.random())
                traj.add_env(ENV)
            traj.add_turn(await engine.generate(sample.prompt_ids + traj.response_ids, per_turn))
        traj.metadata = {"who": sample.index}
        return traj

    return fn


def _prompts(k: int) -> tuple[list[Prompt], list[list[int]]]:
    return [Prompt(index=i, text=f"p{i}", label=None) for i in range(k)], [
        [2, 3 + i] for i in range(k)
    ]


def test_turns_go_in_lock_step_whatever_order_samples_ask_in() -> None:
    """Each call holds every live sample's turn, sorted, named by (sample, turn); delays
    that reorder the requests change nothing."""
    counts = {0: 1, 1: 3, 2: 2, 3: 3}
    prompts, ids = _prompts(2)
    params = SamplingParams(n=2, max_new_tokens=16, seed=5)
    runs = []
    for delays in (None, {1: 0.02, 2: 0.01, 3: 0.03}, {3: 0.02, 1: 0.01}):
        engine = Recorder()
        groups = AgentRollouts(_turns(counts, delays), engine, budget=16).generate(
            prompts, ids, params
        )
        runs.append((engine.calls, groups))
    calls, groups = runs[0]
    assert [c[0] for c in calls] == [
        (0, CALLS_PER_SAMPLE, 2 * CALLS_PER_SAMPLE, 3 * CALLS_PER_SAMPLE),
        (CALLS_PER_SAMPLE + 1, 2 * CALLS_PER_SAMPLE + 1, 3 * CALLS_PER_SAMPLE + 1),
        (CALLS_PER_SAMPLE + 2, 3 * CALLS_PER_SAMPLE + 2),
    ]
    for other_calls, other_groups in runs[1:]:
        assert other_calls == calls and other_groups == groups
    # Sample 1's third call sees its prompt, two turns and two environment inserts.
    third = calls[2][1][0]
    assert third == [2, 3, 11, EOS, *ENV, 11, 11, EOS, *ENV]
    one = groups[0][1]
    assert one.response_ids == [11, EOS, *ENV, 11, 11, EOS, *ENV, 11, 11, 11, EOS]
    assert one.loss_mask == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert one.log_probs == [-0.5 if m else 0.0 for m in one.loss_mask]
    assert one.extra["agent"]["turns"] == 3 and one.extra["agent"]["answer_start"] == 11
    assert one.extra["agent"]["metadata"] == {"who": 1}
    assert one.weight_versions == (3, 3) and one.prompt_ids == [2, 3]


def test_a_turn_drawn_with_a_larger_budget_is_cut_to_its_own() -> None:
    """The call asks for the largest room among its turns; each turn keeps only its own."""

    async def fn(sample, engine):
        traj = Trajectory()
        room = 2 if sample.index == 0 else 9
        traj.add_turn(await engine.generate(sample.prompt_ids, max_new_tokens=room))
        traj.add_turn(await engine.generate(sample.prompt_ids + traj.response_ids, room))
        return traj

    engine = Recorder()
    prompts, ids = _prompts(2)
    groups = AgentRollouts(fn, engine, budget=9).generate(prompts, ids, SamplingParams(n=1))
    assert [c[2] for c in engine.calls] == [9, 9]
    short, long = groups[0][0], groups[1][0]
    assert short.response_ids == [10, EOS, 10, 10] and short.finish_reason == "length"
    assert long.response_ids == [11, EOS, 11, 11, EOS] and long.finish_reason == "stop"


def test_the_budget_counts_every_token_after_the_prompt() -> None:
    """With no ``max_new_tokens`` a turn gets what is left of the budget, env included;
    none left: an empty "length" turn, no call."""

    async def fn(sample, engine):
        traj = Trajectory()
        traj.add_turn(await engine.generate(sample.prompt_ids))
        traj.add_env([5] * 4)
        traj.add_turn(await engine.generate(sample.prompt_ids + traj.response_ids))
        return traj

    engine = Recorder()
    prompts, ids = _prompts(1)
    (group,) = AgentRollouts(fn, engine, budget=6).generate(prompts, ids, SamplingParams(n=1))
    assert [c[2] for c in engine.calls] == [6]
    assert group[0].response_ids == [10, EOS, 5, 5, 5, 5] and group[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return 3", "returned int, expected a Trajectory"),
        ("return Trajectory([1, 2], [1], [0.0, 0.0])", "differ in length (2, 1, 2)"),
        ("return Trajectory([1], [2], [0.0])", "values other than 0 and 1"),
    ],
)
def test_a_malformed_trajectory_names_the_function_and_sample(body: str, message: str) -> None:
    """What the function returns is checked before it reaches training."""
    scope: dict = {"Trajectory": Trajectory}
    exec(f"async def bad(sample, engine):\n    {body}", scope)
    prompts, ids = _prompts(1)
    with pytest.raises((TypeError, ValueError), match=rf"my_fn: sample 0: .*{re.escape(message)}"):
        AgentRollouts(scope["bad"], Recorder(), 8, name="my_fn").generate(
            prompts, ids, SamplingParams(n=1)
        )


def test_a_function_that_raises_stops_the_rollout_with_its_error() -> None:
    """A bug in a generate function is the user's to see, not swallowed; the other
    samples' turns do not hang on it."""

    async def fn(sample, engine):
        traj = Trajectory()
        traj.add_turn(await engine.generate(sample.prompt_ids))
        if sample.index == 1:
            raise RuntimeError("my environment broke")
        traj.add_turn(await engine.generate(sample.prompt_ids + traj.response_ids))
        return traj

    prompts, ids = _prompts(3)
    with pytest.raises(RuntimeError, match="my environment broke"):
        AgentRollouts(fn, Recorder(), 8).generate(prompts, ids, SamplingParams(n=1))


def test_load_generate_function_refusals(tmp_path) -> None:
    """The flag names an async (sample, engine) function; anything else is one line."""
    path = tmp_path / "gen.py"
    path.write_text(
        "async def good(sample, engine):\n    pass\n"
        "def sync(sample, engine):\n    pass\n"
        "async def wrong(prompt, engine):\n    pass\n"
    )
    assert load_generate_function(f"{path}:good").__name__ == "good"
    with pytest.raises(ConfigError, match="sync is not async; define it with 'async def"):
        load_generate_function(f"{path}:sync")
    with pytest.raises(ConfigError, match=r"--custom-generate-function-path .*wrong"):
        load_generate_function(f"{path}:wrong")
    with pytest.raises(ConfigError, match="no attribute 'missing'"):
        load_generate_function(f"{path}:missing")


# ----- the real hf engine: token in, token out --------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HFEngine:
    config = tiny_qwen3_config(vocab_size=48, tie=True)
    config.initializer_range = 0.3
    config.eos_token_id, config.pad_token_id = EOS, 0
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield HFEngine(save_tiny(str(tmp_path_factory.mktemp("agent") / "m"), config, seed=3))
    finally:
        torch.set_num_threads(before)


def check_turns_are_the_engines(engine, seed: int, stop: int) -> None:
    """Three turns with environment tokens between them, 2 prompts x 3 samples: every
    model turn equals the engine's own draw for that context and (sample, turn) seed,
    alone in its call, and its log-probs are the engine's scores of it."""
    counts = dict.fromkeys(range(6), 3)
    prompts, ids = _prompts(2)
    params = SamplingParams(n=3, temperature=1.0, seed=seed, stop_token_ids=(stop,))
    groups = AgentRollouts(_turns(counts, per_turn=6), engine, budget=30).generate(
        prompts, ids, params
    )
    checked = 0
    for g, group in enumerate(groups):
        for j, c in enumerate(group):
            mask, resp = c.loss_mask, c.response_ids
            starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
            for turn, start in enumerate(starts):
                end = start
                while end < len(mask) and mask[end]:
                    end += 1
                context = c.prompt_ids + resp[:start]
                alone = SamplingParams(
                    n=1,
                    max_new_tokens=6,
                    seed=seed,
                    stop_token_ids=(stop,),
                    prompt_indices=((g * 3 + j) * CALLS_PER_SAMPLE + turn,),
                )
                assert engine.generate([context], alone)[0][0].response_ids == resp[start:end]
                scores = engine.score(context + resp[start:end], len(context), 1.0)
                diff = max(abs(a - b) for a, b in zip(scores, c.log_probs[start:end], strict=True))
                assert diff < 1e-4
                checked += 1
            assert all(lp == 0.0 for lp, m in zip(c.log_probs, mask, strict=True) if not m)
    assert checked == 18


def test_model_turns_are_what_the_engine_draws_and_scores(engine: HFEngine) -> None:
    """Token in, token out on the hf engine (``check_turns_are_the_engines``)."""
    check_turns_are_the_engines(engine, seed=11, stop=EOS)
