"""The megatron backend's checkpoint tensors, through megatron-core's ``dist_checkpointing``.

Where it fits: ``MegatronBackend`` writes these into the folder that
``vime.checkpoint`` hands every rank (``PolicyTrainActor.save`` commits it) and
reads them back on ``--load``. What goes in is megatron-core's own description of
the model, ``GPTModel.sharded_state_dict()``: every parameter as a ``ShardedTensor``
(or ``ShardedTensorFactory``) placed in a global tensor whose layout does not depend
on the TP size -- TP shards at their offsets, the fused QKV split per query group,
swiglu's ``linear_fc1`` split into its gate and up halves by a factory, the layers
stacked on a prepended axis, the vocab-padded embedding and output layer marked
``allow_shape_mismatch`` -- and TP-replicated tensors saved by one replica only. A
load at another TP size is therefore megatron-core's own re-split.

Without ``--megatron-use-distributed-optimizer`` the optimizer is torch ``AdamW``; its moments have
their parameter's shape and sharding, so each is saved as a copy of its parameter's
sharded entry with the moment as data and the key prefixed ``optimizer.<moment>.``
(megatron-core's ``make_sharded_optimizer_tensor``, what its own optimizers do). The
step count is one number shared by every parameter and rank: common state
(``common.pt``, written by rank 0). A never-stepped AdamW has no state and saves none.
megatron-core's distributed optimizer (``distrib_optim``) describes its own state
(``dp_reshardable``: main weights, moments and step of each rank's buffer slice),
which goes under the same ``optimizer`` key. ``check_resumable`` refuses, by name,
what a run cannot load (another weight dtype, layer implementation or optimizer).

Vocab padding: the padded vocabulary grows with TP (64 tokens -> 128 rows at TP=1,
256 at TP=2). For an ``allow_shape_mismatch`` tensor megatron-core zeroes the target
and reads only the rows the checkpoint and the target share, so real rows load
bitwise and padding rows come back zero -- what they hold anyway: the logits beyond
the HF vocabulary are dropped, so padding rows get no gradient, no moment and no
update (weight decay of zero is zero).
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from vime.backends.megatron.distrib_optim import DistributedOptimizer
from vime.checkpoint import CheckpointError

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_WEIGHT = "main_param"  # fp32 main weights of a bf16 model
NamedParams = list[tuple[str, torch.nn.Parameter]]


def check_resumable(folder: Path, saved: dict[str, Any], run: dict[str, Any]) -> None:
    """Refuse a checkpoint this run cannot resume, naming the flag to change.

    ``saved`` is the checkpoint's ``extra`` (what ``MegatronBackend.checkpoint_extra``
    wrote, with its ``counters``), ``run`` the same fields of this run. The weights must
    have this run's dtype and layer implementation (``transformer_engine`` fuses norms
    into other tensors). The optimizer state of megatron-core's distributed optimizer
    and torch AdamW's differ in layout, and the former re-splits only over DP. A
    never-stepped checkpoint holds no optimizer state, so it loads under either.
    """
    saved_dtype = saved.get("param_dtype", str(torch.float32))
    if saved_dtype != run["param_dtype"]:
        raise CheckpointError(
            f"{folder} holds {saved_dtype} weights and this run trains in "
            f"{run['param_dtype']}; resume with the same --megatron-param-dtype"
        )
    saved_impl = saved.get("transformer_impl", "local")  # older checkpoints: local
    if saved_impl != run["transformer_impl"]:
        raise CheckpointError(
            f"{folder} was saved with --megatron-transformer-impl {saved_impl}; resume with "
            "the same (or start from an HF export: --save-hf, then --hf-checkpoint)"
        )
    if saved["counters"]["optimizer_steps"] == 0:
        return
    distributed = bool(saved.get("distributed_optimizer", False))
    if distributed != run["distributed_optimizer"]:
        which = "with" if distributed else "without"
        raise CheckpointError(
            f"{folder} holds the optimizer state of a run {which} "
            f"--megatron-use-distributed-optimizer; resume {which} it (or start from an "
            "HF export: --save-hf, then --hf-checkpoint)"
        )
    layout = (saved.get("tp"), saved.get("pp", 1))
    if distributed and layout != (run["tp"], run["pp"]):
        raise CheckpointError(
            f"{folder} holds a distributed-optimizer state saved at TP={layout[0]}, "
            f"PP={layout[1]}; it loads at another DP size but not at "
            f"TP={run['tp']}, PP={run['pp']}"
        )


def sharded_state(
    model: torch.nn.Module,
    optimized: NamedParams,
    optimizer: torch.optim.Optimizer | DistributedOptimizer,
    *,
    with_optimizer: bool,
    main_weights: bool = False,
    is_loading: bool = False,
) -> dict[str, Any]:
    """This rank's sharded state dict: the model's, plus the AdamW moments and step.

    ``optimized`` are the parameters whose AdamW state this rank holds. ``with_optimizer``
    needs a populated ``optimizer.state`` for each of them (real moments to save, or
    templates of the right shapes to load into). ``main_weights``: the optimized
    tensors are fp32 main copies of bf16 model weights, saved beside the moments as
    ``optimizer.main_param.<key>`` (the bf16 model weights alone would lose their low bits).
    A ``DistributedOptimizer`` describes its own state (``is_loading`` as megatron-core
    wants it said).
    """
    model_state = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_state}
    if with_optimizer and isinstance(optimizer, DistributedOptimizer):
        state["optimizer"] = optimizer.sharded_state(model_state, is_loading=is_loading)
    elif with_optimizer:
        tensors_of = {m: lambda p, m=m: optimizer.state[p][m] for m in ADAM_MOMENTS}
        if main_weights:
            tensors_of[MAIN_WEIGHT] = lambda p: p
        optim: dict[str, Any] = {
            kind: {
                name: make_sharded_optimizer_tensor(
                    model_state[name],
                    tensor_of(param),
                    f"optimizer.{kind}",
                )
                for name, param in optimized
            }
            for kind, tensor_of in tensors_of.items()
        }
        # Common state: one value, the same on every rank (dist_checkpointing checks that).
        optim["step"] = optimizer.state[optimized[0][1]]["step"].detach().clone()
        state["optimizer"] = optim
    return state


def save(state: dict[str, Any], folder: Path, dp_group: Any = None) -> None:
    """Write ``sharded_state``'s dict into ``folder`` (a collective over every rank).

    Synchronous, with megatron-core's default ``torch_dist`` strategy (its writer
    forks one process per file and collects their results), under
    ``in_process_results_queue``. Over a data-parallel group of more than one rank
    the save is fully parallel: a tensor every replica holds is written by one of
    them, chosen to even out the bytes each writes, instead of always by replica 0
    (``FullyParallelSaveStrategyWrapper``; only metadata is exchanged).
    """
    _check_writer_can_start()
    strategy = get_default_save_sharded_strategy()
    if _size(dp_group) > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, dp_group)
    with in_process_results_queue():
        dist_checkpointing.save(state, str(folder), sharded_strategy=strategy)


def _check_writer_can_start() -> None:
    """megatron-core's writer processes measure their memory with psutil, which
    megatron-core does not require: without it each dies at start and the save waits for
    them forever. Fail at once instead, saying what to install."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        raise CheckpointError(
            "megatron-core's checkpoint writer needs psutil: pip install psutil "
            "(or install vime with its megatron extra)"
        )


