"""The GRPO loop: rollout -> reward -> advantage -> train -> weight sync -> save -> log.

Where it fits: ``vime.cli`` parses and validates the flags and calls ``run``.
Everything here is sequencing; the parts live elsewhere: prompts and tasks in
``vime.data``, generation and rewards in ``vime.rollout``, placement in
``vime.ray``, the backends behind ``vime.backends.registry``, metrics in
``vime.tracking``. ``Run`` builds them once; ``Run.step`` is one rollout. With
``--max-staleness`` >= 1 a rollout's batch comes from ``RolloutProducer``, which
keeps the engines generating in a thread of its own; the steps are the same.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import ray

from vime import perf
from vime.config.parser import Config
from vime.config.settings import build_settings
from vime.config.validate import check_cluster_devices, joins_cluster
from vime.data.batch import RolloutBatch, TrainSchedule, schedule
from vime.data.prompts import (
    PromptSource,
    builtin_task_of,
    filter_prompt_lengths,
    load_prompts,
    prompts_per_rollout,
    render_prompt,
    run_length,
)
from vime.errors import ConfigError
from vime.profiling import PhaseClock, TimedCalls
from vime.ray.cluster import cluster_gpus, start_ray, stop_ray
from vime.ray.engines import EngineGroup
from vime.ray.errors import ActorFailure, Terminated, wait_all
from vime.ray.placement import layout_of, reserve, split_cores
from vime.ray.train_group import RayTrainGroup
from vime.ray.transports import make_transport
from vime.ray.turns import DeviceTurns
from vime.rollout import registry as engine_registry
from vime.rollout.manager import DataExhausted, RolloutManager
from vime.rollout.producer import ProducerSettings, RolloutProducer
from vime.rollout.rewards import build_reward_scorer, reward_needs_label
from vime.rollout.tool_loop import build_agent, check_tool_format
from vime.rollout.tools import load_tools
from vime.step_timing import StepTiming
from vime.tracking import Tracker, default_output_dir, quiet_library_progress_bars
from vime.weights.lora import engine_lora

EMBEDDED_MODEL_DIR = "embedded_model"
TRACE_FILE = "trace.json"
# The start-up line's words for each engine-side LoRA receiver (vime.weights.lora).
_LORA_RECEIVERS = {
    "AdapterLoader": "as adapters the engine serves itself (the base once)",
    "AdapterMerger": "as adapters merged on the engine (the base once)",
}


def run(args: Config, *, startup: perf.StartupClock | None = None) -> dict[str, Any]:
    """Train as ``args`` (from ``parse_args(argv, for_run=True)``) says; returns the final
    summary (also in ``summary.json``).

    The start-up (``perf/startup_s`` on the first metrics line, ``startup_s`` in the
    summary) is timed on ``startup`` (``vime-train``'s, from the process's start, with
    Ray already started), or from this call.

    A run that fails while it is being set up (bad data, an unreachable cluster)
    removes the output folder it created, so a failed start leaves nothing behind.
    A rank or engine that fails later leaves its whole report in ``error.log`` there.
    A run that stops early (interrupted, failed) still draws ``progress.png`` from the
    rollouts logged and writes ``summary.json`` with its ``status``.
    """
    quiet_library_progress_bars()
    args = args.replace(output_dir=args.output_dir or default_output_dir())
    created = not os.path.exists(args.output_dir)
    try:
        session = Run(args, startup)
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


class Run:
    """One training run: owns the Ray actors, the data position and the tracker."""

    def __init__(self, args: Config, startup: perf.StartupClock | None = None) -> None:
        # The start-up's parts, timed as they run (reported when the first rollout starts).
        self.startup = startup = startup or perf.StartupClock()
        output_dir = args.output_dir or default_output_dir()
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        # Each component's settings (what the resolving below changes, none of them reads).
        self.settings = settings = build_settings(args.replace(output_dir=output_dir))
        self.embedded = args.hf_checkpoint is None
        checkpoint_dir = args.hf_checkpoint or _embedded_checkpoint(output_dir, args.seed)
        self.log(f"vime: model {checkpoint_dir}")
        self.tokenizer = _tokenizer(checkpoint_dir, embedded=self.embedded)
        task_name = builtin_task_of(args.prompt_data or "")
        self.task = _task(task_name)
        # Multi-turn rollouts: the tools, shown to the model in its prompts, and read from
        # its turns by --tool-parser, whose fit to the tokenizer is known only now.
        if args.tools:
            check_tool_format(settings.agent, self.tokenizer)
        self.toolbox = load_tools(args.tools) if args.tools else None
        train_prompts, self.prompt_ids, dropped = self._prompts(args, args.prompt_data)
        source = PromptSource(train_prompts, num_epoch=args.num_epoch, seed=args.seed)
        # Over-sampling draws more prompts a rollout: the run is as long as the data feeds.
        per_rollout = prompts_per_rollout(args.rollout_batch_size, args.over_sampling_factor)
        num_rollout = run_length(source, per_rollout, args.num_rollout)
        # Resolved once here so every process sees the same values (the LR schedule needs
        # the run length; the actors need the checkpoint the embedded default wrote).
        self.args = args = args.replace(
            hf_checkpoint=checkpoint_dir,
            num_rollout=num_rollout,
            output_dir=output_dir,
            save_hf=args.save_hf or (os.path.join(output_dir, "model") if self.embedded else None),
        )
        self.eval_prompts = None
        # Prompts over --rollout-max-prompt-len, as recorded in metrics.jsonl and summary.json.
        self.dropped = {"data/prompts_dropped": float(dropped)}
        if args.eval_prompt_data:
            self.eval_prompts, self.eval_ids, eval_dropped = self._prompts(
                args, args.eval_prompt_data
            )
            self.dropped["data/eval_prompts_dropped"] = float(eval_dropped)
        self.scorer = build_reward_scorer(
            settings.rewards,
            self.task.reward if self.task else None,
            task_reads_trajectory=bool(self.task and self.task.reads_trajectory),
            hook_args=args,
        )
        startup.mark("model")  # the checkpoint, the tokenizer, the prompts, the reward

        # Ray's start (unless vime-train started it already) and the run's placement.
        start_ray(args.ray_address, layout_of(args, use_gpu=False).num_bundles)
        # The cluster's devices, not this driver's: a driver on a CPU-only head node still
        # places the ranks and engines on the workers' GPUs.
        use_gpu = cluster_gpus() > 0
        lacking = "none is visible here"
        if joins_cluster(args):
            address = args.ray_address or os.environ.get("RAY_ADDRESS")
            lacking = f"the Ray cluster at {address} has none"
        check_cluster_devices(args, use_gpu, lacking)
        layout = layout_of(args, use_gpu)
        self.placement = reserve(layout)
        startup.mark("ray")
        threads = max(1, (os.cpu_count() or 1) // max(1, args.actor_num_gpus_per_node))
        train_cores, engine_cores = None, None
        if cpu_split(args, use_gpu):
            # Both sides work at once: on the CPU each gets cores of its own, as on GPUs.
            train_cores, engine_cores = split_cores(
                sorted(os.sched_getaffinity(0)), layout.num_train, layout.num_engines
            )
        self.train_group = RayTrainGroup(args.train_backend, self.placement)
        # The ranks initialise while the engines start; colocated, training goes to sleep
        # first (DeviceTurns), so the engines wait for it.
        started = time.time()
        self.train_group.start_init(args, threads, train_cores)
        if args.colocate:
            self.start_rollout = self.train_group.finish_init()
            startup.mark("trainer")
        lora = engine_lora(
            settings.lora,
            args.update_weight_buffer_size,
            args.weight_sync,
            args.vllm_lora,
        )
        engine_options = engine_registry.EngineOptions(
            # The embedded model's matmuls are too small to split over threads: on one it
            # generates faster (bench/README.md: 0.078 against 0.105 s a rollout, 2 cores).
            num_threads=1 if self.embedded else (os.cpu_count() or 1),
            tensor_parallel_size=args.rollout_num_gpus_per_engine,
            seed=args.seed,
            # The longest sequence a rollout makes: what the KV cache must hold.
            max_model_len=args.rollout_max_prompt_len + args.rollout_max_response_len,
            gpu_memory_utilization=args.rollout_gpu_memory_utilization,
            tiny_model=self.embedded,  # auto gives it the faster engine (resolve_engine)
            lora=lora,
        )
        self.turns = DeviceTurns(
            self.train_group,
            lambda: EngineGroup(
                args.rollout_engine, checkpoint_dir, self.placement, engine_options, engine_cores
            ),
            colocate=args.colocate,
        )
        self.engines = self.turns.engines
        if args.colocate:
            startup.mark("engines")
        else:
            startup.add("engines", time.time() - started)
            self.start_rollout = self.train_group.finish_init()
            done_at = min(self.train_group.init_done_at or started, time.time())
            startup.add("trainer", done_at - started)  # the ranks' clock: clamped to ours
            startup.together("trainer", "engines")
        engines = f"{self.engines.kind} ({self.engines.reason}), {layout.num_engines} engine(s)"
        self.log(f"vime: rollout engine {engines}")
        if lora is not None:
            how = _LORA_RECEIVERS[self.engines.lora_receiver]
            if lora.settings.merge_on_sync or args.weight_sync == "disk":
                how = "as merged weights, the whole model at every sync"
            self.log(f"vime: LoRA syncs reach the engines {how}")
        if engine_cores is not None:  # as the processes see it, not as planned
            cores = f"training {self.train_group.cpu_cores()}, engines {self.engines.cpu_cores()}"
            self.log(f"vime: CPU cores split (--cpu-split): {cores}")
        # The driver's phases, the reward's among them (timed where the manager calls it).
        clock = PhaseClock()
        self.manager = RolloutManager(
            settings.rollout,
            self.engines,
            self.tokenizer,
            TimedCalls(self.scorer, clock, "reward", ["score_sync"]),
            source,
            self.prompt_ids,
            is_correct=self.task.is_correct if self.task else None,
            warn=self.log,
            agent=build_agent(settings.agent, self.tokenizer, self.engines, self.toolbox),
        )
        pending: list[int] = []
        if self.start_rollout > 0:
            position = self._loaded_data_position(args.load)
            self.manager.load_state_dict(position)
            pending = position.get("pending", [])
            if pending and not args.max_staleness:
                raise ConfigError(
                    f"--load {args.load}: the checkpoint holds {len(pending)} prompts an "
                    "asynchronous run had drawn and not trained; resume it with "
                    "--max-staleness >= 1, so they are generated first"
                )
        # Asynchronous rollout (--max-staleness >= 1): generation runs in the producer's
        # thread and rollouts take their batches from it.
        self.producer = None
        if args.max_staleness:
            self.producer = RolloutProducer(
                ProducerSettings.for_engines(
                    settings.rollout, args.max_staleness, layout.num_engines
                ),
                self.manager,
                self.engines,
                weight_version=self.start_rollout,
                pending=pending,
            )
        self.transport = make_transport(settings.sync, use_gpu, self.train_group, self.engines)
        self.transport.setup()
        startup.mark("other")
        self.timing = StepTiming(
            self.train_group,
            self.engines,
            clock,
            shape=perf.model_shape(checkpoint_dir),
            peaks=self.train_group.peaks(),
            profile_rollouts=args.profile_rollouts,
            trace_path=os.path.join(output_dir, TRACE_FILE),
        )
        startup.mark("peak")
        peak = f"{self.timing.peak_flops / 1e9:.3g} GFLOP/s"
        self.log(f"vime: training peak {peak} over all ranks ({self.timing.peak_source})")
        self.tracker = Tracker(
            output_dir,
            num_rollouts=num_rollout,
            start_rollout=self.start_rollout,
            use_tensorboard=args.use_tensorboard,
            use_wandb=args.use_wandb,
            wandb_project=args.wandb_project,
            config=vars(args),
        )
        self.probe = self._probe_sequence()
        self._probe_plan: Any = None
        self.last_saved = self.start_rollout - 1  # the checkpoint this run resumed from

    # ----- the loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        args = self.args
        if self.start_rollout > 0:  # the engines start from the HF checkpoint, not the resume
            self.startup.mark("other")
            self.turns.weight_sync()
            self.sync_weights(self.start_rollout)
            self.startup.mark("sync")
        self._started()
        if self.producer is not None:
            self.producer.start()
        for rollout_id in range(self.start_rollout, args.num_rollout):
            try:
                metrics = self.step(rollout_id)
            except DataExhausted as end:
                self.log(f"vime: {end}; stopping after {rollout_id} rollouts")
                # The last trained rollout is saved, as it would have been at the planned end.
                last_trained = rollout_id - 1
                if args.save and self.last_saved < last_trained:
                    self.save(last_trained)
                break
            self.tracker.log(rollout_id, {**metrics, **self.dropped})
            # After the log: a checkpoint never holds a rollout whose metrics line a stop
            # right after it could lose (a resume keeps the lines before its start).
            if save_due(rollout_id, args.num_rollout, args.save, args.save_interval):
                with self.timing.phase("save"):
                    self.save(rollout_id)
            self.timing.end()
        if self.producer is not None:
            self.producer.close()  # what is still generating is not trained
        summary: dict[str, Any] = {"output_dir": self.output_dir}
        summary["peak_flops_source"] = self.timing.peak_source
        if self.timing.traced:
            summary["trace"] = self.timing.trace_path
            ids = ",".join(str(i) for i in self.timing.traced)
            self.log(f"vime: trace of rollout(s) {ids} in {summary['trace']} (ui.perfetto.dev)")
        summary.update({key.split("/")[-1]: int(n) for key, n in self.dropped.items()})
        if self.eval_prompts is not None:
            self.turns.rollout()
            summary["final_eval"] = self.manager.evaluate(self.eval_prompts, self.eval_ids)
            self.log(f"vime: final eval {_fmt(summary['final_eval'])}")
        if args.save_hf:
            self.turns.train()
            self.train_group.export_hf(args.save_hf)
            summary["save_hf"] = args.save_hf
        if args.save_hf_merged:
            self.turns.train()
            self.train_group.export_hf(args.save_hf_merged, merged=True)
            summary["save_hf_merged"] = args.save_hf_merged
        summary["status"] = "done"
        summary["plot"] = self.tracker.finish(summary)
        return summary

    def step(self, rollout_id: int) -> dict[str, float]:
        args, timing = self.args, self.timing
        timing.begin(rollout_id)
        with timing.phase("rollout"):
            self.turns.rollout()
            if self.producer is not None:
                batch, metrics = self.producer.take(rollout_id)
            else:
                batch, metrics = self.manager.generate(rollout_id)
        with timing.phase("train"):
            self.turns.train()
            planned = plan_updates(args, batch, rollout_id)
            metrics.update(self.train_group.train(ray.put(planned)))
        with timing.phase("sync"):
            self.turns.weight_sync()
            metrics.update(self.sync_weights(rollout_id + 1))
            if self.producer is not None:
                self.producer.weights_synced(rollout_id + 1)
        with timing.phase("probe"):
            metrics.update(self._probe_diff())
        eval_due = args.eval_interval and (rollout_id + 1) % args.eval_interval == 0
        if self.eval_prompts is not None and eval_due:
            with timing.phase("eval"):
                metrics.update(self.manager.evaluate(self.eval_prompts, self.eval_ids))
        # Time per phase, idle fractions, tokens/s, MFU (vime.step_timing).
        metrics.update(timing.step_metrics([len(t) for t in batch.tokens]))
        return metrics

    def save(self, rollout_id: int) -> None:
        """Checkpoint the trainer after ``rollout_id``, with the data position beside it
        (in the train turn: optimizer state awake, colocated engines asleep)."""
        self.turns.train()
        source = self.producer if self.producer is not None else self.manager
        self.train_group.save(rollout_id, {"data": source.state_dict()})
        self.last_saved = rollout_id

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine and check they serve ``version``."""
        try:
            versions = self.transport.sync(version)
        except ActorFailure:
            self.engines.raise_if_one_died("syncing weights")  # the cause, if an engine died
            raise
        if any(v != version for v in versions):
            raise RuntimeError(f"engines serve weight versions {versions}, expected {version}")
        return {"weights/version": float(version)}

    # ----- pieces --------------------------------------------------------------------------

    def _started(self) -> None:
        """The first rollout starts: say how long the start-up took, and put it on the
        first metrics line and in the summary."""
        self.startup.mark("other")
        startup = self.startup.done()
        self.log(f"vime: {startup.line()}")
        self.tracker.log_once(startup.metrics())
        self.tracker.summarize(startup.summary())

    def _prompts(self, args: Config, spec: str) -> tuple[list, dict[int, list[int]], int]:
        prompts = load_prompts(
            spec,
            input_key=args.input_key,
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            seed=args.seed,
            require_label=reward_needs_label(self.settings.rewards),
            apply_chat_template=args.apply_chat_template,
        )
        tools = self.toolbox.schemas if self.toolbox else None
        ids = [
            render_prompt(p.text, self.tokenizer, args.apply_chat_template, tools) for p in prompts
        ]
        kept, kept_ids, dropped = filter_prompt_lengths(
            prompts, ids, args.rollout_max_prompt_len, spec=spec
        )
        if dropped:
            self.log(
                f"vime: {spec}: dropped {dropped} of {len(prompts)} prompts longer than "
                f"--rollout-max-prompt-len {args.rollout_max_prompt_len}"
            )
        return kept, {p.index: i for p, i in zip(kept, kept_ids, strict=True)}, dropped

    def _probe_sequence(self) -> tuple[list[int], int]:
        """A fixed sequence (first prompt + a few of its own tokens) both sides score."""
        prompt = next(iter(self.prompt_ids.values()))
        return prompt + prompt[: max(1, min(8, len(prompt)))], len(prompt)

    def _probe_diff(self) -> dict[str, float]:
        """How far the engines' log-probs of the probe are from the trainer's.

        The trainer scores it while its weights are awake (the sync's turn), the engines
        in the rollout turn (that also serves eval and the next generation): colocated,
        one after the other; on devices of their own, both at once.
        """
        tokens, prompt_len = self.probe
        if self._probe_plan is None:  # the same every rollout: put in the object store once
            dp, n_resp = self.args.data_parallel_size, len(tokens) - prompt_len
            batch = RolloutBatch([tokens] * dp, [prompt_len] * dp, [[1] * n_resp] * dp, [0.0] * dp)
            plan = schedule(batch, global_batch_size=dp, dp_size=dp, micro_batch_size=1)
            self._probe_plan = ray.put(plan)
        pending = self.train_group.submit("compute_log_probs", self._probe_plan, "actor")
        what = "computing the probe's log-probs"
        per_rank = wait_all(pending, what) if self.args.colocate else None
        self.turns.rollout()
        # Every engine scores it: one that missed an update must not hide behind another.
        per_engine = self.engines.score(tokens, prompt_len, self.args.rollout_temperature)
        if per_rank is None:
            per_rank = wait_all(pending, what)
        trainer = next(rank[0] for rank in per_rank if 0 in rank).tolist()
        diff = max(
            abs(a - b) for engine in per_engine for a, b in zip(trainer, engine, strict=True)
        )
        return {"weights/probe_logprob_abs_diff": diff}

    def _loaded_data_position(self, load_dir: str | None) -> dict[str, Any]:
        extra = self.train_group.loaded_extra()
        if "data" not in extra:
            raise ConfigError(
                f"--load {load_dir}: the checkpoint of rollout {self.start_rollout - 1} holds "
                "no data position (it was not written by vime-train); start a new run with "
                "--hf-checkpoint instead"
            )
        return extra["data"]

    def log(self, text: str) -> None:
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.message(text)
        else:
            print(text, flush=True)

    def close(self, status: str = "done") -> None:
        """Release what the run holds; a tracker still open (the run stopped early) writes
        its summary with ``status`` and its plot first."""
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            try:
                tracker.finish({"status": status})  # a no-op after train() finished it
            except Exception as err:  # the run's own error is the one to report
                print(f"vime: could not finish the run's outputs: {err}", file=sys.stderr)
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close()  # before the scorer it calls closes
        scorer = getattr(self, "scorer", None)
        if scorer is not None:
            scorer.close()
        toolbox = getattr(self, "toolbox", None)
        if toolbox is not None:
            toolbox.close()
        if ray.is_initialized():
            stop_ray()


