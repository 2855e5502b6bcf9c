"""Rollout engines as Ray actors, and the group the rollout manager talks to.

Where it fits: ``vime.setup.actors`` builds one ``EngineGroup`` on the placement's
rollout bundles, from the run's ``EngineOptions``; ``vime.rollout.manager`` asks it
for completions; the run's weight transport (``vime.ray.transports``) pushes new
weights into it, its engine side running in each actor (``receive_weights``). Each
actor (``vime.ray.engine_actor``) resolves ``--rollout-engine`` and builds its engine through
``vime.rollout.engines.registry`` (any engine meeting ``vime.rollout.types.RolloutEngine``)
and never sees the training processes.

Faults (``vime.ray.engine_watch``): an engine that dies, or that its health calls find
hung, is replaced by a new actor on its bundle (which Ray places on another node
when the engine's node died: ``Placement.wait_placed``), given the current weights by
the run's transport (``restore``), and the calls it held are sent again, up to
``--max-engine-restarts`` times within ``--engine-restart-window`` rollouts.

Timing (``vime.profiling``): each actor records a span around every call that works
(generate, with the tokens it made; score; each weight load, with the bytes it
received; sleep/wake), which the driver drains once per rollout (``drain_spans``):
an engine's busy time is measured in its own process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from vime import profiling
from vime.errors import ConfigError
from vime.ray.engine_actor import GENERATE_GROUP, HEALTH_GROUP, EngineActor
from vime.ray.engine_watch import EngineFaults, HealthWatch, engine_died
from vime.ray.errors import ActorFailure, died_with_node, label_actor, wait_all
from vime.ray.placement import Layout, Placement
from vime.rollout.engines import registry
from vime.rollout.settings import FaultSettings
from vime.rollout.types import Completion, SamplingParams

# Set in every engine actor's process before it starts. OpenMP (the libgomp that torch
# and vLLM's CPU kernels run on) reads its wait policy once, when the library loads, so
# it cannot be set from inside the engine. With OMP_WAIT_POLICY=ACTIVE inherited from the
# driver an idle engine's OpenMP worker spins for ever: a whole core, taken from the
# training ranks that run while the engine waits (bench/engine_idle.py: 1.0 of a core
# idle with ACTIVE; 0.01 unset or PASSIVE). PASSIVE puts idle workers to sleep at once
# whatever the driver's environment; generation tokens/s were the same within noise.
# The variables make the engine's runtime_env its own, so Ray starts a fresh worker
# process for it (~0.7 s of the start-up on two cores) rather than one it started
# ahead. Going without them where the policy is unset costs far more on a busy machine:
# libgomp's default spin made the embedded default's rollout phase 0.4-1.8 s a step
# against 0.12 s with PASSIVE, on two cores that other jobs also used.
ENGINE_ENV_VARS = {"OMP_WAIT_POLICY": "PASSIVE"}


# How many new actors one engine restart starts while each dies with its node (a node
# crashed, which Ray still counted alive when it placed the actor there).
NODE_LOSSES_PER_RESTART = 3

# The share of a GPU an engine process takes beside a training rank under --colocate.
COLOCATED_GPU_SHARE = 0.2


@dataclass(frozen=True)
class EngineActorSpec:
    """How engine ``e``'s actor is placed (``engine_actor_spec``)."""

    bundle: int
    num_cpus: float
    num_gpus: float
    capture_child_tasks: bool
    env_vars: dict[str, str]


def engine_actor_spec(
    layout: Layout, engine: int, order: Sequence[int] | None = None
) -> EngineActorSpec:
    """Ray placement of engine ``engine``'s actor on its bundles (pure, tested on the CPU).

    One GPU per engine: the actor takes that GPU (a share of it under ``--colocate``)
    and vLLM runs in its process. Several GPUs per engine (vLLM tensor parallel):
    vLLM's Ray executor starts one worker per GPU inside the actor's placement group,
    so the actor holds no GPU itself, lets its child tasks into the group, and names
    the engine's bundles in ``VLLM_RAY_BUNDLE_INDICES`` (by default vLLM would take
    the group's first GPU bundles, which are the training ranks'), each worker taking
    the GPU share the actor would have taken. ``bundle`` is the layout's (logical)
    index; vLLM is told the placement group's own indices, ``order`` mapping one to
    the other (``Placement.order``; the identity when None).
    """
    bundles = layout.engine_bundles(engine)
    physical = [order[b] for b in bundles] if order is not None else bundles
    share = COLOCATED_GPU_SHARE if layout.colocate else 1.0
    env = dict(ENGINE_ENV_VARS)
    tensor_parallel = layout.use_gpu and len(bundles) > 1
    if tensor_parallel:
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in physical)
        env["VLLM_RAY_PER_WORKER_GPUS"] = str(share)
    return EngineActorSpec(
        bundle=bundles[0],
        num_cpus=0 if layout.colocate else 1,
        num_gpus=share if layout.use_gpu and not tensor_parallel else 0,
        capture_child_tasks=tensor_parallel,
        env_vars=env,
    )


