"""Rollout engines as Ray actors, and the group the rollout manager talks to.

Where it fits: ``vime.setup.actors`` builds one ``EngineGroup`` on the placement's
rollout bundles, from the run's ``EngineOptions``; ``vime.rollout.manager`` asks it
for completions; the run's weight transport (``vime.ray.transports``) pushes new
weights into it, its engine side running in each actor (``receive_weights``). Each
actor resolves ``--rollout-engine`` and builds its engine through
``vime.rollout.engines.registry`` (any engine meeting ``vime.rollout.types.RolloutEngine``)
and never sees the training processes.

Timing (``vime.profiling``): each actor records a span around every call that works
(generate, with the tokens it made; score; each weight load, with the bytes it
received; sleep/wake), which the driver drains once per rollout (``drain_spans``):
an engine's busy time is measured in its own process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from vime import device as vime_device
from vime import profiling
from vime.errors import ConfigError
from vime.ray.errors import label_actor, wait_all
from vime.ray.placement import Layout, Placement, pin_process, process_cores
from vime.ray.transports import transport_class
from vime.rollout.engines import registry
from vime.rollout.types import Completion, SamplingParams
from vime.weights.lora import AdapterLoader, engine_receiver
from vime.weights.update_stream import UpdateStream

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


# The engine actor's concurrency group of ``EngineGroup.submit``'s generations.
GENERATE_GROUP = "generate"

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


class EngineActor:
    """One rollout engine in its own process (wrapped by ``ray.remote`` below)."""

    def __init__(self, kind: str, checkpoint: str, options: registry.EngineOptions) -> None:
        kind, self.reason = registry.resolve_engine(kind, options.tiny_model)
        self.kind = kind
        # LoRA's adapter-only syncs: served by the engine's own LoRA, or merged here.
        self._lora = None
        if options.lora is not None:
            native_lora = registry.get_engine(kind).native_lora
            self._lora = engine_receiver(options.lora, native_lora, vime_device.cuda_available())
            if isinstance(self._lora, AdapterLoader):
                options = dataclasses.replace(options, max_lora_rank=options.lora.settings.rank)
        threads = options.num_threads
        if options.cpu_cores:  # cores of its own (async rollout on the CPU): threads follow
            pin_process(options.cpu_cores)
            threads = len(options.cpu_cores)
        import torch

        if threads:
            torch.set_num_threads(threads)
        self._threads = torch.get_num_threads()
        self.engine = registry.build_engine(kind, checkpoint, options)
        self.engine.weight_version = 0
        self.weight_link: Any = None  # what the run's transport keeps here (open_weight_link)
        self._stream: UpdateStream | None = None
        profiling.enable()

    def ready(self) -> int:
        return os.getpid()

    def choice(self) -> tuple[str, str]:
        """``(engine, reason)``, as ``resolve_engine`` gave them in this process."""
        return self.kind, self.reason

    def lora_receiver(self) -> str | None:
        """How LoRA syncs reach the engine: ``AdapterLoader`` (its own LoRA) or
        ``AdapterMerger``; None without LoRA."""
        return None if self._lora is None else type(self._lora).__name__

    def _same_threads(self) -> int:
        """Give the calling thread the intra-op threads the engine was built with. The
        actor's calls run in thread pools Ray started before ``__init__``, whose OpenMP
        thread count (a per-thread setting; Ray sets OMP_NUM_THREADS to the actor's CPUs)
        ``torch.set_num_threads`` there did not reach: vLLM's CPU attention refuses a
        thread count other than the one it planned with, and the hf engine would run on
        fewer threads than asked."""
        import torch

        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        return torch.get_num_threads()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        threads = self._same_threads()
        with profiling.span("generate", prompts=len(prompts), threads=threads) as info:
            out = self.engine.generate(prompts, params)
            info["tokens"] = sum(len(c.response_ids) for group in out for c in group)
        return out

    @profiling.timed("score")
    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        self._same_threads()
        return self.engine.score(token_ids, prompt_len, temperature)

    def drain_spans(self) -> list[profiling.Span]:
        return profiling.drain()

    def cpu_cores(self) -> list[int]:
        """The CPU cores this engine's process may run on, over all its threads."""
        return process_cores()

    def weight_version(self) -> int:
        return self.engine.weight_version

    # --- weight transports: each one's engine side (vime.ray.transports) runs here ---

    def open_weight_link(self, transport: str, *args: Any) -> None:
        """Keep what ``transport`` receives through (the broadcast group)."""
        self.weight_link = transport_class(transport).open_receiver(*args)

    def receive_weights(self, transport: str, *payload: Any) -> Any:
        """``transport``'s receive, with what its sender sent."""
        self._same_threads()
        return transport_class(transport).receive(self, *payload)

    def load_weights(self, buckets: Iterable[list[Any]], version: int) -> int:
        """A whole set in one update; returns the version served."""
        self._same_threads()
        with profiling.span("update_weights") as info:
            self._update(_counted(buckets, info), version)
        return self.engine.weight_version

    def _update(self, buckets: Iterable[list[Any]], version: int) -> None:
        """The engine's update; with LoRA through its receiver (``vime.weights.lora``)."""
        if self._lora is not None:
            self._lora.update(self.engine, buckets, version)
        else:
            self.engine.update_weights(buckets, version)

    def stream_bucket(self, receive: Callable[[], list[Any]]) -> None:
        """Receive a bucket and hand it to this sync's update (the first bucket starts it;
        ``finish_update`` ends it). A failure ends the update where it is: the served
        version stays."""
        self._same_threads()  # the update's own thread starts from this one's
        if self._stream is None:
            version = self.engine.weight_version  # named by finish_update
            self._stream = UpdateStream(lambda b: self._update(b, version))
        try:
            with profiling.span("receive_bucket") as info:
                self._stream.put(next(_counted([receive()], info)))
        except BaseException:
            self._stream.abort()
            self._stream = None
            raise

    @profiling.timed("finish_update")
    def finish_update(self, version: int) -> int:
        """End the sync: the update checks the set is complete, then serves ``version``."""
        stream, self._stream = self._stream, None
        if stream is None:  # no bucket came: the engine says what is missing
            self._update([], version)
        else:
            stream.finish()
            vime_device.synchronize()  # the update ran on another thread's stream
        self.engine.weight_version = version
        return version

    @profiling.timed("sleep")
    def sleep(self) -> None:
        self._same_threads()
        self.engine.sleep()

    @profiling.timed("wake_up")
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._same_threads()
        self.engine.wake_up(tags)


def _counted(buckets: Iterable[list[Any]], info: dict[str, Any]) -> Iterator[list[Any]]:
    """``buckets`` as they go by, their tensors' bytes added to ``info["bytes"]``."""
    for bucket in buckets:
        info["bytes"] = info.get("bytes", 0) + sum(
            t.numel() * t.element_size() for _, t in bucket if hasattr(t, "element_size")
        )
        yield bucket


class EngineGroup:
    """Every rollout engine of the run; prompts are split evenly across them.

    ``kind`` may be ``auto``: each actor resolves it (``resolve_engine``); ``kind`` and
    ``reason`` are then what they chose, and the group refuses engines that disagree
    (their log-probs would not be comparable).
    """

    def __init__(
        self,
        kind: str,
        checkpoint: str,
        placement: Placement,
        options: registry.EngineOptions,
        cpu_cores: Sequence[Sequence[int]] | None = None,
    ) -> None:
        layout = placement.layout
        # ``submit``'s calls run in a thread of their own, so weight loads and scoring (the
        # default group) reach an engine while it generates; ``generate`` stays in order.
        remote = ray.remote(concurrency_groups={GENERATE_GROUP: 1})(EngineActor)
        self.actors = []
        for e in range(layout.num_engines):
            spec = engine_actor_spec(layout, e, placement.order)
            if cpu_cores is not None:
                options = dataclasses.replace(options, cpu_cores=tuple(cpu_cores[e]))
            actor = remote.options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                scheduling_strategy=placement.strategy(
                    spec.bundle, capture_child_tasks=spec.capture_child_tasks
                ),
                runtime_env={"env_vars": spec.env_vars},
            ).remote(kind, checkpoint, options)
            self.actors.append(label_actor(actor, f"rollout engine {e}"))
        wait_all([a.ready.remote() for a in self.actors], "starting the rollout engines")
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

    def submit(self, engine: int, prompts: list[list[int]], params: SamplingParams) -> Any:
        """Start ``params.n`` completions per prompt on engine ``engine``; returns the ref.
        It runs beside the engine's other calls: new weights arrive while it generates."""
        call = self.actors[engine].generate.options(concurrency_group=GENERATE_GROUP)
        return call.remote(prompts, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; engine k serves the k-th contiguous chunk.

        Each chunk keeps ``params.seed`` and names its offset in
        ``first_prompt_index``, so every completion is seeded by its whole-batch
        prompt index: the same seed samples the same completions with any number
        of engines.
        """
        chunks = _split(len(prompts), len(self.actors))
        refs = []
        for k, (start, stop) in enumerate(chunks):
            if start == stop:
                continue
            first = params.first_prompt_index + start
            chunk_params = dataclasses.replace(params, first_prompt_index=first)
            if params.prompt_indices is not None:
                chunk_params = dataclasses.replace(
                    chunk_params, prompt_indices=params.prompt_indices[start:stop]
                )
            refs.append(self.actors[k].generate.remote(prompts[start:stop], chunk_params))
        out: list[list[Completion]] = []
        for part in wait_all(refs, "generating completions"):
            out.extend(part)
        return out

    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[list[float]]:
        """Every engine's log-probs of ``token_ids[prompt_len:]``, one list per engine."""
        refs = [a.score.remote(token_ids, prompt_len, temperature) for a in self.actors]
        return wait_all(refs, "scoring the probe")

    def drain_spans(self) -> list[list[profiling.Span]]:
        """Every engine's spans since the last drain, in engine order."""
        return wait_all([a.drain_spans.remote() for a in self.actors], "reading engine timings")

    def cpu_cores(self) -> list[list[int]]:
        """Every engine's CPU cores, as its process sees them."""
        return wait_all([a.cpu_cores.remote() for a in self.actors], "reading engine cores")

    def weight_versions(self) -> list[int]:
        return wait_all([a.weight_version.remote() for a in self.actors], "reading versions")

    def sleep(self) -> None:
        wait_all([a.sleep.remote() for a in self.actors], "putting engines to sleep")

    def raise_if_one_died(self, what: str, timeout_s: float = 5.0) -> None:
        """Raise ``ActorFailure`` naming an engine whose process is gone. A transfer to a
        dead engine fails on the sending side ("connection closed by peer"); this turns
        that into the cause, for ``what`` failed. Engines busy past ``timeout_s`` count as
        alive."""
        refs = [a.weight_version.remote() for a in self.actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        wait_all(done, what)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` of ``vime.rollout.types.MEMORY_TAGS``,
        or all of it."""
        wait_all([a.wake_up.remote(tags) for a in self.actors], "waking engines")


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
