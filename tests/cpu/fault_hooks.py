"""Chaos for the tests: a chosen process killed by its pid at a chosen moment.

A test helper, never a user flag. Every kill goes through ``kill`` (a signal to a pid);
the moment is one of four:

- a rollout engine mid-generation or mid-weight-load: ``signal_engine_on_generation``
  and ``signal_engine_on_weight_load``, driver side, on a real run built in the test's
  own process (``test_engine_watch.py``), signal the engine as the driver hands it a
  generation or a weight load (``on_generation`` runs any action there, and
  ``on_training`` while the ranks train: a Ray node removed, ``test_multinode_faults.py``);
- a training rank mid-step, or the driver mid-checkpoint: ``RankChaos`` in the
  environment of a ``vime-train`` process (Ray's workers inherit it) run with this file
  as its loss (``--custom-loss-function-path tests/cpu/fault_hooks.py:policy_loss``,
  vime's own policy loss otherwise). Mid-step: the rank training the chosen rollout
  kills itself in its loss, the metrics logged until then copied to ``BEFORE_KILL``
  (``test_auto_resume.py``). Mid-checkpoint: rank 0, its shards of the chosen rollout's
  checkpoint written and the commit not begun, kills the driver (its pid in
  ``DRIVER_PID``, written by ``vime_train``) and then itself, as the whole job going
  down mid-save (``test_auto_resume.py``).

Each fires once: the first process to make its marker file (``RankChaos.marker``) does
it, so the run restarted after it trains on. ``two_turns`` is a multi-turn generate function.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vime.algo.losses import policy_loss as vime_policy_loss
from vime.tracking import METRICS_FILE, read_metrics

CHAOS_VAR = "VIME_TEST_CHAOS"
TRAIN_STEP, CHECKPOINT = "train-step", "checkpoint"
BEFORE_KILL = "metrics_before_kill.jsonl"
DRIVER_PID = "driver.pid"


def kill(pid: int, signum: int = signal.SIGKILL) -> int:
    """Send ``signum`` to process ``pid`` (every kill here is this); returns ``pid``."""
    os.kill(pid, signum)
    return pid


def _nth(call: int) -> Any:
    """A counter that says True on its ``call``-th look (0 first), and only then."""
    seen = [-1]

    def look() -> bool:
        seen[0] += 1
        return seen[0] == call

    return look


# ----- rollout engines, from the driver -------------------------------------------------


def on_generation(group: Any, call: int, act: Callable[[], None], engine: int = 0) -> list[int]:
    """Run ``act()`` right after the driver hands engine ``engine`` of a real
    ``EngineGroup`` its ``call``-th generation (0 first), once: the engine is then lost
    holding that work, as a generation takes far longer than ``act``. Its generations
    pass ``_track``. Returns the engine's pid at that moment, once it has fired, for
    the test to check."""
    track, due, fired = group._track, _nth(call), []

    def tracked(target: int, ref: Any) -> Any:
        ref = track(target, ref)
        if target == engine and due():
            fired.append(group._pids[engine])
            act()
        return ref

    group._track = tracked
    return fired


def signal_engine_on_generation(group: Any, call: int, signum: int, engine: int = 0) -> list[int]:
    """Send ``signum`` to engine ``engine``'s process (on this node) as it is handed its
    ``call``-th generation (``on_generation``): it dies (SIGKILL) or hangs (SIGSTOP)
    holding that work."""
    return on_generation(group, call, lambda: kill(group._pids[engine], signum), engine)


def on_training(call: int, act: Callable[[Any], None]) -> Callable[..., Any]:
    """A ``RayTrainGroup.train`` that runs ``act(group)`` once, right after the ranks are
    handed their ``call``-th training step of this process (0 first), then waits for them
    as the real one does: the fault lands while they train. Set on the class by the test
    (the run builds its own group)."""
    from vime.ray.errors import wait_all

    due = _nth(call)

    def train(group: Any, schedule_ref: Any) -> dict[str, float]:
        refs = group.submit("train", schedule_ref)
        if due():
            act(group)
        return wait_all(refs, "training")[0]

    return train


class _SignalAfterLoad:
    """An engine's actor whose ``receive_weights`` call runs ``then`` once handed."""

    def __init__(self, actor: Any, then: Any) -> None:
        self._actor, self._then = actor, then

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._actor, name)
        if name != "receive_weights":
            return method

        def remote(*args: Any) -> Any:
            ref = method.remote(*args)
            self._then()
            return ref

        return SimpleNamespace(remote=remote)


