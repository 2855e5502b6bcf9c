"""The GRPO loop: rollout -> reward -> advantage -> train -> weight sync -> save -> log.

Where it fits: ``vime.cli`` parses and validates the flags and calls ``run``, which
builds the run's parts (``vime.setup``: data, Ray and placement, the training ranks,
the engines, the rollout source, the weight transport, timing and tracker) and hands
them to ``Run``, the loop, which builds nothing: ``Run.step`` is one rollout,
``Run.train`` all of them. With ``--max-staleness`` >= 1 a rollout's batch comes from
``RolloutProducer``, which keeps the engines generating in a thread of its own; the
steps are the same.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from typing import Any

import ray

from vime import perf
from vime.auto_resume import RESUMES_KEY
from vime.config.parser import Config
from vime.data.batch import RolloutBatch, TrainSchedule, schedule
from vime.ray.cluster import stop_ray
from vime.ray.errors import ActorFailure, Terminated, wait_all
from vime.rollout.manager import DataExhausted
from vime.setup.parts import RunParts
from vime.setup.run import build_run
from vime.setup.settings import UpdateSettings
from vime.tracking import default_output_dir, quiet_library_progress_bars


def run(
    args: Config, *, startup: perf.StartupClock | None = None, auto_resumes: int = 0
) -> dict[str, Any]:
    """Train as ``args`` (from ``parse_args(argv, for_run=True)``) says; returns the final
    summary (also in ``summary.json``).

    The start-up (``perf/startup_s`` on the first metrics line, ``startup_s`` in the
    summary) is timed on ``startup`` (``vime-train``'s, from the process's start, with
    Ray already started), or from this call.

    A run that fails while it is being set up (bad data, an unreachable cluster)
    releases what it built and removes the output folder it created, so a failed start
    leaves nothing behind. A rank or engine that fails later leaves its whole report in
    ``error.log`` there. A run that stops early (interrupted, failed) still draws
    ``progress.png`` from the rollouts logged and writes ``summary.json`` with its
    ``status``.

    ``auto_resumes`` (> 0: this run is ``--auto-resume``'s restart after as many failures)
    goes on its first metrics line as ``fault/auto_resumes`` and into the summary.
    """
    quiet_library_progress_bars()
    args = args.replace(output_dir=args.output_dir or default_output_dir())
    created = not os.path.exists(args.output_dir)
    try:
        session = Run(build_run(args, startup), auto_resumes=auto_resumes)
    except BaseException:
        if created:
            shutil.rmtree(args.output_dir, ignore_errors=True)
        raise
    status = "failed"
    try:
        summary = session.train()
        status = "done"
        return summary
    except KeyboardInterrupt as stop:
        status = "terminated" if isinstance(stop, Terminated) else "interrupted"
        raise
    except ActorFailure as failure:
        raise failure.logged_to(os.path.join(args.output_dir, "error.log")) from failure
    finally:
        session.close(status)
        if ray.is_initialized():  # started here, or by vime-train for the run
            stop_ray()


class Run:
    """One training run's loop over the parts ``vime.setup.run.build_run`` built."""

    def __init__(self, parts: RunParts, *, auto_resumes: int = 0) -> None:
        self.parts = parts
        self.settings, self.startup = parts.loop, parts.startup
        self.output_dir = parts.loop.output_dir
        self.train_group, self.turns = parts.actors.train_group, parts.actors.turns
        self.engines = parts.actors.engines
        self.manager, self.producer = parts.manager, parts.producer
        self.transport, self.timing, self.tracker = parts.transport, parts.timing, parts.tracker
        self.eval_prompts, self.eval_ids = parts.prompts.eval_prompts, parts.prompts.eval_ids
        self.dropped = parts.prompts.dropped
        self.start_rollout = parts.actors.start_rollout
        self.probe = _probe_sequence(parts.prompts.ids)
        self._probe_plan: Any = None
        self.last_saved = self.start_rollout - 1  # the checkpoint this run resumed from
        self.auto_resumes = auto_resumes

    # ----- the loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        loop = self.settings
        self.engines.faults.at_rollout(self.start_rollout)  # restarts in the first sync count here
        if self.start_rollout > 0:  # the engines start from the HF checkpoint, not the resume
            self.startup.mark("other")
            self.turns.weight_sync()
            self.sync_weights(self.start_rollout)
            self.startup.mark("sync")
        self._started()
        self.warm_up()
        if self.producer is not None:
            self.producer.start()
        for rollout_id in range(self.start_rollout, loop.num_rollout):
            try:
                metrics = self.step(rollout_id)
            except DataExhausted as end:
                self.log(f"vime: {end}; stopping after {rollout_id} rollouts")
                # The last trained rollout is saved, as it would have been at the planned end.
                last_trained = rollout_id - 1
                if loop.save and self.last_saved < last_trained:
                    self.save(last_trained)
                break
            self.tracker.log(rollout_id, {**metrics, **self.dropped})
            # After the log: a checkpoint never holds a rollout whose metrics line a stop
            # right after it could lose (a resume keeps the lines before its start).
            if save_due(rollout_id, loop.num_rollout, loop.save, loop.save_interval):
                with self.timing.phase("save"):
                    self.save(rollout_id)
            self.timing.end()
        if self.producer is not None:
            self.producer.close()  # what is still generating is not trained
        summary = self._finish()
        summary["plot"] = self.tracker.finish(summary)
        return summary

    def step(self, rollout_id: int) -> dict[str, float]:
        loop, timing = self.settings, self.timing
        timing.begin(rollout_id)
        self.engines.faults.at_rollout(rollout_id)  # where engine restarts count
        with timing.phase("rollout"):
            self.turns.rollout()
            if self.producer is not None:
                batch, metrics = self.producer.take(rollout_id)
            else:
                batch, metrics = self.manager.generate(rollout_id)
        with timing.phase("train"):
            self.turns.train()
            planned = plan_updates(loop.updates, batch, rollout_id)
            metrics.update(self.train_group.train(ray.put(planned)))
        with timing.phase("sync"):
            self.turns.weight_sync()
            metrics.update(self.sync_weights(rollout_id + 1))
            if self.producer is not None:
                self.producer.weights_synced(rollout_id + 1)
        with timing.phase("probe"):
            metrics.update(self._probe_diff())
        metrics.update(self.engines.faults.metrics())  # the run's restarts so far
        eval_due = loop.eval_interval and (rollout_id + 1) % loop.eval_interval == 0
        if self.eval_prompts is not None and eval_due:
            with timing.phase("eval"):
                metrics.update(self.manager.evaluate(self.eval_prompts, self.eval_ids))
        # Time per phase, idle fractions, tokens/s, MFU (vime.step_timing).
        metrics.update(timing.step_metrics([len(t) for t in batch.tokens]))
        return metrics

    def warm_up(self) -> None:
        """``--sft-warmup-steps``: train the demonstrations' batches (``vime.setup.warm_start``),
        one optimizer step each, then give the engines the weights (still version 0: no
        rollout has been trained); the first metrics line gets ``warmup/*``."""
        batches = self.parts.warm_start
        if not batches:
            return
        began = time.monotonic()
        self.turns.train()
        for step, batch in enumerate(batches):
            updates = replace(self.settings.updates, global_batch_size=len(batch))
            planned = plan_updates(updates, batch, -1 - step)
            metrics = self.train_group.train(ray.put(planned))
        self.turns.weight_sync()
        self.sync_weights(0)
        seconds = time.monotonic() - began
        self.tracker.log_once(
            {
                "warmup/steps": float(len(batches)),
                "warmup/seconds": seconds,
                "warmup/grad_norm": metrics.get("train/grad_norm", float("nan")),
            }
        )
        self.log(f"vime: warm start: {len(batches)} supervised steps in {seconds:.1f} s")

    def save(self, rollout_id: int) -> None:
        """Checkpoint the trainer after ``rollout_id``, with the data position beside it
        (in the train turn: optimizer state awake, colocated engines asleep)."""
        self.turns.train()
        source = self.producer if self.producer is not None else self.manager
        self.train_group.save(rollout_id, {"data": source.state_dict()})
        self.last_saved = rollout_id

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine and check they serve ``version``.

        Engines lost since the last look (the asynchronous producer's, while training
        trained) are restarted first and take these weights with the others; one that
        dies in the sync is found, restarted and synced again (``--max-engine-restarts``).
        """
        self.engines.recover(restore=False)
        try:
            versions = self.transport.sync(version)
        except ActorFailure:
            # The cause, if an engine died: raised with restarts off, else restarted.
            if not self.engines.note_dead("syncing weights"):
                raise
            self.engines.recover(restore=False)
            versions = self.transport.sync(version)
        self.engines.weights_loaded()
        if any(v != version for v in versions):
            raise RuntimeError(f"engines serve weight versions {versions}, expected {version}")
        return {"weights/version": float(version)}

    def log(self, text: str) -> None:
        self.tracker.message(text)

    def close(self, status: str = "done") -> None:
        """Release what the run's builders made (``run`` stops Ray after); a tracker still
        open (the run stopped early) writes its summary with ``status`` and its plot
        first."""
        self.parts.closer.close(status)

    # ----- pieces --------------------------------------------------------------------------

    def _started(self) -> None:
        """The first rollout starts: say how long the start-up took, and put it on the
        first metrics line and in the summary."""
        self.startup.mark("other")
        startup = self.startup.done()
        self.log(f"vime: {startup.line()}")
        self.tracker.log_once(startup.metrics())
        self.tracker.summarize(startup.summary())
        if self.auto_resumes:  # the line where the restarted run picks up
            self.tracker.log_once({RESUMES_KEY: float(self.auto_resumes)})
            self.tracker.summarize({"auto_resumes": self.auto_resumes})

    def _finish(self) -> dict[str, Any]:
        """After the last rollout: the final eval and the HF exports; the summary."""
        loop = self.settings
        summary: dict[str, Any] = {"output_dir": self.output_dir}
        summary["peak_flops_source"] = self.timing.peak_source
        if self.timing.traced:
            summary["trace"] = self.timing.trace_path
            ids = ",".join(str(i) for i in self.timing.traced)
            self.log(f"vime: trace of rollout(s) {ids} in {summary['trace']} (ui.perfetto.dev)")
        summary.update({key.split("/")[-1]: int(n) for key, n in self.dropped.items()})
        summary.update({k.split("/")[-1]: int(n) for k, n in self.engines.faults.metrics().items()})
        if self.eval_prompts is not None:
            self.turns.rollout()
            summary["final_eval"] = self.manager.evaluate(self.eval_prompts, self.eval_ids)
            self.log(f"vime: final eval {_fmt(summary['final_eval'])}")
        if loop.save_hf:
            self.turns.train()
            self.train_group.export_hf(loop.save_hf)
            summary["save_hf"] = loop.save_hf
        if loop.save_hf_merged:
            self.turns.train()
            self.train_group.export_hf(loop.save_hf_merged, merged=True)
            summary["save_hf_merged"] = loop.save_hf_merged
        summary["status"] = "done"
        return summary

    def _probe_diff(self) -> dict[str, float]:
        """How far the engines' log-probs of the probe are from the trainer's.

        The trainer scores it while its weights are awake (the sync's turn), the engines
        in the rollout turn (that also serves eval and the next generation): colocated,
        one after the other; on devices of their own, both at once.
        """
        tokens, prompt_len = self.probe
        if self._probe_plan is None:  # the same every rollout: put in the object store once
            dp, n_resp = self.settings.updates.dp_size, len(tokens) - prompt_len
            batch = RolloutBatch([tokens] * dp, [prompt_len] * dp, [[1] * n_resp] * dp, [0.0] * dp)
            plan = schedule(batch, global_batch_size=dp, dp_size=dp, micro_batch_size=1)
            self._probe_plan = ray.put(plan)
        pending = self.train_group.submit("compute_log_probs", self._probe_plan, "actor")
        what = "computing the probe's log-probs"
        per_rank = wait_all(pending, what) if self.settings.colocate else None
        self.turns.rollout()
        # Every engine scores it: one that missed an update must not hide behind another.
        temperature = self.settings.rollout_temperature
        per_engine = self.engines.score(tokens, prompt_len, temperature)
        if per_rank is None:
            per_rank = wait_all(pending, what)
        trainer = next(rank[0] for rank in per_rank if 0 in rank).tolist()
        diff = max(
            abs(a - b) for engine in per_engine for a, b in zip(trainer, engine, strict=True)
        )
        return {"weights/probe_logprob_abs_diff": diff}


def plan_updates(settings: UpdateSettings, batch: RolloutBatch, rollout_id: int) -> TrainSchedule:
    """The optimizer steps rollout ``rollout_id``'s ``batch`` is trained as: the planner's
    schedule under the run's batch flags, its samples shuffled first with
    ``--shuffle-updates`` (by ``update_order_seed``)."""
    seed = settings.shuffle_seed
    return schedule(
        batch,
        global_batch_size=settings.global_batch_size,
        dp_size=settings.dp_size,
        max_tokens_per_gpu=settings.max_tokens_per_gpu,
        micro_batch_size=settings.micro_batch_size,
        shuffle_seed=update_order_seed(seed, rollout_id) if seed is not None else None,
        rollout_id=rollout_id,
    )


def save_due(rollout_id: int, num_rollout: int, save: str | None, interval: int | None) -> bool:
    """Whether rollout ``rollout_id`` ends with a checkpoint: every ``interval`` rollouts,
    and always after the last one (``--save`` without ``--save-interval`` saves only then)."""
    if not save:
        return False
    return rollout_id + 1 == num_rollout or (bool(interval) and (rollout_id + 1) % interval == 0)


def update_order_seed(seed: int, rollout_id: int) -> int:
    """The ``--shuffle-updates`` seed of rollout ``rollout_id``: a function of the run seed
    and the rollout alone, so a resumed run splits its updates as the uninterrupted one."""
    return seed * 1_000_003 + rollout_id


def _probe_sequence(prompt_ids: dict[int, list[int]]) -> tuple[list[int], int]:
    """A fixed sequence (first prompt + a few of its own tokens) both sides score."""
    prompt = next(iter(prompt_ids.values()))
    return prompt + prompt[: max(1, min(8, len(prompt)))], len(prompt)


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in metrics.items())
