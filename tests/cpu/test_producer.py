"""The asynchronous rollout producer on real Ray actors and hf engines.

Proves, with two engines generating while new weights reach them after every rollout:
no trained group is older than K versions; no prompt is trained twice; a checkpoint's
data position (taken while calls are in flight) resumed by a new producer neither loses
nor repeats a prompt, its pending prompts generated first; a custom generate function's
trajectory with no model turn trains asynchronously as the synchronous loop trains it;
an engine killed while the producer runs stops the next ``take`` within seconds with the
engine named.
"""

from __future__ import annotations

import time

import pytest
import torch

from vime.config.parser import parse_args
from vime.config.rollout_settings import reward_settings, rollout_settings
from vime.data.prompts import PromptSource, load_prompts, render_prompt
from vime.data.tasks import CHARSET, get_task
from vime.models.embedded import load_tokenizer, write_embedded_checkpoint
from vime.ray.cluster import init_local_ray
from vime.ray.errors import ActorFailure
from vime.ray.placement import Layout, reserve
from vime.rollout.agent import AgentRollouts, Trajectory
from vime.rollout.engines.registry import EngineOptions
from vime.rollout.manager import RolloutManager
from vime.rollout.producer import ProducerSettings, RolloutProducer
from vime.rollout.rewards import build_reward_scorer

ray = pytest.importorskip("ray")
K, B = 1, 4


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    from vime.ray.engines import EngineGroup

    checkpoint = write_embedded_checkpoint(
        str(tmp_path_factory.mktemp("producer") / "model"), charset=CHARSET, seed=0
    )
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        layout = Layout(
            num_train=0, num_engines=2, gpus_per_engine=1, colocate=False, use_gpu=False
        )
        options = EngineOptions(seed=0, num_threads=1, tiny_model=True)
        engines = EngineGroup("hf", checkpoint, reserve(layout), options)
        yield checkpoint, engines
    finally:
        ray.shutdown()


def make_manager(checkpoint: str, engines, *, agent_fn=None) -> RolloutManager:
    args = parse_args(
        [
            *("--rollout-batch-size", str(B), "--n-samples-per-prompt", "2"),
            *("--global-batch-size", str(2 * B), "--max-staleness", str(K)),
            *("--rollout-max-response-len", "8", "--seed", "3"),
        ]
    )
    tokenizer = load_tokenizer(checkpoint)
    prompts = load_prompts(args.prompt_data, seed=args.seed)
    ids = {p.index: render_prompt(p.text, tokenizer, False) for p in prompts}
    source = PromptSource(prompts, seed=args.seed)
    scorer = build_reward_scorer(reward_settings(args), get_task("reverse").reward)
    agent = None
    if agent_fn is not None:
        agent = AgentRollouts(agent_fn, engines, args.rollout_max_response_len)
    return RolloutManager(
        rollout_settings(args), engines, tokenizer, scorer, source, ids, agent=agent
    )


def make_producer(
    checkpoint: str, engines, *, state=None, version: int = 0, agent_fn=None
) -> RolloutProducer:
    manager = make_manager(checkpoint, engines, agent_fn=agent_fn)
    pending = []
    if state is not None:
        manager.load_state_dict(state)
        pending = state["pending"]
    settings = ProducerSettings.for_engines(manager.settings, K, len(engines.actors))
    return RolloutProducer(settings, manager, engines, weight_version=version, pending=pending)


