"""Weighted metric reduction across micro-batches and data-parallel ranks.

Where it fits: a backend's ``train`` adds each micro-batch's metrics
(clipfrac, ppo_kl, entropy, ...) to one :class:`MetricAccumulator`, then sums it
over ranks with :meth:`MetricAccumulator.all_reduce` (or all-reduces
``to_tensor()`` itself where every rank is known to hold the same names). Every metric is kept as
(weighted sum, total weight) rather than as a mean, so averaging over a ragged
last micro-batch or an uneven DP split weights each token (or sample) once:
the mean of means of unequal parts is not the mean of the whole.

Sums are float64 tensors kept on the device of the values, so adding a
micro-batch never forces a device sync; only ``means()`` reads them back.
A metric may instead be a maximum (``add_max``): merged and reduced by max,
reported as is.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from vime.device import to_host
from vime.sync_budget import host_only

Number = float | int | torch.Tensor


class MetricAccumulator:
    """Per metric name, a weighted sum S and a weight W; the reported mean is S / W.

    - ``add_tokens(name, v[B, T], m)``: S += Σ v·m,  W += Σ m      (token-weighted)
    - ``add_samples(name, v[B], w)``:  S += Σ v·w,  W += Σ w      (w defaults to 1)
    - ``add(name, total, weight)``:    S += total,  W += weight
    - ``add_max(name, v[B, T], m)``: M = max(M, max of v where m > 0)
    - ``merge(other)``: adds other's S and W name by name, and takes the larger M.

    A name whose total weight is 0 (e.g. only empty masks were added), or a maximum
    over nothing, is omitted from ``means()``: "no data" is not a measured 0.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._maxes: dict[str, torch.Tensor] = {}  # -inf: nothing measured yet
        self._on_host = False  # built on the host (``all_reduce``'s): reading it waits for nothing
        self._device_names: set[str] = set()  # names given a tensor (else host floats only)

    def add(self, name: str, total: Number, weight: Number) -> None:
        """S[name] += total, W[name] += weight."""
        if isinstance(total, torch.Tensor):
            self._device_names.add(name)
        device = total.device if isinstance(total, torch.Tensor) else None
        total = torch.as_tensor(total, dtype=torch.float64, device=device).detach()
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().to(torch.float64).to(total.device)
        else:  # filled on the device: a number copied there would be a blocking copy
            weight = torch.full((), float(weight), dtype=torch.float64, device=total.device)
        if name in self._sums:
            self._sums[name] = self._sums[name] + total.to(self._sums[name].device)
            self._weights[name] = self._weights[name] + weight.to(self._weights[name].device)
        else:
            self._sums[name] = total
            self._weights[name] = weight

    def add_tokens(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Token-weighted: S += Σ v·m, W += Σ m over a ``[B, T]`` batch."""
        if values.shape != mask.shape:
            raise ValueError(
                f"values and mask shapes differ: {tuple(values.shape)} vs {tuple(mask.shape)}"
            )
        m = mask.detach().to(torch.float64)
        # where, not v·m: a NaN at a padded position must not poison the sum.
        v = torch.where(m > 0, values.detach().to(torch.float64), 0.0)
        self.add(name, (v * m).sum(), m.sum())

    def add_max(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """M[name] = max(M[name], max of ``values`` where ``mask`` > 0) over ``[B, T]``."""
        if values.shape != mask.shape:
            raise ValueError(
                f"values and mask shapes differ: {tuple(values.shape)} vs {tuple(mask.shape)}"
            )
        kept = torch.where(mask.detach() > 0, values.detach().to(torch.float64), float("-inf"))
        # amax of an empty tensor raises: an empty batch measured nothing, which is -inf.
        self._merge_max(name, kept.amax() if kept.numel() else torch.tensor(float("-inf")))

    def _merge_max(self, name: str, value: torch.Tensor) -> None:
        if name in self._maxes:
            old = self._maxes[name]
            self._maxes[name] = torch.maximum(old, value.to(old.device))
        else:
            self._maxes[name] = value.detach().to(torch.float64)

    def add_samples(
        self, name: str, values: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        """Sample-weighted: S += Σ v·w, W += Σ w over a ``[B]`` batch (w = 1 if None)."""
        v = values.detach().to(torch.float64).reshape(-1)
        if weights is None:
            self.add(name, v.sum(), float(v.numel()))
            return
        w = weights.detach().to(torch.float64).reshape(-1)
        if w.shape != v.shape:
            raise ValueError(f"values and weights sizes differ: {v.numel()} vs {w.numel()}")
        self.add(name, (v * w).sum(), w.sum())

    def merge(self, other: MetricAccumulator) -> MetricAccumulator:
        """Add every (S, W) of ``other`` into this one; returns self."""
        for name in other._sums:
            on_device = name in other._device_names or name in self._device_names
            self.add(name, other._sums[name], other._weights[name])
            if not on_device:
                self._device_names.discard(name)
        for name, value in other._maxes.items():
            self._merge_max(name, value)
        return self

    def names(self) -> list[str]:
        """The weighted-mean names (``to_tensor``'s layout); maxima are not among them."""
        return sorted(self._sums)

    def means(self, empty: float | None = None) -> dict[str, float]:
        """{name: S / W} as Python floats; a name with W == 0 (nothing was measured: every
        mask empty, every step skipped) is left out, or given ``empty`` when that is set."""
        with host_only() if self._on_host else nullcontext():
            return self._means(empty)

    def _means(self, empty: float | None) -> dict[str, float]:
        names, packed = self.to_tensor(device="cpu")
        k = len(names)
        sums, weights = packed[:k].tolist(), packed[k:].tolist()
        out = {}
        for name, s, w in zip(names, sums, weights, strict=True):
            if w != 0:
                out[name] = s / w
            elif empty is not None:
                out[name] = empty
        for name, value in sorted(self._maxes.items()):
            top = float(value)
            if top != float("-inf"):
                out[name] = top
            elif empty is not None:
                out[name] = empty
        return out

    def to_tensor(self, device: torch.device | str | None = None) -> tuple[list[str], torch.Tensor]:
        """Pack as ``(names, t)``, names sorted, t = [S₀ … S_{N−1}, W₀ … W_{N−1}] float64.

        ``all_reduce(t, SUM)`` over ranks then :meth:`from_tensor` gives the
        global accumulator of the weighted means (maxima are not in it: ``all_reduce``
        reduces those). Every rank must hold the same names (the same code
        path adds the same metrics; an empty mask still registers its name).
        ``device`` defaults to the device of the first metric (CPU if none).
        """
        names = self.names()
        if device is None:
            device = self._sums[names[0]].device if names else "cpu"
        if not names:
            return names, torch.zeros(0, dtype=torch.float64, device=device)
        sums = [self._sums[n].to(device) for n in names]
        weights = [self._weights[n].to(device) for n in names]
        return names, torch.stack(sums + weights)

    def all_reduce(self, group: object = None) -> MetricAccumulator:
        """The sum of every rank's accumulator over ``group`` (a collective: all its ranks
        call it); self is unchanged.

        Ranks may hold different names -- a pipeline stage that does not compute the
        loss holds none of the loss's metrics -- so the names are gathered first and a
        name a rank lacks counts as (0, 0) there. The sum is taken on host tensors on
        every rank (vime's groups have gloo beside NCCL): the group picks its backend by
        the tensor's device, and a stage whose metrics are all host floats would
        otherwise enter gloo while a stage with device metrics entered NCCL, and hang.
        """
        import torch.distributed as dist

        gathered: list[tuple[list[str], list[str]] | None] = [None] * dist.get_world_size(group)
        # Object collectives run on the group's host backend (gloo beside NCCL): no device.
        with host_only():
            dist.all_gather_object(gathered, (self.names(), sorted(self._maxes)), group=group)
        names = sorted({name for part in gathered if part for name in part[0]})
        max_names = sorted({name for part in gathered if part for name in part[1]})
        local = self._stacked(names, max_names)
        with host_only():  # one read from the device above; host tensors from here on
            k = 2 * len(names)
            sums, tops = local[:k].clone(), local[k:].clone()
            out = MetricAccumulator()
            if names:
                dist.all_reduce(sums, group=group)
                out = MetricAccumulator.from_tensor(names, sums)
            if max_names:
                dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
                for name, top in zip(max_names, tops, strict=True):
                    out._merge_max(name, top.clone())
        out._on_host = True
        return out

    def _stacked(self, names: list[str], max_names: list[str]) -> torch.Tensor:
        """``[S(names)…, W(names)…, M(max_names)…]`` float64 on the host: the values given
        as tensors (on the device) read back in one copy, those given as Python numbers
        already on the host; a name this rank lacks is (0, 0) and a maximum -inf."""
        zero = torch.zeros((), dtype=torch.float64)
        low = torch.full((), float("-inf"), dtype=torch.float64)
        parts = [(n, self._sums.get(n, zero)) for n in names]
        parts += [(n, self._weights.get(n, zero)) for n in names]
        parts += [(n, self._maxes.get(n, low)) for n in max_names]
        read = [i for i, (n, _) in enumerate(parts) if n in self._device_names or n in self._maxes]
        values = [value for _, value in parts]
        if read:
            host = to_host(torch.stack([values[i] for i in read]))
            for j, i in enumerate(read):
                values[i] = host[j]
        with host_only():
            return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, names: list[str], tensor: torch.Tensor) -> MetricAccumulator:
        """Inverse of :meth:`to_tensor` (after any summing of the tensor)."""
        if tensor.dim() != 1 or tensor.numel() != 2 * len(names):
            raise ValueError(
                f"expected a 1-D tensor of 2·{len(names)} values; got shape {tuple(tensor.shape)}"
            )
        acc = cls()
        tensor = tensor.detach().to(torch.float64).clone()  # own storage, not the caller's buffer
        k = len(names)
        for i, name in enumerate(names):
            acc.add(name, tensor[i], tensor[k + i])
        return acc
