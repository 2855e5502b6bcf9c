"""``--auto-resume N``: restart a failed run from its latest checkpoint, in this process.

Where it fits: ``vime.cli`` starts Ray and hands the trainer's ``run`` to
``run_resuming``. When the run fails (a training rank or engine: ``ActorFailure``;
the driver: any other ``Exception``), the run has already released its actors and
stopped Ray (``vime.trainer.run``); this module starts Ray again and builds the run
again with ``--load`` set to the ``--save`` folder, up to N times. The restart writes
into the same output folder: its tracker keeps the metrics lines of the rollouts
before the checkpoint it resumes from and drops the later ones (logged before the
crash, redone now), so metrics.jsonl reads as one run. A configuration error, Ctrl-C
and SIGTERM are never retried; once the budget is spent the last error stops the run.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from vime.checkpoint import CheckpointError, latest
from vime.config import Config
from vime.errors import ConfigError
from vime.perf import StartupClock

# On the first metrics line of each restarted run: how many restarts this run has had.
RESUMES_KEY = "fault/auto_resumes"
ERROR_LOG = "error.log"


def is_retried(err: BaseException) -> bool:
    """Whether a restart may follow ``err``: a failure, not a configuration error and
    not a stop (Ctrl-C and SIGTERM are ``KeyboardInterrupt``s, not ``Exception``s)."""
    return isinstance(err, Exception) and not isinstance(err, ConfigError)


def checkpoint_in(save: str) -> int | None:
    """The rollout the latest checkpoint in ``save`` was taken after; None if none is
    readable (a restart then starts over, as ``--load`` of an empty folder does)."""
    try:
        return latest(save)
    except (CheckpointError, OSError):
        return None


def resumed_config(config: Config) -> Config:
    """The flags of a restart: ``--load`` the ``--save`` folder once it holds a
    checkpoint; before that, the run's own ``--load`` (or none)."""
    assert config.save is not None  # parsing refuses --auto-resume without --save
    return config.replace(load=config.save) if checkpoint_in(config.save) is not None else config


def _describe(err: BaseException) -> str:
    from vime.ray.errors import ActorFailure

    if isinstance(err, ActorFailure):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _keep_traceback(err: BaseException, output_dir: str) -> None:
    """A driver-side error's traceback, to ``error.log`` in the output folder (a rank's
    report is already there: ``vime.trainer.run`` wrote it)."""
    from vime.ray.errors import ActorFailure

    if isinstance(err, ActorFailure) or not os.path.isdir(output_dir):
        return
    with open(os.path.join(output_dir, ERROR_LOG), "w") as f:
        f.write("".join(traceback.format_exception(err)))


def run_resuming(
    run: Callable[..., dict[str, Any]],
    config: Config,
    startup: StartupClock,
    restart_ray: Callable[[Config], None],
) -> dict[str, Any]:
    """``run(config, startup=startup)``, and after a retried failure, ``restart_ray``
    then ``run`` again from the latest checkpoint, at most ``config.auto_resume`` times.
    Each restart is one line on stderr; the last failure is raised as it came."""
    budget, resumes = config.auto_resume, 0
    while True:
        try:
            return run(config, startup=startup, auto_resumes=resumes)
        except Exception as err:
            if not is_retried(err) or budget == 0:
                raise
            _keep_traceback(err, config.output_dir)
            if resumes == budget:
                print(
                    f"vime-train: --auto-resume {budget} spent; stopping on the last error",
                    file=sys.stderr,
                )
                raise
            resumes += 1
            config = resumed_config(config)
            last = checkpoint_in(config.load) if config.load else None
            where = f"after rollout {last}" if last is not None else "from the start"
            print(
                f"vime-train: run failed ({_describe(err)}); auto-resume {resumes} of "
                f"{budget}: restarting {where}, appending to {config.output_dir}",
                file=sys.stderr,
                flush=True,
            )
        startup = StartupClock(time.time())  # the restart's start-up, Ray's start first
        restart_ray(config)
        startup.mark("ray")
