"""The train phase's FLOP count and peak (vime/perf.py).

Proves that the forward count is 2·N·tokens plus causal attention's exact pair count,
that N read from a checkpoint's safetensors headers is the weights torch's own FLOP
counter sees multiplying activations (untied: the input table excluded; tied: the
table counted once, as the head), that the train count is (3 + log-prob passes) ×
forward, that the declared table picks the most specific GPU name, and that the CPU
peak is measured, finite and positive. The start-up clock dates this process's start
from /proc, times its parts as laps, and says which ran in parallel.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny, tiny_qwen3_config
from torch.utils.flop_counter import FlopCounterMode

from vime import perf
from vime.perf import ModelShape


def test_forward_is_matmul_weights_plus_causal_attention_pairs() -> None:
    shape = ModelShape(matmul_params=1000, layers=2, heads=3, head_dim=4)
    lengths = [5, 2]
    # Query i of a sequence scores i keys and mixes i values: 4·h·d·i per layer.
    attention = sum(4 * 3 * 4 * i for s in lengths for i in range(1, s + 1)) * 2
    assert perf.forward_flops(shape, lengths) == 2 * 1000 * 7 + attention
    assert perf.train_flops(shape, lengths) == 3 * perf.forward_flops(shape, lengths)
    assert perf.train_flops(shape, lengths, 2) == 5 * perf.forward_flops(shape, lengths)


@pytest.mark.parametrize("tie", [False, True])
def test_matmul_params_are_what_torch_counts_multiplying(tmp_path: Path, tie: bool) -> None:
    """torch's FLOP counter over a real forward (eager attention: full s×s scores, not
    causal) equals 2·(N - norm weights)·s + 4·L·h·d·s²: N is the checkpoint's weights
    less the embedding lookup, with the tied head counted once."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny(str(tmp_path / "m"), tiny_qwen3_config(tie=tie), seed=0)
    shape = perf.model_shape(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    total = sum(p.numel() for p in model.parameters())  # tied: the table once
    embedding = model.get_input_embeddings().weight.numel()
    assert shape.matmul_params == (total if tie else total - embedding)
    assert (shape.layers, shape.heads, shape.head_dim) == (2, 2, 32)

    s = 11
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=torch.arange(s).unsqueeze(0) % 64)
    full_attention = 4 * shape.layers * shape.heads * shape.head_dim * s * s
    assert counter.get_total_flops() == 2 * (shape.matmul_params - norms) * s + full_attention


def test_mfu_is_flops_over_time_and_peak() -> None:
    assert perf.mfu(6e12, 2.0, 1e13) == pytest.approx(0.3)
    assert math.isnan(perf.mfu(1.0, 0.0, 1e12)) and math.isnan(perf.mfu(1.0, 1.0, 0.0))


@pytest.mark.parametrize(
    ("name", "flops", "label"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12, "declared: H100 SXM bf16"),
        ("NVIDIA H100 PCIe", 756e12, "declared: H100 PCIe bf16"),
        ("NVIDIA H200", 989e12, "declared: H200 bf16"),
        ("NVIDIA A100-SXM4-80GB", 312e12, "declared: A100 bf16"),
        ("NVIDIA L40S", 362e12, "declared: L40S bf16"),
        ("NVIDIA L4", 121e12, "declared: L4 bf16"),
    ],
)
def test_declared_peak_takes_the_most_specific_name(name: str, flops: float, label: str) -> None:
    assert perf.declared_peak(name) == perf.Peak(flops, label)


def test_unknown_devices_have_no_declared_peak_and_the_cpu_is_measured() -> None:
    assert perf.declared_peak("Some Future Accelerator") is None
    peak = perf.rank_peak("cpu")
    assert peak.source.startswith("measured: fp32 matmul on the CPU")
    assert math.isfinite(peak.flops_per_s) and peak.flops_per_s > 0


def test_process_start_time_is_when_the_process_started() -> None:
    """A child process dates its own start between the parent's clock readings around
    spawning it (to a clock tick: 10 ms)."""
    if perf.process_start_time() is None:
        pytest.skip("no /proc here")
    before = time.time()
    child = subprocess.run(
        [sys.executable, "-c", "from vime.perf import process_start_time as p; print(p())"],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time()
    assert before - 0.02 <= float(child.stdout) <= after


def test_startup_parts_are_laps_and_the_line_joins_the_parallel_ones() -> None:
    clock = perf.StartupClock(launched_at=time.time() - 2.0)
    clock.mark("model")
    clock.add("trainer", 3.0)
    clock.add("engines", 2.5)
    clock.together("trainer", "engines")
    clock.together("other", "missing")  # a group of fewer than two parts timed: none
    clock.mark("other")
    startup = clock.done()
    assert list(startup.parts) == ["launch", "model", "trainer", "engines", "other"]
    assert 2.0 <= startup.parts["launch"] <= startup.total_s
    assert startup.parallel == (("trainer", "engines"),)
    # Laps chain: the whole is the laps (the parallel parts here took no real time).
    laps = ("launch", "model", "other")
    assert startup.total_s == pytest.approx(sum(startup.parts[n] for n in laps), abs=0.01)
    line = startup.line()
    assert line.startswith(f"started in {startup.total_s:.1f} s (launch 2.0, model 0.0, ")
    assert "trainer 3.0 and engines 2.5 in parallel, other 0.0)" in line
    assert startup.metrics()["perf/startup_s"] == startup.total_s
    assert startup.metrics()["perf/startup_engines_s"] == 2.5
    assert startup.summary() == {
        "startup_s": startup.total_s,
        "startup_parts_s": startup.parts,
        "startup_parallel": [["trainer", "engines"]],
    }
    # No launch time given: the clock's creation is the origin, and there is no launch part.
    assert "launch" not in perf.StartupClock().done().parts
    assert perf.StartupClock(time.time() + 60).done().total_s < 1.0  # a clock gone wrong
