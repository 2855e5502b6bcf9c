"""Model FLOPs and the peak they are measured against: the train phase's MFU.

Where it fits: the driver (``vime.step_timing.StepTiming``) counts the FLOPs of each
rollout's train phase with :func:`train_flops` from the checkpoint's shape
(:func:`model_shape`) and the token lengths it trained; each training rank finds
its peak once at start-up (:func:`rank_peak`). Pure functions, no Ray, no model:
torch is imported only to benchmark.

Model FLOPs (what the model needs, not what a kernel happens to do). For one
sequence of ``s`` tokens through a dense decoder of ``L`` layers with ``h``
attention heads of ``d`` dims and ``N`` matmul parameters::

    forward(s) = 2·N·s  +  2·L·h·d·s·(s + 1)

``2·N·s``: every matmul weight is one multiply-add per token. The second term is
causal attention: query ``i`` (1-based) scores ``i`` keys (``Q·Kᵀ``, ``2·h·d·i``)
and mixes ``i`` values (``A·V``, ``2·h·d·i``); summed over ``i = 1..s`` that is
``4·h·d·s(s+1)/2`` per layer. Backward costs twice the forward, so the train
phase of a rollout whose samples have lengths ``s_j`` (prompt + response: every
token is forwarded and backpropagated, the loss mask only weights the loss) is::

    train_flops = (3 + p) · Σ_j forward(s_j)

where ``p`` is the number of forward-only log-prob passes the ranks ran for that
rollout (the reference model's with a KL loss, the old policy's when a rollout is
trained in several optimizer steps), counted where they run. Each sample counts
whole: where the fsdp2 backend computes a prompt once for the samples that share it
in a row (``vime.data.micro_batch``), the figure is the samples' work, above what
ran, and MFU shows what the sharing saved.

``N`` counts every weight that multiplies activations: all of the checkpoint's
tensors except embedding tables (a lookup costs no FLOPs), plus the output head,
which with tied embeddings is the input table read as a matrix (``vocab·hidden``).
Norm weights are included (``O(hidden)`` per layer against ``O(hidden²)``). For a
mixture-of-experts checkpoint this counts every expert, not the active ones: an
overestimate.

MFU of the train phase::

    mfu = train_flops / (train_time · Σ_ranks peak_rank)

``peak_rank`` is declared for known GPUs (:data:`DECLARED_PEAKS`: dense bf16 tensor
FLOP/s from the vendors' datasheets, no sparsity; a run training in fp32 there is
held to the bf16 peak) and otherwise measured at start-up by
:func:`measure_matmul_flops`: the best rate of a square matmul on the rank's own
device and threads (fp32 on the CPU, bf16 on an unknown GPU), with the other ranks
measuring at the same time, as they train.

Start-up (:class:`StartupClock`): the wall time from the ``vime-train`` process's start
(:func:`process_start_time`) to the start of the first rollout, with the parts it
took (imports, model, Ray, training ranks, engines, ...); the training ranks and the
engines start at the same time unless ``--colocate`` makes them take turns.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (substring of the device name, dense bf16 FLOP/s, label). More specific names first:
# "H100 PCIe" must win over "H100".
DECLARED_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756e12, "H100 PCIe bf16"),
    ("H100 NVL", 835e12, "H100 NVL bf16"),
    ("H100", 989e12, "H100 SXM bf16"),
    ("GH200", 989e12, "GH200 bf16"),
    ("H200", 989e12, "H200 bf16"),
    ("B200", 2250e12, "B200 bf16"),
    ("A100", 312e12, "A100 bf16"),
    ("L40S", 362e12, "L40S bf16"),
    ("L4", 121e12, "L4 bf16"),
    ("MI300X", 1307e12, "MI300X bf16"),
)

_EMBEDDING_MARKERS = ("embed", "wte", "wpe")


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a dense decoder (see the module docstring)."""

    matmul_params: int
    layers: int
    heads: int
    head_dim: int


@dataclass(frozen=True)
class Peak:
    """One rank's peak FLOP/s and where it comes from (``declared: ...``/``measured: ...``)."""

    flops_per_s: float
    source: str


def forward_flops(shape: ModelShape, lengths: Sequence[int]) -> float:
    """``Σ_j 2·N·s_j + 2·L·h·d·s_j·(s_j + 1)``: one forward pass over sequences of ``lengths``."""
    tokens = sum(lengths)
    pairs = sum(s * (s + 1) for s in lengths)
    attention = 2 * shape.layers * shape.heads * shape.head_dim * pairs
    return float(2 * shape.matmul_params * tokens + attention)


def train_flops(shape: ModelShape, lengths: Sequence[int], log_prob_passes: int = 0) -> float:
    """``(3 + log_prob_passes) · forward_flops``: forward + backward of every sequence, plus
    the forward-only log-prob passes run for the same batch."""
    return (3 + log_prob_passes) * forward_flops(shape, lengths)


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """``flops / (seconds · peak)``; NaN when either is not positive."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        return math.nan
    return flops / (seconds * peak_flops_per_s)


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's JSON header (no data read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: meta["shape"] for name, meta in header.items() if name != "__metadata__"}


def model_shape(checkpoint: str) -> ModelShape:
    """The ``ModelShape`` of an HF checkpoint folder: the architecture from ``config.json``,
    ``N`` from the safetensors headers (see the module docstring)."""
    folder = Path(checkpoint)
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config  # multimodal: the language model's part
    shapes: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        shapes.update(safetensors_shapes(path))
    params = 0
    for name, shape in shapes.items():
        if not any(marker in name for marker in _EMBEDDING_MARKERS):
            params += math.prod(shape)
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    if config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)):
        params += int(text["vocab_size"]) * hidden  # the head: the input table as a matrix
    return ModelShape(
        matmul_params=params,
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        head_dim=int(text.get("head_dim") or hidden // heads),
    )


def declared_peak(device_name: str) -> Peak | None:
    """The table's peak for a device named ``device_name`` (as CUDA names it), or None."""
    for marker, flops, label in DECLARED_PEAKS:
        if marker.lower() in device_name.lower():
            return Peak(flops, f"declared: {label}")
    return None


