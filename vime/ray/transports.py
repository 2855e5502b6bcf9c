"""Weight transports over Ray: one class per ``--weight-sync`` name.

Where it fits: ``vime.trainer`` builds the run's transport once the training ranks
and the engines exist (``make_transport``, which resolves ``auto`` through
``weight_transport``), calls ``setup`` once and ``sync(version)`` after every update.
Each class holds the three parts of one transport, each run in its own process:

- the driver: ``setup`` and ``sync`` (returns the version each engine then serves),
  and ``restore``, which brings restarted engines up to the version last synced
  (``vime.ray.engines.EngineGroup.recover``; a transport that cannot reach them
  alone is set up again and syncs every engine);
- every training rank: ``send``, run by ``TrainWorker.send_weights`` (the backend's
  ``sync_buckets`` is a collective every rank iterates; rank 0 sends), after
  ``open_sender`` where the transport keeps something on the rank;
- every engine: ``receive``, run by ``EngineActor.receive_weights``, after
  ``open_receiver`` where the transport keeps something on the engine.

The tensors are moved by ``vime.weights.transports`` (no Ray there). A transport
takes its own small frozen settings (``settings_from`` the run's ``SyncSettings``),
never the run's flags. Adding one: its name and
description in ``vime.ray.transport_names`` (``--weight-sync``'s choices), a class
here and its entry in ``TRANSPORTS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import ray

from vime.ray.errors import wait_all


@dataclass(frozen=True)
class SyncSettings:
    """What a run's weight sync is made from (built from the flags by ``vime.config``):
    ``--weight-sync`` (a transport or ``auto``), ``--update-weight-buffer-size``, whether
    the engines share the training GPUs (``--colocate``), GPUs per engine, and the run's
    output folder (where the ``disk`` transport writes)."""

    weight_sync: str
    bucket_bytes: int
    colocate: bool
    gpus_per_engine: int
    output_dir: str


@dataclass(frozen=True)
class BucketSettings:
    """A transport that moves the weights bucket by bucket."""

    bucket_bytes: int


@dataclass(frozen=True)
class BroadcastSettings:
    """The broadcast group's collective backend: gloo on the CPU, NCCL on GPUs."""

    bucket_bytes: int
    backend: str


@dataclass(frozen=True)
class DiskSettings:
    """The folder the trainer writes the weights to and the engines reload from."""

    folder: str


class SendingRank(Protocol):
    """What a transport's ``send`` sees of a training rank (``TrainWorker``)."""

    rank: int
    weight_link: Any

    def sync_buckets(self, bucket_bytes: int) -> Iterable[Any]: ...


class ReceivingEngine(Protocol):
    """What a transport's ``receive`` sees of an engine (``EngineActor``)."""

    weight_link: Any

    def load_weights(self, buckets: Iterable[Any], version: int) -> int: ...

    def stream_bucket(self, receive: Callable[[], Any]) -> None: ...


class WeightTransport:
    """How new weights get from the training ranks to every engine (see the module)."""

    name: ClassVar[str]
    # Whether ``sync`` can reach some engines only (``restore``'s restarted ones).
    partial: ClassVar[bool] = False

    def __init__(self, settings: Any, train_group: Any, engines: Any) -> None:
        self.settings, self.train_group, self.engines = settings, train_group, engines
        self.version = 0  # the version the last sync pushed; the engines start at 0

    @classmethod
    def settings_from(cls, sync: SyncSettings, use_gpu: bool) -> Any:
        """This transport's own settings, from the run's."""
        return BucketSettings(sync.bucket_bytes)

    # --- the driver ---

    def setup(self) -> None:
        """Once, before the first sync."""

    def sync(self, version: int, engines: list[int] | None = None) -> list[int]:
        """Push the trainer's weights to every engine (or to ``engines``, where the
        transport is ``partial``) as ``version``; returns the version each engine serves
        afterwards."""
        raise NotImplementedError(f"{type(self).__name__}.sync")

    def restore(self, engines: list[int]) -> None:
        """Load the version last synced into ``engines``, restarted from the checkpoint.
        Only while the trainer still holds that version: the driver's main thread,
        outside training and the sync. A ``partial`` transport loads them alone; any
        other is set up again over the engines as they now are (a broadcast group is
        formed anew, the dead member's left behind) and syncs that version to all, the
        engines that kept it loading it again."""
        if not self.partial:
            self.setup()
        if self.version == 0:
            return
        served = self.sync(self.version, engines if self.partial else None)
        if any(v != self.version for v in served):
            raise RuntimeError(f"restarted engines serve versions {served}, not {self.version}")

    def _actors(self, engines: list[int] | None) -> list[Any]:
        """The actors of ``engines`` (all of them for None), as they are now."""
        actors = list(self.engines.actors)
        return actors if engines is None else [actors[e] for e in engines]

    def _send_from_every_rank(self, what: str, version: int) -> list[Any]:
        refs = self.train_group.submit(
            "send_weights", self.name, self.settings, self.engines.actors, version
        )
        return wait_all(refs, what)

    # --- a training rank ---

    @staticmethod
    def open_sender(*args: Any) -> Any:
        """What ``send`` keeps on the rank (``SendingRank.weight_link``)."""
        raise NotImplementedError("this transport keeps nothing on a training rank")

    @classmethod
    def send(cls, rank: SendingRank, settings: Any, engines: list[Any], version: int) -> Any:
        """Every rank iterates the weight buckets; rank 0 sends them."""
        raise NotImplementedError(f"{cls.__name__}: no training rank sends")

    # --- an engine ---

    @staticmethod
    def open_receiver(*args: Any) -> Any:
        """What ``receive`` keeps on the engine (``ReceivingEngine.weight_link``)."""
        raise NotImplementedError("this transport keeps nothing on an engine")

    @classmethod
    def receive(cls, engine: ReceivingEngine, *payload: Any) -> Any:
        """Take what was sent into the engine."""
        raise NotImplementedError(f"{cls.__name__}.receive")


