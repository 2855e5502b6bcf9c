"""Weight-sync transports: how the training ranks' HF-named buckets reach the engines.

Where it fits: every backend's ``weight_buckets`` (a collective all training
ranks iterate in lock-step) is the one source; the Ray layer
(``vime.ray.transports``, one class per transport) drives one of these from
training rank 0 to every rollout engine after each optimizer update:

- ``object-store``: rank 0 puts each bucket in the Ray object store; engines
  fetch them one at a time (CPU default; no extra process group).
- ``broadcast``: a process group of its own between training rank 0 (group
  rank 0) and the engines (ranks 1..E), separate from training's default
  group: gloo on CPU, NCCL on GPU. Each bucket goes as one flat tensor per dtype,
  announced by its metadata (names, dtypes, shapes) so receivers allocate exactly.
- ``cuda-ipc``: with ``--colocate`` on GPU, a training rank and its engine share a
  device; the rank hands the engine CUDA IPC handles of each bucket's tensors and
  the engine copies from them in place (no host round trip, no second copy).
- ``disk``: an HF safetensors folder the engines reload (slow, but needs
  nothing shared except a file system).

Nothing here imports Ray: the functions move tensors; the Ray layer decides who
calls them.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from vime.weights.buckets import Bucket

Metadata = list[tuple[str, torch.dtype, tuple[int, ...]]]


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_ip() -> str:
    """This host's address as other hosts of the cluster reach it."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests): loopback is all there is
        return "127.0.0.1"


class BroadcastGroup:
    """A standalone process group of training rank 0 and the rollout engines.

    Built straight on a TCPStore so it neither needs nor disturbs the training
    ranks' default process group; the sender is group rank 0.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self._group = dist.ProcessGroupNCCL(self._store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"broadcast backend must be gloo or nccl, got {backend!r}")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([tensor], opts).wait()

    def send(self, bucket: Bucket) -> None:
        """Rank 0: broadcast one bucket (the receivers were given its metadata)."""
        for dtype, names in _by_dtype(metadata_of(bucket)).items():
            tensors = dict(bucket)
            flat = torch.cat([tensors[name].reshape(-1) for name in names])
            self._broadcast(flat.to(self.device, dtype))

    def receive(self, metadata: Metadata) -> Bucket:
        """Ranks 1..: receive the bucket described by ``metadata``."""
        shapes = {name: shape for name, _, shape in metadata}
        received: dict[str, torch.Tensor] = {}
        for dtype, names in _by_dtype(metadata).items():
            sizes = [_numel(shapes[name]) for name in names]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self._broadcast(flat)
            for name, piece in zip(names, flat.split(sizes), strict=True):
                received[name] = piece.view(shapes[name])
        return [(name, received[name]) for name, _, _ in metadata]


def metadata_of(bucket: Bucket) -> Metadata:
    return [(name, t.dtype, tuple(t.shape)) for name, t in bucket]


def _by_dtype(metadata: Metadata) -> dict[torch.dtype, list[str]]:
    groups: dict[torch.dtype, list[str]] = {}
    for name, dtype, _ in metadata:
        groups.setdefault(dtype, []).append(name)
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def buckets_from_disk(folder: str) -> Iterator[Bucket]:
    """The tensors of an HF safetensors folder, one file per bucket."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files to load weights from")
    for name in files:
        yield list(load_file(os.path.join(folder, name)).items())


IpcHandles = list[tuple[str, Any, tuple[Any, ...]]]

# Index of ``storage_device`` in the arguments of torch's ``rebuild_cuda_tensor``.
_STORAGE_DEVICE_ARG = 6


def share_cuda_bucket(bucket: Bucket) -> IpcHandles:
    """CUDA IPC handles of a bucket's tensors (the sender keeps the tensors alive until
    every receiver has copied from them)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles: IpcHandles = []
    for name, tensor in bucket:
        if not tensor.is_cuda:
            raise ValueError(f"{name}: cuda-ipc sync needs CUDA tensors, got {tensor.device}")
        rebuild, args = reduce_tensor(tensor.detach().contiguous())
        handles.append((name, rebuild, args))
    return handles


def open_cuda_bucket(handles: IpcHandles, device_index: int) -> Bucket:
    """Tensors viewing the sender's memory, opened on this process's ``device_index``
    (the same physical GPU: each process may number it differently)."""
    bucket: Bucket = []
    for name, rebuild, args in handles:
        args = list(args)
        args[_STORAGE_DEVICE_ARG] = device_index
        bucket.append((name, rebuild(*args)))
    return bucket
