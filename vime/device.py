"""The device seam: where CUDA-only calls live, so callers need no ``torch.cuda`` branches.

Where it fits: the fsdp2 backend asks this module which device a rank uses,
which process-group backend goes with it, whether flash-attention is usable,
which varlen attention kernels are installed, and how to park tensors in host
memory and free the allocator cache for ``sleep``/``wake_up``; rollout engines
should come here too rather than call ``torch.cuda`` directly. On a CPU-only
machine every helper is a cheap no-op or returns the CPU answer, so the CPU test
suite runs the same code paths as a GPU job. Training moves tensors between host
and device through ``to_device`` and ``to_host`` only: the one place copies are
pinned and asynchronous, and the one place ``vime.sync_budget`` sees them on a CPU.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterable

import torch

from vime.sync_budget import host_only, note_transfer


def is_cuda(device: torch.device | str | None) -> bool:
    """Whether ``device`` is a CUDA device (``None`` means the CPU)."""
    return device is not None and torch.device(device).type == "cuda"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def local_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` (made current) when CUDA exists, else CPU."""
    if not cuda_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a host tensor) in page-locked memory where CUDA exists, so its copy to
    the device can be asynchronous; the tensor itself elsewhere."""
    return tensor.pin_memory() if cuda_available() and not tensor.is_pinned() else tensor


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: pinned and copied
    ``non_blocking`` (the caching host allocator keeps the pinned block until the copy
    is done). A tensor already there is returned as is."""
    if tensor.device == torch.device(device):
        note_transfer("h2d", blocking=False)
        return tensor
    source = pinned(tensor) if tensor.device.type == "cpu" else tensor
    note_transfer("h2d", blocking=not source.is_pinned())
    with host_only():  # reported above, once
        return source.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` read back to the host: the host waits for the device (a sync)."""
    note_transfer("d2h", blocking=True)
    with host_only():  # reported above, once
        return tensor.cpu()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype flag's value: ``auto`` is bf16 on a GPU (its fast matmuls) and fp32 on the
    CPU (exact, and the only precision the CPU alignment tests hold to 1e-5)."""
    if name == "auto":
        return torch.bfloat16 if is_cuda(device) else torch.float32
    return DTYPES[name]


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors with gloo beside it for host tensors; gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if is_cuda(device) else "gloo"


def empty_cache() -> None:
    """Hand cached, unused accelerator blocks back to the driver (no-op on CPU)."""
    if cuda_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize() -> None:
    """Wait for the work queued on the accelerator by every thread of this process (a
    no-op on CPU, or where CUDA was never used here)."""
    if cuda_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cuda_rng_states() -> list[torch.Tensor] | None:
    """Every CUDA generator's state, or None where CUDA has not been initialized here
    (reading them would initialize CUDA in a process that never used it)."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def set_cuda_rng_states(states: list[torch.Tensor] | None) -> None:
    """Restore ``cuda_rng_states``; a no-op for None or on a machine without CUDA."""
    if states is not None and cuda_available():
        torch.cuda.set_rng_state_all(states)


def has_flash_attn() -> bool:
    """Whether transformers can use flash-attention 2 here (a CUDA device and a usable
    flash-attn package, as transformers itself checks it)."""
    if not cuda_available():
        return False
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


@functools.cache
def attention_kernels() -> frozenset[str]:
    """The varlen attention kernels installed here, by the names
    ``vime.backends.varlen_attention.choose_kernel`` reads: ``torch_varlen`` (torch's
    ``torch.nn.attention.varlen.varlen_attn``, taking a ``scale``) and ``flash_attn``
    (the flash-attn package's ``flash_attn_varlen_func``). Whether they can run here
    (CUDA, a 16-bit dtype) is the chooser's question, not this one's."""
    found = set()
    try:
        from torch.nn.attention.varlen import varlen_attn

        if "scale" in inspect.signature(varlen_attn).parameters:
            found.add("torch_varlen")
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401

        found.add("flash_attn")
    except ImportError:
        pass
    return frozenset(found)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostStash:
    """The storages of some tensors parked in host memory until ``restore``.

    Frees by resizing each storage to zero bytes (as FSDP frees gathered
    parameters), so every tensor object, view, DTensor shard and optimizer
    reference stays valid while the memory is gone; ``restore`` reallocates
    and copies the bytes back, bit for bit. Storages shared by several of the
    tensors are parked once. ``scratch`` tensors hold nothing worth keeping (a
    gradient buffer between steps, all zeros): their memory is freed without a
    host copy and comes back zero-filled. The tensors must not be used until
    ``restore``.
    """

    def __init__(
        self, tensors: Iterable[torch.Tensor], scratch: Iterable[torch.Tensor] = ()
    ) -> None:
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._scratch: list[tuple[torch.UntypedStorage, int]] = []
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            # Pinned host pages make the copies DMA transfers; pinning needs CUDA.
            host = torch.empty(
                storage.nbytes(), dtype=torch.uint8, pin_memory=is_cuda(storage.device)
            )
            host.copy_(_as_bytes(storage))
            self._parked.append((storage, host))
        for tensor in scratch:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            self._scratch.append((storage, storage.nbytes()))
        for storage, _ in [*self._parked, *self._scratch]:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        """Bytes parked in host memory (scratch storages take none)."""
        return sum(host.numel() for _, host in self._parked)

    def restore(self) -> None:
        """Give every parked storage its memory and bytes back, and every scratch storage
        its memory, zero-filled (idempotent)."""
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host)
        for storage, nbytes in self._scratch:
            storage.resize_(nbytes)
            _as_bytes(storage).zero_()
        self._parked, self._scratch = [], []