def _size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


@contextlib.contextmanager
def in_process_results_queue() -> Iterator[None]:
    """Give megatron-core's checkpoint writer a plain in-process results queue.

    ``FileSystemWriterAsync.prepare_write_data`` (``strategies/filesystem_async.py``)
    takes its results queue from ``_get_write_results_queue()``, which on first use
    starts a ``multiprocessing`` *Manager* server (a spawned Python process) and keeps
    it for the life of the process. Only a normal interpreter exit stops it: a rank
    that ends with ``os._exit`` or a signal leaves it orphaned, one per rank that ever
    saved. A synchronous save (``AsyncRequest.execute_sync``) runs the writer in this
    process and only ``put``s and ``get_nowait``s the queue here, so an in-process
    queue does the same job without the extra process (and without its seconds of
    start-up). Installed only for the duration of the save and only where megatron-core
    has not made its own queue yet, so an asynchronous save elsewhere is unaffected.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError(
            "megatron-core moved filesystem_async._results_queue; revisit "
            "vime.backends.megatron.checkpoint.in_process_results_queue"
        )
    if filesystem_async._results_queue is not None:  # megatron-core's own, already running
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def load(
    model: torch.nn.Module,
    optimized: NamedParams,
    optimizer: torch.optim.Optimizer | DistributedOptimizer,
    folder: Path,
    *,
    with_optimizer: bool,
    main_weights: bool = False,
) -> None:
    """Restore weights (and the AdamW moments of ``optimized`` and the step) from
    ``folder`` at this rank's TP shard and pipeline stage (``main_weights`` as for
    ``sharded_state``; the caller sets the main weights of a never-stepped checkpoint,
    which has none, from the model).

    A collective over every rank. Strict both ways: a tensor the ranks expect but the
    checkpoint lacks, or one the checkpoint has but no rank reads, is an error.
    Each replica reads what it needs itself: megatron-core's fully parallel load (each
    reads a share, then they exchange) allocates its exchange buffers on CUDA by literal,
    and a resume is once a run, a save every ``--save-interval``.
    """
    distributed = isinstance(optimizer, DistributedOptimizer)
    if with_optimizer and not distributed:  # templates for the moments (right shapes)
        for _, param in optimized:
            optimizer.state[param] = {m: torch.zeros_like(param) for m in ADAM_MOMENTS}
            optimizer.state[param]["step"] = torch.zeros((), dtype=torch.float32)
    state = sharded_state(
        model,
        optimized,
        optimizer,
        with_optimizer=with_optimizer,
        main_weights=main_weights,
        is_loading=True,
    )
    loaded = dist_checkpointing.load(state, str(folder), strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    if with_optimizer and distributed:
        optimizer.load_state(loaded["optimizer"])
    elif with_optimizer:
        optim = loaded["optimizer"]
        if main_weights:
            with torch.no_grad():
                for name, param in optimized:
                    param.copy_(optim[MAIN_WEIGHT][name])
        for name, param in optimized:
            optimizer.state[param] = {
                "step": optim["step"].clone(),
                **{m: optim[m][name].contiguous() for m in ADAM_MOMENTS},
            }


def is_dist_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a megatron-core ``dist_checkpointing`` checkpoint."""
    return dist_checkpointing.check_is_distributed_checkpoint(str(folder))