def measure_matmul_flops(
    device: Any = "cpu", dtype: Any = None, size: int = 512, min_seconds: float = 0.2
) -> float:
    """The best FLOP/s of an ``size``×``size`` matmul (``2·size³`` FLOPs) over repeats that
    take at least ``min_seconds`` together (and at least three), after one warm-up, on
    ``device`` with this process's torch threads; ``dtype`` defaults to fp32."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    cuda = torch.device(device).type == "cuda"
    torch.mm(a, b)
    best, spent, repeats = math.inf, 0.0, 0
    while repeats < 3 or spent < min_seconds:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        best, spent, repeats = min(best, took), spent + took, repeats + 1
    return 2 * size**3 / best


def rank_peak(device: Any) -> Peak:
    """A training rank's peak: declared for a known GPU, else measured on its device
    (fp32 on the CPU with the rank's threads, bf16 on an unknown GPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        declared = declared_peak(name)
        if declared is not None:
            return declared
        flops = measure_matmul_flops(device, torch.bfloat16, size=4096)
        return Peak(flops, f"measured: bf16 matmul on {name}")
    threads = torch.get_num_threads()
    flops = measure_matmul_flops(device, torch.float32)
    return Peak(flops, f"measured: fp32 matmul on the CPU, {threads} thread(s) per rank")


def process_start_time() -> float | None:
    """When this process started, as a ``time.time()`` value, or None where ``/proc`` does
    not say (not Linux). Its age is the system's uptime less the process's start time in
    clock ticks after boot (``/proc/self/stat`` field 22): exact to a tick (10 ms)."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: fields 3 on follow its ")".
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - age if age >= 0 else None


@dataclass(frozen=True)
class Startup:
    """A run's start-up: ``total_s`` from launch to the first rollout, and the seconds of
    its ``parts`` in the order they began; each group of ``parallel`` names parts that
    ran at the same time (so the parts may add up to more than the whole, never one
    part: the longest of a group and the parts outside groups add up to at most it)."""

    total_s: float
    parts: dict[str, float]
    parallel: tuple[tuple[str, ...], ...] = ()

    def line(self) -> str:
        """``started in 7.9 s (launch 1.1, ..., trainer 3.1 and engines 2.9 in parallel)``"""
        shown: list[str] = []
        for name, seconds in self.parts.items():
            group = next((g for g in self.parallel if name in g), None)
            if group is None:
                shown.append(f"{name} {seconds:.1f}")
            elif name == group[0]:
                together = " and ".join(f"{n} {self.parts[n]:.1f}" for n in group)
                shown.append(f"{together} in parallel")
        return f"started in {self.total_s:.1f} s ({', '.join(shown)})"

    def metrics(self) -> dict[str, float]:
        """``perf/startup_s`` and ``perf/startup_<part>_s``: the first rollout's line."""
        out = {"perf/startup_s": self.total_s}
        out.update({f"perf/startup_{name}_s": s for name, s in self.parts.items()})
        return out

    def summary(self) -> dict[str, object]:
        """summary.json's: ``startup_s``, ``startup_parts_s`` ({part: seconds}) and
        ``startup_parallel`` (the groups of parts that ran at the same time)."""
        return {
            "startup_s": self.total_s,
            "startup_parts_s": dict(self.parts),
            "startup_parallel": [list(group) for group in self.parallel],
        }


class StartupClock:
    """Times a run's start-up from ``launched_at`` (a ``time.time()`` value: the
    process's start, see :func:`process_start_time`) or, without it, from the clock's
    creation; with it, the time until the clock is made is the part ``launch`` (the
    interpreter, the imports, the flags). Parts are laps between marks (``mark``) or
    timed elsewhere (``add``); ``together`` says which ran at the same time."""

    def __init__(self, launched_at: float | None = None) -> None:
        now = time.time()
        self.launched_at = now if launched_at is None or launched_at > now else launched_at
        self.parts: dict[str, float] = {}
        self.parallel: list[tuple[str, ...]] = []
        self._mark = now
        if launched_at is not None:
            self.add("launch", now - self.launched_at)

    def lap(self) -> float:
        """Seconds since the last mark (or the clock's creation); the mark moves to now."""
        now = time.time()
        seconds, self._mark = now - self._mark, now
        return seconds

    def mark(self, name: str) -> None:
        """Part ``name`` took the time since the last mark (added to what it had)."""
        self.add(name, self.lap())

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + max(0.0, seconds)

    def together(self, *names: str) -> None:
        """Parts ``names`` (timed with ``add``) ran at the same time; the mark moves to
        now, their end."""
        self.parallel.append(names)
        self.lap()

    def done(self) -> Startup:
        """The start-up until now (the first rollout starts)."""
        groups = (tuple(n for n in group if n in self.parts) for group in self.parallel)
        parallel = tuple(group for group in groups if len(group) > 1)
        return Startup(time.time() - self.launched_at, dict(self.parts), parallel)
