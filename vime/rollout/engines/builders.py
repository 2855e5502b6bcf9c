"""Engine builders: the run's engine options mapped onto each engine's constructor.

Where it fits: ``vime.rollout.engines.registry`` names one builder per engine
(``EngineSpec.builder``); ``vime.ray.engines.EngineActor`` calls it in the engine's
own process with the checkpoint folder and the run's ``EngineOptions``
(``vime.rollout.engines.registry``; the builders read ``tensor_parallel_size``, ``seed``,
``max_model_len``, ``gpu_memory_utilization`` and ``max_lora_rank``). Each builder
imports its engine only when called, and reads what it needs from the checkpoint's
config.json (the dtype it was saved in, its context window).

A new engine's builder goes here: ``(checkpoint, EngineOptions) -> RolloutEngine``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.rollout.engines.registry import EngineOptions


def build_hf(checkpoint: str, options: EngineOptions) -> Any:
    """The transformers engine, on the GPU where there is one (``hf_engine_dtype``)."""
    import torch

    from vime.rollout.engines.hf import HFEngine

    cuda = torch.cuda.is_available()
    return HFEngine(
        checkpoint,
        device="cuda" if cuda else "cpu",
        dtype=hf_engine_dtype(checkpoint_config(checkpoint), cuda=cuda),
    )


def build_vllm(checkpoint: str, options: EngineOptions) -> Any:
    """vLLM, in the checkpoint's dtype, with the run's context (``engine_max_model_len``)."""
    from vime.rollout.engines.vllm import VLLMEngine

    config = checkpoint_config(checkpoint)
    return VLLMEngine(
        checkpoint,
        tensor_parallel_size=options.tensor_parallel_size,
        seed=options.seed,
        dtype=checkpoint_dtype(config),
        max_model_len=engine_max_model_len(config, options.max_model_len),
        gpu_memory_utilization=options.gpu_memory_utilization,
        max_lora_rank=options.max_lora_rank,
    )


def checkpoint_config(checkpoint: str) -> dict[str, Any]:
    """The checkpoint's config.json."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def checkpoint_dtype(config: dict[str, Any]) -> str:
    """The dtype the checkpoint was saved in: vLLM's "auto" would serve an fp32 model in
    bf16 on the CPU, and its log-probs would no longer match the trainer's."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
    return str(dtype).removeprefix("torch.")


def hf_engine_dtype(config: dict[str, Any], *, cuda: bool) -> Any:
    """The hf engine's dtype: the checkpoint's on a GPU, as vLLM serves it (a bf16 model
    in fp32 would take twice the memory beside a colocated trainer, which computes in
    bf16 there), and fp32 on the CPU, where the trainer computes in fp32 and bf16
    generation is slow."""
    import torch

    dtype = getattr(torch, checkpoint_dtype(config), None) if cuda else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# Where HF configs keep the context window (vLLM reads the same keys).
_WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def engine_max_model_len(config: dict[str, Any], wanted: int | None) -> int | None:
    """The context vLLM is started with: ``wanted`` (the run's longest prompt plus its
    longest response) where the checkpoint's window holds it, else None (vLLM's own
    choice, the window).

    Left to itself vLLM takes the checkpoint's window (40960 for Qwen3-0.6B) and
    refuses to start when the KV cache cannot hold one sequence that long, which the
    fixed CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``) often cannot. A run that asks
    for more than the window gets what vLLM did before: it refuses a longer
    ``max_model_len`` than it derives, and derives at least the window (more for
    some rope scalings, which this does not try to reproduce).
    """
    if wanted is None:
        return None
    for scope in (config, config.get("text_config") or {}):  # multimodal: the LM's part
        window = next((scope[k] for k in _WINDOW_KEYS if scope.get(k)), None)
        if window is not None:
            return wanted if wanted <= int(window) else None
    return None
