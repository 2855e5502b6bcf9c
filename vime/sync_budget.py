"""Counting the ops of a training step that would make the host wait for a CUDA device.

Where it fits: beside ``profiling.py`` (where time goes) this says why the host may
stall: every op that reads a device value back (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``), sizes an output by its data (``nonzero``, ``masked_select``, ``unique``,
indexing with a boolean mask) or copies between host and device without
``non_blocking``. ``tests/cpu/test_sync_budget.py`` runs a real step of each backend
under a ``SyncCounter`` and holds the budget (none per packed row, at most two per
optimizer step); it needs no GPU, because on a CPU the same ops run.

On a CPU there is one device, so a copy between host and device cannot be seen by
its tensors' devices: vime moves tensors across through ``vime.device.to_device`` and
``vime.device.to_host``, which report here (``note_transfer``). Code that touches
host tensors only, by design and on a GPU too (packing a row from Python lists), runs
inside ``host_only()``, where nothing is counted. torch's optimizers read their step
counters with ``.item()``; those live on the host unless ``capturable``, so reads
from ``torch.optim``'s ``_get_value`` are not counted either.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose output size or value the host must wait for, whatever their arguments.
SYNC_OPS = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.nonzero_static.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.is_nonzero.default: "item",
}
# Ops that sync only when indexed by a boolean mask (their output size is its count).
MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}

_state = threading.local()


def _counters() -> list[SyncCounter]:
    if not hasattr(_state, "counters"):
        _state.counters, _state.host_depth = [], 0
    return _state.counters


@contextmanager
def host_only() -> Iterator[None]:
    """Code inside touches host tensors only (on a GPU too): no op of it is counted."""
    _counters()
    _state.host_depth += 1
    try:
        yield
    finally:
        _state.host_depth -= 1


def note_transfer(direction: str, blocking: bool) -> None:
    """``vime.device``'s report of one host<->device copy (``"h2d"`` or ``"d2h"``);
    a blocking one is a sync."""
    if blocking:
        for counter in _counters():
            counter.record(f"{direction} copy")


def _from_optimizer_step_counter() -> bool:
    """Whether the op is ``torch.optim``'s read of a (host) step counter."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_get_value" and "torch/optim" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (indices or ())
        if i is not None
    )


def _crosses_devices(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy between two devices that ``vime.device`` did not make (CUDA only)."""
    if func is aten._to_copy.default and "device" in kwargs:
        return torch.device(kwargs["device"]) != args[0].device and not kwargs.get("non_blocking")
    if func is aten.copy_.default:
        return args[0].device != args[1].device and not (args[2] if len(args) > 2 else False)
    return False


def in_host_only() -> bool:
    """Whether the caller runs inside ``host_only()``."""
    return bool(getattr(_state, "host_depth", 0))


class PhasedCounter(TorchDispatchMode):
    """A dispatch mode that counts, per phase, what its subclass records.

    ``with counter.phase("row"):`` around part of the work; ``counter.counts[phase]`` is a
    ``Counter`` of kinds and ``counter.total(phase)`` their sum (outside any phase:
    ``"other"``). Nothing is recorded inside ``host_only()``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter[str]] = {}
        self._phase = ["other"]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase.append(name)
        try:
            yield
        finally:
            self._phase.pop()

    def total(self, phase: str) -> int:
        return sum(self.counts.get(phase, Counter()).values())

    def add(self, kind: str) -> bool:
        """Count one ``kind`` in the current phase; False (nothing counted) in ``host_only``."""
        if in_host_only():
            return False
        self.counts.setdefault(self._phase[-1], Counter())[kind] += 1
        return True


class SyncCounter(PhasedCounter):
    """Counts, per phase, the ops run inside it that would sync on CUDA.

    ``with SyncCounter() as counter:`` then ``with counter.phase("row"):`` around part of
    the work (``PhasedCounter``). ``counter.sites`` keeps, per kind, the innermost vime
    frames that ran it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[tuple[str, str]] = Counter()
        self._tolist = torch.Tensor.tolist

    def record(self, kind: str) -> None:
        if self.add(kind):
            self.sites[(kind, _vime_site())] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = SYNC_OPS.get(func)
        if kind is None and func in MASK_INDEX_OPS and _has_bool_index(args):
            kind = "bool index"
        if kind is None and _crosses_devices(func, args, kwargs):
            kind = "copy"
        if kind is not None and not (kind == "item" and _from_optimizer_step_counter()):
            self.record(kind)
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        _counters().append(self)
        counter = self

        def tolist(tensor: torch.Tensor) -> Any:
            # Read on the host without an aten op on a CPU; a device read on CUDA.
            counter.record("tolist")
            return counter._tolist(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        _counters().remove(self)
        return super().__exit__(*exc)


def _vime_site() -> str:
    """``file:line function`` of the innermost vime frame on the stack (or ``?``), after
    the innermost library frame outside torch where that is not vime's."""
    frame, library = sys._getframe(2), ""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/vime/" in name and not name.endswith(
            ("sync_budget.py", "launch_budget.py", "vime/device.py")
        ):
            site = f"{name.rsplit('/vime/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}"
            return f"{site} < {library}" if library else site
        if not library and "site-packages/" in name and "/torch/" not in name:
            library = f"{name.rsplit('site-packages/', 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
