"""The weight transports' names and what each does: ``--weight-sync``'s choices.

Where it fits: the one list of the transports, as ``vime.rollout.engines.registry`` is of the
engines. The flag parser (``vime.config.flags``) takes ``--weight-sync``'s choices and
the help's account of ``auto`` from here; ``vime.ray.transports`` holds one class per
name (its ``TRANSPORTS``, in this order; a test keeps the two equal) and resolves
``auto`` as ``AUTO_RULE`` says. Light on purpose: no torch, no Ray, nothing of vime's,
as ``vime-train --help`` imports it.

Adding a transport: its name and line here, its class in ``vime.ray.transports``.
"""

from __future__ import annotations

AUTO = "auto"

# Every transport's name and what it does, in the order --weight-sync lists them.
DESCRIPTIONS: dict[str, str] = {
    "object-store": "rank 0 puts each bucket in Ray's object store, the engines fetch them",
    "broadcast": "a process group of its own between rank 0 and the engines, one flat "
    "tensor per dtype per bucket (gloo on the CPU, NCCL on GPUs)",
    "cuda-ipc": "colocated on GPUs: each training rank hands its engine CUDA IPC handles",
    "disk": "an HF safetensors folder the engines reload",
}

# What ``auto`` picks (``vime.ray.transports.weight_transport``).
AUTO_RULE = (
    "cuda-ipc when colocated on GPU, broadcast to one-GPU engines on GPUs of their own, "
    "else object-store"
)


def transport_names() -> tuple[str, ...]:
    """The transports' names, in the order ``--weight-sync`` lists them."""
    return tuple(DESCRIPTIONS)


def weight_sync_choices() -> tuple[str, ...]:
    """What ``--weight-sync`` accepts: ``auto``, then every transport."""
    return (AUTO, *DESCRIPTIONS)