def plan_updates(args: Config, batch: RolloutBatch, rollout_id: int) -> TrainSchedule:
    """The optimizer steps rollout ``rollout_id``'s ``batch`` is trained as: the planner's
    schedule under the run's batch flags, its samples shuffled first with
    ``--shuffle-updates`` (by ``update_order_seed``)."""
    shuffle_seed = update_order_seed(args.seed, rollout_id) if args.shuffle_updates else None
    return schedule(
        batch,
        global_batch_size=args.global_batch_size,
        dp_size=args.data_parallel_size,
        max_tokens_per_gpu=args.max_tokens_per_gpu if args.use_dynamic_batch_size else None,
        micro_batch_size=args.micro_batch_size,
        shuffle_seed=shuffle_seed,
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


def _embedded_checkpoint(output_dir: str, seed: int) -> str:
    from vime.data.tasks import CHARSET
    from vime.models.embedded import write_embedded_checkpoint

    return write_embedded_checkpoint(
        os.path.join(output_dir, EMBEDDED_MODEL_DIR), charset=CHARSET, seed=seed
    )


def _tokenizer(checkpoint_dir: str, *, embedded: bool) -> Any:
    """The checkpoint's tokenizer; the embedded model's without importing transformers'
    auto classes (seconds of the default run's start)."""
    if embedded:
        from vime.models.embedded import load_tokenizer

        return load_tokenizer(checkpoint_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)


def _task(name: str | None) -> Any:
    if name is None:
        return None
    from vime.data.tasks import get_task

    return get_task(name)


def cpu_split(args: Config, use_gpu: bool) -> bool:
    """Whether the training ranks and the engines get CPU cores of their own
    (``--cpu-split``; auto: when both work at once, on a CPU run on this machine)."""
    if use_gpu or joins_cluster(args) or args.cpu_split == "off":
        return False
    return args.cpu_split == "on" or args.max_staleness > 0


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in metrics.items())
