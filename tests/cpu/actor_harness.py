"""What the actor tests share: real gloo process groups, their flags and their batches.

``spawn`` runs a job on N fresh processes joined in one gloo group and returns
rank 0's result; ``actor_args`` is the one flag set the fsdp2 and megatron actor
tests train with (KL, entropy and weight decay on, so every term of the loss and
the update is exercised); ``make_batch`` is a seeded random rollout.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from vime.config import parse_args
from vime.data.batch import RolloutBatch
from vime.weights.transports import free_port

VOCAB = 64


def make_batch(rollout_id: int, n: int = 8, nan: bool = False) -> RolloutBatch:
    """``n`` random samples (prompts 2-6, responses 1-9 tokens, ~15 % masked), seeded by id.

    Samples come in pairs that share their prompt, as a rollout's groups do, so the
    fsdp2 backend's rows share prompts wherever a pair lands in one micro-batch.
    """
    rng = random.Random(rollout_id)
    tokens, prompts, masks = [], [], []
    for i in range(n):
        r = rng.randint(1, 9)
        if i % 2 == 0:
            p = rng.randint(2, 6)
            prompt = [rng.randrange(VOCAB) for _ in range(p)]
        tokens.append(prompt + [rng.randrange(VOCAB) for _ in range(r)])
        prompts.append(p)
        masks.append([1 if rng.random() > 0.15 else 0 for _ in range(r)])
    adv = [rng.gauss(0, 1) for _ in range(n)]
    if nan:
        adv[0] = float("nan")
    return RolloutBatch(tokens=tokens, prompt_lengths=prompts, loss_masks=masks, advantages=adv)


def make_multiturn_batch(rollout_id: int, n: int = 8) -> RolloutBatch:
    """``n`` seeded tool-using samples: each response is 2-3 model turns (loss mask 1, 1-4
    tokens) with environment tokens between them (tool answers, chat-template scaffolding:
    mask 0, 1-3 tokens), so every mask has interior holes.

    Sample 3 also ends on environment tokens (a turn cut short); sample ``n - 1`` is all
    environment, excluded from the loss (as a failed reward is). Pairs share their prompt,
    as ``make_batch``'s do.
    """
    rng = random.Random(1000 + rollout_id)
    tokens, prompts, masks = [], [], []
    for i in range(n):
        if i % 2 == 0:
            p = rng.randint(2, 5)
            prompt = [rng.randrange(VOCAB) for _ in range(p)]
        turns = rng.randint(2, 3)
        mask: list[int] = []
        for turn in range(turns):
            mask += [1] * rng.randint(1, 4)
            if turn < turns - 1 or i == 3:
                mask += [0] * rng.randint(1, 3)
        if i == n - 1:
            mask = [0] * len(mask)
        tokens.append(prompt + [rng.randrange(VOCAB) for _ in mask])
        prompts.append(p)
        masks.append(mask)
    adv = [rng.gauss(0, 1) for _ in range(n)]
    return RolloutBatch(tokens=tokens, prompt_lengths=prompts, loss_masks=masks, advantages=adv)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's (or gradient's) whole tensor, gathered (a collective); a plain
    one, the fsdp2 backend's at world size 1, as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def make_schedule(args: Any, rollout_id: int, dp: int, **batch_kw: Any) -> Any:
    """``make_batch(rollout_id)`` planned as ``args`` train it on ``dp`` replicas."""
    from vime.data.batch import schedule

    return schedule(
        make_batch(rollout_id, **batch_kw),
        global_batch_size=args.global_batch_size,
        dp_size=dp,
        micro_batch_size=args.micro_batch_size,
        rollout_id=rollout_id,
    )


def has_interior_hole(mask: list[int]) -> bool:
    """True when a 0 sits between two 1s (an environment run inside the response)."""
    return "0" in "".join(str(int(m)) for m in mask).strip("0")


def actor_args(
    hf: str, world: int, *extra: str, backend: str = "fsdp2", tp: int = 1, pp: int = 1
) -> Any:
    """8 samples a rollout, global batch 4, micro-batches of 2, KL + entropy + decay on."""
    backend_flags = []
    if backend == "megatron":
        backend_flags = ["--megatron-tensor-parallel-size", str(tp)]
        backend_flags += ["--megatron-pipeline-parallel-size", str(pp)]
    flags = {
        "--train-backend": backend,
        "--hf-checkpoint": hf,
        "--actor-num-gpus-per-node": world,
        "--rollout-batch-size": 4,
        "--n-samples-per-prompt": 2,
        "--global-batch-size": 4,
        "--micro-batch-size": 2,
        "--lr": 1e-3,
        "--weight-decay": 0.1,
        "--entropy-coef": 0.01,
        "--kl-loss-coef": 0.1,
        "--kl-loss-type": "k3",
    }
    flat = [str(x) for kv in flags.items() for x in kv]
    return parse_args([*flat, *backend_flags, "--use-kl-loss", *extra])


def _entry(rank: int, world: int, port: int, job: Callable, job_args: tuple, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    result = job(rank, world, *job_args)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running C++ destructors: tearing gloo down while the peer that hosts
    # the store exits can abort the process ("terminate called without an active
    # exception"), which would fail a test whose work had already succeeded.
    os._exit(0)


# What every rank imports, loaded once into the fork server the ranks are forked from: on
# 2 slow cores a fresh interpreter spends 5-15 s importing these, per rank and per run.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "transformers",
    "vime.backends.fsdp2.backend",
    "vime.backends.megatron.backend",
)


def start_method() -> str:
    """``forkserver`` where nothing CUDA could have been touched before the fork; ``spawn``
    on a machine with CUDA (a forked child cannot use a CUDA context its parent made)."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