def signal_engine_on_weight_load(
    transport: Any, call: int, signum: int = signal.SIGKILL, engine: int = 0
) -> list[int]:
    """Send ``signum`` to engine ``engine``'s process right after the run's weight
    ``transport`` hands it its ``call``-th weight load (0 first; a sync or a restart's
    restore): the engine dies holding the load, waiting for the buckets or loading
    them. On a transport whose syncs take the engines' actors from ``_actors`` (the
    CPU's object store, disk). Returns the pids signalled (one, once it has fired)."""
    actors_of, due, signalled = transport._actors, _nth(call), []
    group = transport.engines

    def actors(engines: list[int] | None) -> list[Any]:
        out = actors_of(engines)
        chosen = list(range(len(group.actors))) if engines is None else list(engines)
        if engine in chosen and due():
            at = chosen.index(engine)
            out[at] = _SignalAfterLoad(
                out[at], lambda: signalled.append(kill(group._pids[engine], signum))
            )
        return out

    transport._actors = actors
    return signalled


# ----- training ranks and the driver, from a rank --------------------------------------


@dataclass(frozen=True)
class RankChaos:
    """What ``CHAOS_VAR`` asks of a run's training ranks: at ``moment`` (``TRAIN_STEP``
    or ``CHECKPOINT``) of rollout ``rollout``, a kill; ``folder``, the run's output
    folder (its metrics, the marker, the driver's pid)."""

    moment: str
    rollout: int
    folder: str

    def env(self) -> dict[str, str]:
        """The environment that asks for this (give it to ``vime-train``)."""
        return {CHAOS_VAR: f"{self.moment}:{self.rollout}:{self.folder}"}

    @classmethod
    def from_env(cls) -> RankChaos | None:
        spec = os.environ.get(CHAOS_VAR)
        if not spec:
            return None
        moment, rollout, folder = spec.split(":", 2)
        return cls(moment, int(rollout), folder)

    def training(self) -> bool:
        """Whether this rank trains ``rollout`` now (the line before it is logged)."""
        logged = read_metrics(os.path.join(self.folder, METRICS_FILE))
        return (logged[-1]["rollout_id"] if logged else -1) == self.rollout - 1

    @property
    def marker(self) -> Path:
        """The file made as the kill fires."""
        return Path(self.folder, f"chaos_{self.moment}_fired")

    def fire_once(self) -> bool:
        """True for the first caller only, in any process (O_EXCL on ``marker``)."""
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


def _kill_mid_step(chaos: RankChaos) -> None:
    """Kill this rank, training ``chaos.rollout``, keeping the metrics logged until then."""
    if chaos.training() and chaos.fire_once():
        folder = chaos.folder
        shutil.copyfile(os.path.join(folder, METRICS_FILE), os.path.join(folder, BEFORE_KILL))
        kill(os.getpid())


def _arm_kill_mid_checkpoint(chaos: RankChaos) -> None:
    """Make this rank's commit of ``chaos.rollout``'s checkpoint kill the driver and the
    rank instead (the rank's shards written; the metadata, rename and tracker not)."""
    from vime import checkpoint

    commit = checkpoint.commit_save
    if getattr(commit, "armed", False):
        return

    def commit_save(save_dir: Any, rollout_id: int, **kwargs: Any) -> Path:
        if rollout_id == chaos.rollout and chaos.fire_once():
            kill(int(Path(chaos.folder, DRIVER_PID).read_text()))
            kill(os.getpid())
        return commit(save_dir, rollout_id, **kwargs)

    commit_save.armed = True  # type: ignore[attr-defined]
    checkpoint.commit_save = commit_save


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's policy loss; first the kill ``CHAOS_VAR`` asks for, if any."""
    chaos = RankChaos.from_env()
    if chaos is not None and chaos.moment == TRAIN_STEP:
        _kill_mid_step(chaos)
    elif chaos is not None and chaos.moment == CHECKPOINT:
        _arm_kill_mid_checkpoint(chaos)  # a save follows the training
    return vime_policy_loss(logp, old_logp, advantages, mask, **kwargs)


def vime_train(
    *args: str, cwd: Path, env: dict[str, str], pid_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """A ``vime-train`` process run to its end; its pid written to ``pid_file`` first
    (for ``CHECKPOINT``'s kill of the driver) when given."""
    script = Path(sys.executable).with_name("vime-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vime.cli"]
    with subprocess.Popen(
        [*command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    ) as process:
        if pid_file is not None:
            pid_file.write_text(str(process.pid))
        try:
            out, err = process.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


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
