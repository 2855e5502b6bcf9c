"""``vime-train``: parse -> build -> run, nothing else.

Bad configuration ends here as one ``vime-train: error: ...`` line on stderr and
exit status 2, never a traceback; a training rank or engine that fails ends the
run with its error on one line and exit status 1 (Ray's whole report, remote
traceback included, goes to ``error.log`` in the output folder, or above that
line when the run failed before its folder was kept). With ``--auto-resume N`` such a
failure first restarts the run from its latest checkpoint, up to N times
(``vime.auto_resume``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vime.config import Config, ConfigError, parse_args
from vime.config.validate import joins_cluster
from vime.interrupts import raise_in_main

LOCAL_RAY_LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# The start-up figure's origin where /proc does not say when the process started
# (vime.perf.process_start_time), or main() is called with its own argv.
_IMPORTED_AT = time.time()


def _describe(config: Config) -> str:
    samples = config.rollout_batch_size * config.n_samples_per_prompt
    per_rank = config.global_batch_size // config.data_parallel_size
    batching = (
        f"rows of <= {config.max_tokens_per_gpu} tokens"
        if config.use_dynamic_batch_size
        else f"rows of {config.micro_batch_size} sample(s)"
    )
    return (
        f"backend {config.train_backend}, data-parallel size {config.data_parallel_size}; "
        f"each rollout: {config.rollout_batch_size} prompts x {config.n_samples_per_prompt} "
        f"samples = {samples}, trained in {config.num_steps_per_rollout} optimizer step(s) of "
        f"{config.global_batch_size} ({per_rank} per rank, packed in {batching})"
    )


def _notes(config: Config) -> list[str]:
    """Start-up lines for settings a user should not miss."""
    notes = []
    if config.max_staleness > 0 and not config.use_tis:
        notes.append(
            f"vime-train: note: --max-staleness {config.max_staleness} with --no-use-tis: "
            "samples from older weights train uncorrected, without decoupled PPO's "
            "behaviour weight (pi_prox / pi_behav)"
        )
    return notes


# Ctrl-C while starting, remembered: one whose exception a library swallows would be
# lost, and the run would go on as if it had not been pressed.
_INTERRUPTED = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    _INTERRUPTED.set()
    raise_in_main(KeyboardInterrupt(), signum, frame)  # not in logging's at-fork handler


def _raise_if_interrupted() -> None:
    """Raise the Ctrl-C pressed while starting, if its exception was swallowed."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def _stopped(how: str, config: Config) -> str:
    """The line for a run stopped ``how``: where its outputs are, and how it resumes."""
    from vime.checkpoint import CheckpointError, latest

    if not os.path.isdir(config.output_dir or ""):  # a run stopped while starting removes it
        return f"vime-train: {how} while starting; nothing was kept"
    kept = f"vime-train: {how}; metrics and plot of the rollouts done in {config.output_dir}"
    try:
        last = latest(config.save) if config.save else None
    except (CheckpointError, OSError):
        last = None
    if last is None:
        return f"{kept}; no checkpoint was saved, so a new run starts over"
    return f"{kept}; resume after rollout {last} with --load {config.save}"


def _start_ray_importing_the_trainer(config: Config, startup: Any) -> Callable[..., Any]:
    """Start (or join) Ray while another thread imports the trainer's modules, and return
    ``vime.trainer.run``, which finds Ray started.

    Both take seconds: the imports (torch, transformers) are this process's work, Ray's
    start mostly its own processes', this one waiting for them. The parts ``ray`` and
    ``imports`` of ``startup``, which ran together. The modules imported on the other
    thread (torch, transformers, vime's) are none of those ``ray.init`` imports.
    """
    from vime.tracking import HF_PROGRESS_BARS_VAR

    # Before Ray starts: its processes inherit the environment (see the run's
    # quiet_library_progress_bars, which finds it set).
    os.environ.setdefault(HF_PROGRESS_BARS_VAR, "1")
    took: list[float] = []

    def load() -> None:
        started = time.time()
        with contextlib.suppress(BaseException):  # the import below raises it again
            importlib.import_module("vime.trainer")
            # What run() then imports first (quiet_library_progress_bars): transformers.
            importlib.import_module("transformers.utils.logging")
        took.append(time.time() - started)

    loader = threading.Thread(target=load, name="vime-imports", daemon=True)
    loader.start()
    try:
        started = time.time()
        _start_ray(config)
        startup.add("ray", time.time() - started)
    finally:
        loader.join()  # no exit, even a failed one, while a module is half imported
    _raise_if_interrupted()
    startup.add("imports", took[0])
    startup.together("ray", "imports")
    from vime.trainer import run

    return run


def _start_ray(config: Config) -> None:
    """Start (or join) the Ray the run ``config`` configures, with room for its actors."""
    from vime.config.cluster_settings import placement_settings
    from vime.ray.cluster import start_ray
    from vime.ray.placement import layout_of

    start_ray(config.ray_address, layout_of(placement_settings(config), use_gpu=False).num_bundles)


def _restart_ray(config: Config) -> None:
    """Ray again for an ``--auto-resume`` restart: the failed run stopped its own, unless
    it failed while being built (which leaves Ray up)."""
    import ray

    from vime.ray.cluster import stop_ray

    if ray.is_initialized():
        stop_ray()
    _start_ray(config)
    _raise_if_interrupted()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vime-train`` console script; returns the exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the run began (parsing, imports)
        print("vime-train: interrupted while starting; nothing was kept", file=sys.stderr)
        return 130


def local_ray_on_loopback(config: Config) -> None:
    """A Ray the run starts for itself (no cluster to join) serves on loopback only.

    On Linux Ray replaces 127.0.0.1 by the machine's outward address and its servers
    listen on every interface unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is 0: then the
    node is 127.0.0.1, as nothing outside this machine joins it. Ray reads the variable
    when it is first imported, so this runs before the trainer is.
    """
    if not joins_cluster(config):
        os.environ.setdefault(LOCAL_RAY_LOOPBACK_VAR, "0")


def _main(argv: Sequence[str] | None) -> int:
    # Hooks given as module:function resolve against the working directory, as under python -m.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv, for_run=True)
    except ConfigError as err:
        print(f"vime-train: error: {err}", file=sys.stderr)
        return 2
    print(f"vime-train: configuration is valid: {_describe(config)}", flush=True)
    for note in _notes(config):
        print(note, flush=True)
    if config.dry_run:
        return 0
    local_ray_on_loopback(config)
    if threading.current_thread() is threading.main_thread():
        _INTERRUPTED.clear()
        signal.signal(signal.SIGINT, _on_sigint)
    from vime.auto_resume import run_resuming
    from vime.perf import StartupClock, process_start_time
    from vime.ray.errors import ActorFailure, Terminated
    from vime.tracking import default_output_dir

    config = config.replace(output_dir=config.output_dir or default_output_dir())
    # The start-up is timed from the process's start (the console script's).
    startup = StartupClock((process_start_time() if argv is None else None) or _IMPORTED_AT)
    try:
        run = _start_ray_importing_the_trainer(config, startup)
        summary = run_resuming(run, config, startup, _restart_ray)
    except ConfigError as err:
        print(f"vime-train: error: {err}", file=sys.stderr)
        return 2
    except ActorFailure as err:
        if err.log_path is None and err.detail:  # failed while starting: no folder kept
            print(err.detail, file=sys.stderr)
        print(f"vime-train: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        how = "terminated (SIGTERM)" if terminated else "interrupted"
        print(_stopped(how, config), file=sys.stderr)
        return 143 if terminated else 130
    print(f"vime-train: done; outputs in {summary['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