class ObjectStoreTransport(WeightTransport):
    """Rank 0 puts each bucket in Ray's object store; every engine fetches them one at a
    time into one update (the CPU default; tensor-parallel engines on GPUs too)."""

    name = "object-store"
    partial = True
    settings: BucketSettings

    def sync(self, version: int, engines: list[int] | None = None) -> list[int]:
        pushes = self.train_group.submit("send_weights", self.name, self.settings, [], version)
        # Rank 0's bucket refs reach the engines as a ref, resolved by Ray once the push
        # is done: the engines start loading without a round trip through the driver.
        loads = [
            a.receive_weights.remote(self.name, pushes[0], version) for a in self._actors(engines)
        ]
        what = "syncing weights through the object store"
        served = wait_all(pushes + loads, what)[len(pushes) :]
        if engines is None:
            self.version = version
        return served

    @classmethod
    def send(cls, rank: SendingRank, settings: Any, engines: list[Any], version: int) -> list[Any]:
        refs = []
        for bucket in rank.sync_buckets(settings.bucket_bytes):
            if rank.rank == 0:
                refs.append(ray.put(bucket))
        return refs

    @classmethod
    def receive(cls, engine: ReceivingEngine, refs: list[Any], version: int) -> int:
        return engine.load_weights((ray.get(ref) for ref in refs), version)


class BroadcastTransport(WeightTransport):
    """A process group of its own between training rank 0 (group rank 0) and the engines
    (ranks 1..E): each bucket goes as one flat tensor per dtype, announced by its
    metadata, and streams into one update per sync on every engine."""

    name = "broadcast"
    settings: BroadcastSettings

    @classmethod
    def settings_from(cls, sync: SyncSettings, use_gpu: bool) -> BroadcastSettings:
        return BroadcastSettings(sync.bucket_bytes, "nccl" if use_gpu else "gloo")

    def setup(self) -> None:
        """Form the group: rank 0's address, then every member joins at once."""
        sender = self.train_group.workers[0]
        ((host, port),) = wait_all([sender.address.remote()], "opening a port")
        world, backend = 1 + len(self.engines.actors), self.settings.backend
        refs = [sender.open_weight_link.remote(self.name, host, port, 0, world, backend)]
        refs += [
            a.open_weight_link.remote(self.name, host, port, rank, world, backend)
            for rank, a in enumerate(self.engines.actors, start=1)
        ]
        wait_all(refs, "forming the weight-broadcast group")

    def sync(self, version: int, engines: list[int] | None = None) -> list[int]:
        self._send_from_every_rank("broadcasting weights", version)
        self.version = version
        return self.engines.weight_versions()

    @staticmethod
    def open_sender(host: str, port: int, rank: int, world: int, backend: str) -> Any:
        from vime.weights.transports import BroadcastGroup

        return BroadcastGroup(host, port, rank, world, backend=backend)

    open_receiver = open_sender

    @classmethod
    def send(cls, rank: SendingRank, settings: Any, engines: list[Any], version: int) -> None:
        from vime.weights.transports import metadata_of

        for bucket in rank.sync_buckets(settings.bucket_bytes):
            if rank.rank != 0:
                continue
            meta = metadata_of(bucket)
            refs = [engine.receive_weights.remote(cls.name, meta) for engine in engines]
            rank.weight_link.send(bucket)
            ray.get(refs)
        if rank.rank == 0:
            ray.get([engine.finish_update.remote(version) for engine in engines])

    @classmethod
    def receive(cls, engine: ReceivingEngine, metadata: list[Any]) -> None:
        """One bucket (the tensors are this process's own)."""
        engine.stream_bucket(lambda: engine.weight_link.receive(metadata))