class EngineGroup:
    """Every rollout engine of the run; prompts are split evenly across them.

    ``kind`` may be ``auto``: each actor resolves it (``resolve_engine``); ``kind`` and
    ``reason`` are then what they chose, and the group refuses engines that disagree
    (their log-probs would not be comparable). ``faults``: the restart budget and the
    health calls' deadline; ``say``: where a restart is reported. ``restore(engines)``,
    set once the run's transport exists, loads the current weights into restarted
    engines.
    """

    def __init__(
        self,
        kind: str,
        checkpoint: str,
        placement: Placement,
        options: registry.EngineOptions,
        cpu_cores: Sequence[Sequence[int]] | None = None,
        *,
        faults: FaultSettings | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        layout = placement.layout
        # ``submit``'s calls run in a thread of their own, so weight loads and scoring (the
        # default group) reach an engine while it generates; ``generate`` stays in order.
        self._remote = ray.remote(concurrency_groups={GENERATE_GROUP: 1, HEALTH_GROUP: 1})(
            EngineActor
        )
        self._placement, self._kind, self._checkpoint = placement, kind, checkpoint
        self._options = [
            options
            if cpu_cores is None
            else dataclasses.replace(options, cpu_cores=tuple(cpu_cores[e]))
            for e in range(layout.num_engines)
        ]
        self.faults = EngineFaults(faults or FaultSettings())
        self.say = say
        self.restore: Callable[[list[int]], None] | None = None
        self._lock = threading.RLock()
        self._busy: dict[int, list[Any]] = {}  # engine -> its generations' refs
        self._unready: set[int] = set()  # restarted, its weights not yet loaded
        self.actors = [self._start(e) for e in range(layout.num_engines)]
        started = wait_all([a.ready.remote() for a in self.actors], "starting the rollout engines")
        self._pids = [self._local_pid(pid, node) for pid, node in started]
        self._check_choices(kind, options)
        self.watch = HealthWatch(self.faults.settings.timeout_s, self._watched)
        self.watch.start()

    def _start(self, engine: int) -> Any:
        """A new actor for engine ``engine`` on its bundle (not waited for)."""
        spec = engine_actor_spec(self._placement.layout, engine, self._placement.order)
        actor = self._remote.options(
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            scheduling_strategy=self._placement.strategy(
                spec.bundle, capture_child_tasks=spec.capture_child_tasks
            ),
            runtime_env={"env_vars": spec.env_vars},
        ).remote(self._kind, self._checkpoint, self._options[engine])
        return label_actor(actor, f"rollout engine {engine}")

    @staticmethod
    def _local_pid(pid: int, node: str) -> int:
        """``pid`` when the process runs on the driver's node, else 0."""
        return pid if node == ray.get_runtime_context().get_node_id() else 0

    def _check_choices(self, kind: str, options: registry.EngineOptions) -> None:
        choices = wait_all([a.choice.remote() for a in self.actors], "reading engine kinds")
        if len({k for k, _ in choices}) > 1:
            raise RuntimeError(
                f"--rollout-engine {kind}: the engines chose differently ({choices}); "
                "install vllm alike on every node or name the engine"
            )
        self.kind, self.reason = choices[0]
        # How LoRA syncs reach the engines (alike: they chose one engine kind).
        self.lora_receiver = wait_all([self.actors[0].lora_receiver.remote()], "reading LoRA")[0]
        tp = options.tensor_parallel_size
        if tp > 1 and not registry.get_engine(self.kind).tensor_parallel:
            # auto, on machines where vLLM does not import
            tp_engines = registry.tensor_parallel_names()
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {tp} needs the {tp_engines} engine (tensor "
                f"parallel), and the engines chose {self.kind} ({self.reason}); install "
                f"{tp_engines} where the engines run, or use --rollout-num-gpus-per-engine 1"
            )

    def close(self) -> None:
        """Stop the health calls (the actors go with Ray)."""
        self.watch.stop()

    # ----- generation -----------------------------------------------------------------------

    def submit(
        self, engine: int, prompts: list[list[int]], params: SamplingParams, actor: Any = None
    ) -> Any:
        """Start ``params.n`` completions per prompt on engine ``engine`` (or on ``actor``,
        an engine's actor taken earlier by ``actor``); returns the ref. It runs beside the
        engine's other calls: new weights arrive while it generates."""
        actor = actor if actor is not None else self.actors[engine]
        call = actor.generate.options(concurrency_group=GENERATE_GROUP)
        return self._track(engine, call.remote(prompts, params))

    def actor(self, engine: int) -> Any:
        """Engine ``engine``'s actor now (a restart replaces it)."""
        return self.actors[engine]

    def _track(self, engine: int, ref: Any) -> Any:
        """Note a generation in flight on ``engine``: the health watch checks it moves."""
        with self._lock:
            self._busy.setdefault(engine, []).append(ref)
        return ref

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; engine k serves the k-th contiguous chunk.

        Each chunk keeps ``params.seed`` and names its offset in
        ``first_prompt_index``, so every completion is seeded by its whole-batch
        prompt index: the same seed samples the same completions with any number
        of engines, and a chunk sent again to a restarted engine samples what the
        dead one would have.
        """
        calls = {}
        for k, (start, stop) in enumerate(_split(len(prompts), len(self.actors))):
            if start == stop:
                continue
            first = params.first_prompt_index + start
            chunk_params = dataclasses.replace(params, first_prompt_index=first)
            if params.prompt_indices is not None:
                chunk_params = dataclasses.replace(
                    chunk_params, prompt_indices=params.prompt_indices[start:stop]
                )
            calls[k] = (prompts[start:stop], chunk_params)
        parts = self._gather("generate", calls, "generating completions")
        return [group for k in sorted(parts) for group in parts[k]]

    def _gather(self, method: str, calls: dict[int, tuple[Any, ...]], what: str) -> dict[int, Any]:
        """``method(*calls[e])`` on each engine ``e``, as ``wait_all`` waits; an engine that
        dies or hangs is restarted (``lost``, ``recover``) and its call sent again."""

        def send(e: int) -> tuple[Any, Any]:
            actor = self.actors[e]
            ref = getattr(actor, method).remote(*calls[e])
            return (self._track(e, ref) if method == "generate" else ref), actor

        pending = {}
        for e in calls:
            ref, actor = send(e)
            pending[ref] = (e, actor)
        out: dict[int, Any] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            e, actor = pending.pop(done[0])
            try:
                (out[e],) = wait_all(done, what)
            except ActorFailure as failure:
                self.lost(e, actor, failure)
                self.recover()
                if method == "generate":
                    self.count_resent(len(calls[e][0]))
                ref, actor = send(e)
                pending[ref] = (e, actor)
        return out

    # ----- faults ---------------------------------------------------------------------------

    def _watched(self) -> list[tuple[int, Any, int, bool]]:
        """The health watch's view: every started engine, its local pid, whether busy."""
        with self._lock:
            engines = [
                (e, a, self._pids[e], list(self._busy.get(e, ())))
                for e, a in enumerate(self.actors)
            ]
        out = []
        for e, actor, pid, refs in engines:
            left = ray.wait(refs, num_returns=len(refs), timeout=0)[1] if refs else []
            with self._lock:  # keep the refs submitted meanwhile
                done = set(refs) - set(left)
                self._busy[e] = [r for r in self._busy.get(e, []) if r not in done]
            out.append((e, actor, pid, bool(left)))
        return out

    def lost(self, engine: int, actor: Any, failure: ActorFailure) -> None:
        """A call on ``engine``'s ``actor`` failed with ``failure``: note the engine for
        ``recover`` when its process died (or the watch found it hung, and killed it);
        raise otherwise, or with restarts off (the run stops, naming the engine)."""
        if not engine_died(failure):
            raise failure
        why = self.watch.reason(actor)
        if why is not None:  # the watch's kill: say why it killed it
            pid = f" (pid {self._pids[engine]})" if self._pids[engine] else ""
            failure = ActorFailure(f"rollout engine {engine}{pid} {why}", detail=failure.detail)
        if self.faults.settings.max_restarts == 0:
            raise failure
        with self._lock:
            if self.actors[engine]._actor_id == actor._actor_id:
                self.faults.lost.setdefault(engine, failure)

    def count_resent(self, requests: int) -> None:
        """``requests`` prompts sent again, their engine lost (``fault/requests_resent``)."""
        with self._lock:
            self.faults.resent += requests

    def ready(self, engine: int) -> bool:
        """Whether ``engine`` serves the run's weights (not lost, not waiting for them)."""
        with self._lock:
            return engine not in self.faults.lost and engine not in self._unready

    def needs_recovery(self) -> bool:
        with self._lock:
            return bool(self.faults.lost)

    def recover(self, *, restore: bool = True) -> list[int]:
        """Replace every lost engine by a new actor on its bundle, its weights loaded by
        ``restore`` unless ``restore`` is False (the caller's sync loads them); raises
        ``ActorFailure`` beyond the restart budget. The driver's main thread only: the
        weights come from the training ranks. Returns the engines restarted."""
        with self._lock:
            lost = sorted(self.faults.lost.items())
        for engine, failure in lost:
            self.faults.take_restart(engine, failure)
            with contextlib.suppress(Exception):
                ray.kill(self.actors[engine], no_restart=True)
            actor, pid, node = self._restarted(engine, failure)
            with self._lock:
                self.actors[engine], self._pids[engine] = actor, self._local_pid(pid, node)
                self._busy.pop(engine, None)
                self._unready.add(engine)
                del self.faults.lost[engine]
            self.say(
                f"vime: {failure}; restarted it on its bundle "
                f"({len(self.faults.recent)} of {self.faults.budget()})"
            )
        restarted = [e for e, _ in lost]
        if restore and restarted:
            if self.restore is not None:
                self.restore(restarted)
            self.weights_loaded()
        return restarted

    def _restarted(self, engine: int, failure: ActorFailure) -> tuple[Any, int, str]:
        """Start engine ``engine``'s new actor and wait for it (it, its pid, its node).
        A node lost without a word (a crash) is still alive to Ray until its heartbeats
        are missed: a new actor placed there meanwhile dies with it, and is started
        again, up to ``NODE_LOSSES_PER_RESTART`` times."""
        for attempt in range(1, NODE_LOSSES_PER_RESTART + 1):
            actor, ready = self._start_placed(engine, failure)
            try:
                ((pid, node),) = wait_all([ready], f"restarting rollout engine {engine}")
                return actor, pid, node
            except ActorFailure as lost:
                if not died_with_node(lost) or attempt == NODE_LOSSES_PER_RESTART:
                    raise
        raise AssertionError("NODE_LOSSES_PER_RESTART >= 1")

    def _start_placed(self, engine: int, failure: ActorFailure) -> tuple[Any, Any]:
        """Engine ``engine``'s new actor and its ``ready`` ref, once Ray has the engine's
        bundle on a live node. When the bundle's node died, Ray places it on another one
        with room: waited for up to ``--engine-timeout``, then the run stops in one line,
        ``failure`` (what took the engine) first."""
        actor = self._start(engine)
        ready = actor.ready.remote()
        timeout_s = self.faults.settings.timeout_s
        bundles = self._placement.layout.engine_bundles(engine)
        if not self._placement.wait_placed(ready, bundles, timeout_s):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise ActorFailure(
                f"{failure}; restarting it: Ray placed its bundle on no live node within "
                f"--engine-timeout {timeout_s:g} s; give the cluster a node with "
                f"{self._placement.layout.bundle} free, or run fewer engines",
                detail=failure.detail,
            )
        return actor, ready

    def weights_loaded(self) -> None:
        """Every engine serves the run's weights now (after a sync to all of them)."""
        with self._lock:
            self._unready.clear()

    def note_dead(self, what: str, timeout_s: float = 5.0) -> bool:
        """After ``what`` failed on every engine: note those whose process is gone for
        ``recover`` (True if any), or raise ``ActorFailure`` naming one with restarts off.
        A transfer to a dead engine fails on the sending side ("connection closed by
        peer"); this finds the cause. Engines busy past ``timeout_s`` count as alive."""
        refs = {a.weight_version.remote(): (e, a) for e, a in enumerate(self.actors)}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        found = False
        for ref in done:
            e, actor = refs[ref]
            try:
                wait_all([ref], what)
            except ActorFailure as failure:
                self.lost(e, actor, failure)
                found = True
        return found

    # ----- every engine at once -------------------------------------------------------------

    def _each(self, method: str, what: str, *args: Any) -> list[Any]:
        out = self._gather(method, dict.fromkeys(range(len(self.actors)), args), what)
        return [out[e] for e in range(len(self.actors))]

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[list[float]]:
        """Every engine's log-probs of ``token_ids[prompt_len:]``, one list per engine."""
        return self._each("score", "scoring the probe", token_ids, prompt_len, temperature)

    def drain_spans(self) -> list[list[profiling.Span]]:
        """Every engine's spans since the last drain, in engine order."""
        return self._each("drain_spans", "reading engine timings")

    def cpu_cores(self) -> list[list[int]]:
        """Every engine's CPU cores, as its process sees them."""
        return self._each("cpu_cores", "reading engine cores")

    def weight_versions(self) -> list[int]:
        return self._each("weight_version", "reading versions")

    def sleep(self) -> None:
        self._each("sleep", "putting engines to sleep")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` of ``vime.rollout.types.MEMORY_TAGS``,
        or all of it."""
        self._each("wake_up", "waking engines", tags)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
