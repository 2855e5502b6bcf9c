"""``vime-train``: parse -> build -> run, nothing else.

Bad configuration ends here as one ``vime-train: error: ...`` line on stderr and
exit status 2, never a traceback; a training rank or engine that fails ends the
run with its error on one line and exit status 1 (Ray's whole report, remote
traceback included, goes to ``error.log`` in the output folder, or above that
line when the run failed before its folder was kept).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from vime.config import Config, ConfigError, parse_args

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vime-train`` console script; returns the exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the run began (parsing, imports)
        print("vime-train: interrupted while starting; nothing was kept", file=sys.stderr)
        return 130


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
    if config.dry_run:
        return 0
    from vime.perf import process_start_time
    from vime.ray.placement import ActorFailure, Terminated
    from vime.tracking import default_output_dir
    from vime.trainer import run

    config = config.replace(output_dir=config.output_dir or default_output_dir())
    # The start-up figure counts from the process's start (the console script's).
    launched_at = (process_start_time() if argv is None else None) or _IMPORTED_AT
    try:
        summary = run(config, launched_at=launched_at)
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
