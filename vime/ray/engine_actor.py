"""``EngineActor``: one rollout engine in its own Ray actor process.

Where it fits: ``vime.ray.engines.EngineGroup`` starts one per engine on the
placement's rollout bundles. The actor resolves ``--rollout-engine`` and builds its
engine through ``vime.rollout.engines.registry``, runs the run's weight transport's
engine side (``receive_weights``, ``vime.ray.transports``), answers the health calls
of ``vime.ray.engine_watch`` in a concurrency group of their own, and records a span
around every call that works (``vime.profiling``), drained once per rollout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ray

from vime import device as vime_device
from vime import profiling
from vime.ray.placement import pin_process, process_cores
from vime.ray.transports import transport_class
from vime.rollout.engines import registry
from vime.rollout.types import Completion, SamplingParams
from vime.weights.lora import AdapterLoader, engine_receiver
from vime.weights.update_stream import UpdateStream

# The engine actor's concurrency group of ``EngineGroup.submit``'s generations.
GENERATE_GROUP = "generate"
# Its group of the health calls alone: answered whatever else the engine is doing.
HEALTH_GROUP = "health"


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

    def ready(self) -> tuple[int, str]:
        """This process's pid and Ray node."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group=HEALTH_GROUP)
    def health(self) -> int:
        """The engine's step counter (``StepGate.progress``): it answers while the process
        runs, and moves while the engine generates."""
        gate = getattr(self.engine, "gate", None)
        return gate.progress if gate is not None else 0

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