def sync(engines, checkpoint: str, version: int) -> None:
    """New weights (the checkpoint's, moved by noise) to every engine as ``version``."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(version)
    named = [
        (n, t + 0.05 * torch.randn(t.shape, generator=gen))
        for n, t in load_file(f"{checkpoint}/model.safetensors").items()
    ]
    ray.get([a.load_weights.remote([named], version) for a in engines.actors])


def train(producer: RolloutProducer, engines, checkpoint, rollouts: range) -> list[int]:
    trained = []
    for r in rollouts:
        batch, metrics = producer.take(r)
        assert len(batch.tokens) == 2 * B
        assert all(r - v <= K for _, v in producer.last_taken)
        assert metrics["async/staleness_max"] <= K
        trained += [p for p, _ in producer.last_taken]
        time.sleep(0.05)  # "training": the engines go on generating meanwhile
        sync(engines, checkpoint, r + 1)
        producer.weights_synced(r + 1)
    return trained


def test_bounded_staleness_and_each_prompt_once_across_a_resume(world) -> None:
    checkpoint, engines = world
    sync(engines, checkpoint, 0)
    first = make_producer(checkpoint, engines)
    first.start()
    try:
        trained = train(first, engines, checkpoint, range(0, 6))
        state = first.state_dict()  # calls are in flight: K rollouts run ahead
    finally:
        first.close()
    assert state["pending"], "nothing was in flight or waiting at the checkpoint"
    assert len(trained) == len(set(trained))
    assert not set(state["pending"]) & set(trained)

    second = make_producer(checkpoint, engines, state=state, version=6)
    second.start()
    try:
        resumed = train(second, engines, checkpoint, range(6, 12))
    finally:
        second.close()
    assert not set(trained) & set(resumed)  # nothing trained twice
    assert len(resumed) == len(set(resumed))
    # Nothing lost, pending first: every prompt pending at the checkpoint is trained in
    # the resumed run's first rollouts (or one more while fresh ones finish beside them).
    soon = resumed[: B * (len(state["pending"]) // B + 2)]
    assert set(state["pending"]) <= set(soon)


async def silent_sometimes(sample, engine) -> Trajectory:
    """A custom generate function: the environment writes sample 0's response, no model
    turn; sample 1 has one model turn on odd prompts, none on even ones."""
    traj = Trajectory()
    if sample.sample_index == 1 and sample.prompt.index % 2:
        traj.add_turn(await engine.generate(sample.prompt_ids, max_new_tokens=4))
    else:
        traj.add_env(sample.prompt_ids[-3:])
    traj.reward = float(sample.sample_index)
    return traj


def rows(batch) -> dict[tuple, tuple]:
    """Each sample of a batch by (prompt ids, place in its group): tokens, mask, log-probs
    and advantage."""
    out = {}
    for k, (tokens, length) in enumerate(zip(batch.tokens, batch.prompt_lengths, strict=True)):
        key = (tuple(tokens[:length]), k % 2)
        logps = batch.rollout_log_probs[k]
        out[key] = (tuple(tokens), tuple(batch.loss_masks[k]), tuple(logps), batch.advantages[k])
    return out


def test_trajectories_without_a_model_turn_train_asynchronously(world) -> None:
    """A trajectory with no model turn (a whole group of them, or beside one that has a
    turn) is taken by the producer and becomes the sample the synchronous loop makes."""
    checkpoint, engines = world
    sync(engines, checkpoint, 0)
    manager = make_manager(checkpoint, engines, agent_fn=silent_sometimes)
    expected = {}
    for r in range(2):
        expected.update(rows(manager.generate(r)[0]))
    producer = make_producer(checkpoint, engines, agent_fn=silent_sometimes)
    producer.start()
    got, taken = {}, []
    try:  # the (K + 1) * B groups admitted at version 0, no weights synced
        for r in range(2):
            batch, metrics = producer.take(r)
            assert metrics["async/staleness_max"] <= K
            got.update(rows(batch))
            taken += [p for p, _ in producer.last_taken]
    finally:
        producer.close()
    assert len(got) == 2 * B * 2 and set(got) == set(expected)
    odd = [p for p in taken if p % 2]
    assert 0 < len(odd) < len(taken), "want groups with and without a model turn"
    for key, (tokens, mask, logps, advantage) in got.items():
        want = expected[key]
        assert advantage == want[3]
        if 1 in mask:  # a model turn: drawn with the producer's own seed
            continue
        assert (tokens, mask, logps) == want[:3]


def test_a_dead_engine_stops_the_next_take(world) -> None:
    """With restarts off (``--max-engine-restarts 0``) an engine killed between two takes
    stops the next one, naming it."""
    from vime.ray.engine_watch import EngineFaults
    from vime.rollout.settings import FaultSettings

    checkpoint, engines = world
    engines.faults = EngineFaults(FaultSettings(max_restarts=0))
    producer = make_producer(checkpoint, engines)
    producer.start()
    try:
        producer.take(0)
        ray.kill(engines.actors[1])
        start = time.monotonic()
        with pytest.raises(ActorFailure, match="rollout engine 1"):
            for r in range(1, 50):
                producer.take(r)
                producer.weights_synced(r)
        assert time.monotonic() - start < 30
    finally:
        producer.close()