class CudaIpcTransport(WeightTransport):
    """Colocated on GPUs: training rank r hands the engine on its GPU (engine r) CUDA IPC
    handles of each bucket, which the engine copies from (no host round trip)."""

    name = "cuda-ipc"
    settings: BucketSettings

    def sync(self, version: int, engines: list[int] | None = None) -> list[int]:
        self._send_from_every_rank("sharing weights over CUDA IPC", version)
        self.version = version
        return self.engines.weight_versions()

    @classmethod
    def send(cls, rank: SendingRank, settings: Any, engines: list[Any], version: int) -> None:
        from vime.weights.transports import share_cuda_bucket

        engine = engines[rank.rank] if rank.rank < len(engines) else None
        for bucket in rank.sync_buckets(settings.bucket_bytes):
            if engine is not None:
                ray.get(engine.receive_weights.remote(cls.name, share_cuda_bucket(bucket)))
        if engine is not None:
            ray.get(engine.finish_update.remote(version))

    @classmethod
    def receive(cls, engine: ReceivingEngine, handles: list[Any]) -> None:
        """One bucket, copied out of the sender's memory (which it reuses once this
        returns) before the update sees it."""
        import torch

        from vime import device
        from vime.weights.transports import open_cuda_bucket

        def copied() -> list[Any]:
            views = open_cuda_bucket(handles, torch.cuda.current_device())
            bucket = [(name, t.clone()) for name, t in views]
            # The copies have run before the views close and the call returns.
            device.synchronize()
            return bucket

        engine.stream_bucket(copied)


class DiskTransport(WeightTransport):
    """The trainer writes an HF safetensors folder and every engine reloads it (slow, but
    needs nothing shared except a file system). The folder is always a whole model (LoRA
    merged in): a checkpoint an engine could start from."""

    name = "disk"
    partial = True
    settings: DiskSettings

    @classmethod
    def settings_from(cls, sync: SyncSettings, use_gpu: bool) -> DiskSettings:
        return DiskSettings(os.path.join(sync.output_dir, "weight_sync"))

    def sync(self, version: int, engines: list[int] | None = None) -> list[int]:
        folder = self.settings.folder
        self.train_group.export_hf(folder, merged=True)
        actors = self._actors(engines)
        calls = [a.receive_weights.remote(self.name, folder, version) for a in actors]
        served = wait_all(calls, "reloading weights from disk")
        if engines is None:
            self.version = version
            return self.engines.weight_versions()
        return served

    @classmethod
    def receive(cls, engine: ReceivingEngine, folder: str, version: int) -> int:
        from vime.weights.transports import buckets_from_disk

        return engine.load_weights(buckets_from_disk(folder), version)


TRANSPORTS: dict[str, type[WeightTransport]] = {
    cls.name: cls
    for cls in (ObjectStoreTransport, BroadcastTransport, CudaIpcTransport, DiskTransport)
}


class UnknownTransportError(ValueError):
    """A name that is no registered weight transport."""


def transport_class(name: str) -> type[WeightTransport]:
    """The transport registered under ``name``; the error lists the choices in one line."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise UnknownTransportError(
            f"unknown weight transport {name!r}; choose from: {', '.join(TRANSPORTS)}"
        ) from None


def weight_transport(sync: SyncSettings, use_gpu: bool) -> str:
    """The weight transport: as asked (validated), or for ``auto``: CUDA IPC where every
    engine shares its GPU with the training rank it reads from, an NCCL broadcast to
    one-GPU engines on GPUs of their own, else the Ray object store."""
    if sync.weight_sync != "auto":
        return sync.weight_sync
    if use_gpu and sync.gpus_per_engine == 1:
        # NCCL takes one rank per GPU: colocated engines share the training ranks' GPUs.
        return "cuda-ipc" if sync.colocate else "broadcast"
    # CPU, or tensor-parallel engines, whose actors hold no GPU to receive on (vLLM's
    # workers hold them): through host memory.
    return "object-store"


def make_transport(
    sync: SyncSettings, use_gpu: bool, train_group: Any, engines: Any
) -> WeightTransport:
    """The run's transport (``--weight-sync``, ``auto`` resolved), not set up yet."""
    cls = transport_class(weight_transport(sync, use_gpu))
    return cls(cls.settings_from(sync, use_gpu), train_group, engines)