def _logged(rank: int, log: str, entry: Callable, args: tuple) -> None:
    # A forked rank's stdout and stderr are the fork server's, not the test's: into a file
    # the test process prints once the ranks are done (so pytest captures them as before).
    fd = os.open(f"{log}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    entry(rank, *args)


def start_ranks(entry: Callable, args: tuple, world: int) -> None:
    """``entry(rank, *args)`` on ``world`` fresh processes; raises if any of them fails.
    What the ranks print is printed here, rank by rank, once they are done."""
    method = start_method()
    if method == "spawn":
        mp.start_processes(entry, args=args, nprocs=world, start_method=method)
        return
    # Only before the server first starts (later calls would be ignored); a module
    # missing here (megatron-core not installed) is skipped by the server.
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "rank")
        try:
            mp.start_processes(_logged, args=(log, entry, args), nprocs=world, start_method=method)
        finally:
            for rank in range(world):
                if os.path.exists(f"{log}.{rank}"):
                    sys.stdout.write(Path(f"{log}.{rank}").read_text(errors="replace"))
            sys.stdout.flush()


def spawn(job: Callable, world: int, tmp_path: Path, *job_args: Any) -> Any:
    """Run ``job(rank, world, *job_args)`` on ``world`` gloo processes; rank 0's result.

    ``job`` must be a module-level function (it is pickled by reference) and must
    initialize the default process group (every actor's ``init`` does).
    """
    out = str(tmp_path / f"{job.__name__}_{world}_{random.random()}.pt")
    start_ranks(_entry, (world, free_port(), job, job_args, out), world)
    return torch.load(out, weights_only=False)


def counted_train(backend: str, args: Any, world: int, counter: Any, forward_phase: str) -> dict:
    """An actor trains one rollout (first-call set-up), then the next inside ``counter`` (a
    ``sync_budget.PhasedCounter``), its micro-batch loop's backward passes in phase "rows"
    and its forward-only ones (log-probs) in ``forward_phase``; the rows of each and the
    rollout's optimizer steps."""
    from vime.backends.policy_actor import make_actor
    from vime.config.train_settings import train_settings

    actor = make_actor(backend)
    start = actor.init(train_settings(args))
    actor.train(make_schedule(args, start, world))
    sched = make_schedule(args, start + 1, world)
    rows = {"rows": 0, forward_phase: 0}
    real = actor.backend.forward_backward
    model = actor.backend.model
    head = model.output_layer if backend == "megatron" else model.get_output_embeddings()
    head_rows = []  # hidden-state rows the LM head's own matmul receives
    head.register_forward_hook(lambda m, a, out: head_rows.append(a[0].numel() // a[0].shape[-1]))

    with counter:

        def forward_backward(batch, micro_batches, consume, *, backward):
            phase = "rows" if backward else forward_phase
            rows[phase] += len(micro_batches)
            with counter.phase(phase):
                return real(batch, micro_batches, consume, backward=backward)

        actor.backend.forward_backward = forward_backward
        actor.train(sched)
    return {
        "rows": rows,
        "steps": sched.plan.num_steps,
        "rollout": start + 1,
        "head_rows": sum(head_rows),
    }
