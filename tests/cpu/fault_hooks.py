"""Fault injection for the tests: a training rank that dies, an engine that dies or hangs.

``signal_engine_on_generation`` (``test_engine_watch.py``) sends a signal to a rollout
engine's process as the driver hands it a generation; ``on_generation`` and
``on_training`` run any action there, or while the ranks train (a Ray node removed:
``test_multinode_faults.py``).

The loss hook below kills the training rank once, for the ``--auto-resume`` tests.

Passed as ``--custom-loss-function-path tests/cpu/fault_hooks.py:policy_loss``, it is
vime's own policy loss, except that with ``VIME_TEST_KILL_RANK=<output dir>:<rollout>``
in the environment (Ray's workers inherit it) the first rank to train that rollout
(known from metrics.jsonl: the line before it is written) ends its process with
``os._exit(1)``, once: the marker file ``<output dir>/rank_killed`` is made first, so a
rank of the restarted run trains on. The metrics logged until then are copied to
``<output dir>/metrics_before_kill.jsonl`` first, for the test to compare the restarted
run's lines with. Not a flag: a test hook only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from vime.algo.losses import policy_loss as vime_policy_loss
from vime.tracking import METRICS_FILE, read_metrics

KILL_VAR = "VIME_TEST_KILL_RANK"
MARKER = "rank_killed"
BEFORE_KILL = "metrics_before_kill.jsonl"


def _kill_due() -> bool:
    spec = os.environ.get(KILL_VAR)
    if not spec:
        return False
    output_dir, _, rollout = spec.rpartition(":")
    logged = read_metrics(os.path.join(output_dir, METRICS_FILE))
    if not logged or logged[-1]["rollout_id"] != int(rollout) - 1:
        return False
    try:  # only one rank, once: O_EXCL fails for every later caller
        os.close(os.open(os.path.join(output_dir, MARKER), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    shutil.copyfile(os.path.join(output_dir, METRICS_FILE), os.path.join(output_dir, BEFORE_KILL))
    return True


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's policy loss; first ends this rank's process when ``KILL_VAR`` says so."""
    if _kill_due():
        os._exit(1)
    return vime_policy_loss(logp, old_logp, advantages, mask, **kwargs)


def on_generation(group: Any, call: int, act: Callable[[], None], engine: int = 0) -> list[int]:
    """Run ``act()`` right after the driver hands engine ``engine`` of a real
    ``EngineGroup`` its ``call``-th generation (0 first), once: the engine is then lost
    holding that work, as a generation takes far longer than ``act``. A test hook (its
    generations pass ``_track``), never a flag. Returns the engine's pid at that moment,
    once it has fired, for the test to check."""
    track, seen, fired = group._track, [0], []

    def tracked(target: int, ref: Any) -> Any:
        ref = track(target, ref)
        if target == engine:
            if seen[0] == call:
                fired.append(group._pids[engine])
                act()
            seen[0] += 1
        return ref

    group._track = tracked
    return fired


def signal_engine_on_generation(group: Any, call: int, signum: int, engine: int = 0) -> list[int]:
    """Send ``signum`` to engine ``engine``'s process (on this node) as it is handed its
    ``call``-th generation (``on_generation``): it dies (SIGKILL) or hangs (SIGSTOP)."""
    return on_generation(group, call, lambda: os.kill(group._pids[engine], signum), engine)


def on_training(call: int, act: Callable[[Any], None]) -> Callable[..., Any]:
    """A ``RayTrainGroup.train`` that runs ``act(group)`` once, right after the ranks are
    handed their ``call``-th training step of this process (0 first), then waits for them
    as the real one does: the fault lands while they train. Set on the class by the test
    (the run builds its own group), never a flag."""
    from vime.ray.errors import wait_all

    seen = [0]

    def train(group: Any, schedule_ref: Any) -> dict[str, float]:
        refs = group.submit("train", schedule_ref)
        if seen[0] == call:
            act(group)
        seen[0] += 1
        return wait_all(refs, "training")[0]

    return train


async def two_turns(sample: Any, engine: Any) -> Any:
    """A generate function (``--custom-generate-function-path``) of two model turns with
    environment tokens between (the first turn's own ids, valid for any vocabulary):
    multi-turn trajectories whatever the model writes."""
    from vime.rollout.agent import Trajectory

    traj = Trajectory()
    first = await engine.generate(sample.prompt_ids, max_new_tokens=2)
    traj.add_turn(first)
    traj.add_env(first.token_ids)
    second = await engine.generate(sample.prompt_ids + traj.response_ids)
    traj.add_turn(second)
    return traj
