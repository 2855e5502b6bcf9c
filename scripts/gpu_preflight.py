"""Seconds of checks before the GPU suite (scripts/gpu-check.sh runs this first).

Whether the lent machine's sandbox allows what every later part of the check needs: a
one-rank NCCL process group with an all-reduce (every training rank on a GPU) and CUDA
IPC into another process (the colocated weight sync). One line each; a failure is
printed, not raised, so the suite still runs and the log says which part to suspect.

    PYTHONPATH=. python3 scripts/gpu_preflight.py
"""

from __future__ import annotations

import os
import queue as queue_module
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vime.weights.transports import free_port, open_cuda_bucket, share_cuda_bucket


def nccl() -> str:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    dist.destroy_process_group()
    return f"ok (all-reduce gave {x.sum().item():g}, want 4)"


def _share(queue: Any, done: Any) -> None:
    queue.put(share_cuda_bucket([("w", torch.arange(6.0, device="cuda"))]))
    done.wait(60)  # the memory must outlive the receiver's copy


def cuda_ipc() -> str:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_share, args=(queue, done))
    child.start()
    handles = None
    for _ in range(60):
        try:
            handles = queue.get(timeout=1)
            break
        except queue_module.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the sharing process exited ({child.exitcode})") from None
    if handles is None:
        raise TimeoutError("the sharing process sent no handles in 60 s")
    got = dict(open_cuda_bucket(handles, 0))["w"].clone().cpu()
    done.set()
    child.join(60)
    return "ok" if torch.equal(got, torch.arange(6.0)) else f"WRONG VALUES {got.tolist()}"


CHECKS: dict[str, Callable[[], str]] = {"nccl process group": nccl, "cuda ipc": cuda_ipc}

if __name__ == "__main__":
    print(f"preflight: torch {torch.__version__}, cuda available {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        raise SystemExit("preflight: no CUDA device here, nothing to check")
    for name, check in CHECKS.items():
        try:
            print(f"preflight {name}: {check()}", flush=True)
        except Exception as err:  # the line is the finding
            print(f"preflight {name}: FAILED {type(err).__name__}: {err}", flush=True)
