"""Counting the kernels a training step would launch on a CUDA device.

Where it fits: beside ``sync_budget.py`` (where the host waits for the device) this
counts the other cost of a step that small kernels leave bound by the host: how many
kernels it launches. ``tests/cpu/test_launch_budget.py`` counts one train step of
each backend and of the naive padded HF step (``bench/train_step.py``) per layer per
packed row and per optimizer step, and holds each backend's ratio to the naive step
under a ceiling; it needs no GPU, because on a CPU the same ops dispatch.

The rule: every op that reaches the dispatcher below autograd is one launch, except

- views and other metadata-only ops: an op whose schema returns aliases of its inputs
  that it does not write (``OpOverload.is_view``: view, t, transpose, expand,
  as_strided, detach, alias, slice, select, unsqueeze, squeeze, permute, split, ...),
  ``_unsafe_view`` and ``_reshape_alias`` (views in all but schema), the in-place
  metadata ops (``t_``, ``squeeze_``, ...), allocation without a fill (``empty``,
  ``empty_strided``, ``empty_like``, ``new_empty``, ``resize_``), size queries and the
  profiler's ``record_function`` markers;
- ops run inside ``sync_budget.host_only()``: host tensors by design on a GPU too (a
  packed row's metadata, built from Python lists), and torch.optim's reads of its step
  counters (host tensors unless ``capturable`` or fused).

A composite op (``reshape``, ``linear``) arrives as the ops it decomposes into, which
is what runs. A foreach or fused op counts once: on CUDA it is one kernel per chunk of
tensors, on a CPU a loop inside one op. A collective counts once too. What a counted
op does on a CPU beyond that (a CPU-only fallback) is not seen: the count is of ops.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from vime.sync_budget import PhasedCounter, _from_optimizer_step_counter

aten = torch.ops.aten

# Metadata-only ops that their schemas do not mark as views (names of their packets).
METADATA_OPS = {
    "_unsafe_view",
    "_reshape_alias",
    "t_",
    "transpose_",
    "squeeze_",
    "unsqueeze_",
    "as_strided_",
    "detach_",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "set_",
    "lift_fresh",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
}


def launches(func: Any) -> bool:
    """Whether the dispatched op ``func`` would launch a kernel on CUDA (the module's rule)."""
    if getattr(func, "is_view", False) or getattr(func, "namespace", "") == "profiler":
        return False
    packet = getattr(func, "_overloadpacket", None)
    return getattr(packet, "__name__", str(func)) not in METADATA_OPS


class LaunchCounter(PhasedCounter):
    """Counts, per phase, the kernel-launching ops run inside it, by op name.

    ``with LaunchCounter() as counter:`` then ``with counter.phase("rows"):`` around part
    of the work; ``counter.total(phase)`` is its launches, ``counter.counts[phase]`` the
    ``Counter`` of op names (``top`` the most frequent).
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # torch.optim's reads of its step counters are host tensors' reads on CUDA too.
        host_read = func is aten._local_scalar_dense.default and _from_optimizer_step_counter()
        if launches(func) and not host_read:
            self.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    def top(self, phase: str, n: int = 8) -> list[tuple[str, int]]:
        """The ``n`` ops launched most often in ``phase``."""
        return self.counts.get(phase, Counter()).most_common(n)
