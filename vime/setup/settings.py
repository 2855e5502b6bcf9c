"""The settings the setup's builders and the loop take: each one's part of the run's flags.

Where it fits: ``vime.config`` converts the flag namespace into these frozen records
(``vime.config.setup_settings``, ``cluster_settings`` and ``settings``), and
``vime.setup.run.build_run`` hands each builder only its own: ``DataSettings`` before
the model and prompts load, the rest (in ``vime.config.settings.RunSettings``) once
``resolve_run`` has fixed the values known only then. No builder reads a flag.
Light: dataclasses only, the types they hold imported for the type checker alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.backends.base import TrainSettings
    from vime.ray.placement import PlacementSettings
    from vime.rollout.rewards import RewardSettings
    from vime.rollout.settings import AgentSettings, FaultSettings
    from vime.weights.lora import EngineLora


@dataclass(frozen=True)
class ModelSettings:
    """What ``build_model`` reads: ``--hf-checkpoint`` (None: the embedded model, written
    into ``output_dir`` with ``seed``) and ``--prompt-data``, which may name a built-in
    task."""

    hf_checkpoint: str | None
    output_dir: str
    seed: int
    prompt_data: str | None


@dataclass(frozen=True)
class PromptSettings:
    """What ``build_prompts`` reads: the prompt files and their keys, the chat template,
    the prompt length cap (``--rollout-max-prompt-len``), the epochs and seed of the
    draw, and whether the reward needs each prompt's label."""

    prompt_data: str
    eval_prompt_data: str | None
    input_key: str
    label_key: str | None
    metadata_key: str | None
    apply_chat_template: bool
    max_prompt_len: int
    num_epoch: int
    seed: int
    require_label: bool


@dataclass(frozen=True)
class DataSettings:
    """What the model, its tools and the prompts load with: known before they load,
    unlike the values ``vime.config.setup_settings.resolve_run`` fills in from them."""

    model: ModelSettings
    prompts: PromptSettings
    agent: AgentSettings


@dataclass(frozen=True)
class ScorerSettings:
    """The reward (``--rm-*``, ``--custom-rm-path``); ``hook_args``: the run's resolved
    flags, a custom reward function's documented first argument, passed on unread."""

    rewards: RewardSettings
    hook_args: Any


@dataclass(frozen=True)
class ClusterSettings:
    """Ray (``--ray-address``; ``joins_cluster``: that or ``RAY_ADDRESS`` names one to
    join), the devices to reserve, and ``--weight-sync``, which some devices refuse."""

    ray_address: str | None
    joins_cluster: bool
    placement: PlacementSettings
    weight_sync: str


@dataclass(frozen=True)
class EngineSettings:
    """The engines' kind (``--rollout-engine``) and what each is built with that the
    flags say (``engine_options`` adds what the model does); ``lora``: the engines'
    part of a LoRA run, None without one; ``faults``: what a dead or hung engine costs."""

    kind: str
    tensor_parallel_size: int
    seed: int
    max_model_len: int
    gpu_memory_utilization: float
    lora: EngineLora | None
    faults: FaultSettings


@dataclass(frozen=True)
class ActorSettings:
    """What ``build_actors`` reads: the training ranks' backend and devices a node
    (their threads), ``--cpu-split``, ``--max-staleness``, ``--colocate``, the engines;
    ``train``: what the ranks are initialised with; ``rank_folders``: the ``(flag,
    folder)`` pairs the ranks must see as the driver does (``vime.ray.folders``)."""

    train_backend: str
    gpus_per_node: int
    cpu_split: str
    max_staleness: int
    colocate: bool
    joins_cluster: bool
    weight_sync: str
    engines: EngineSettings
    train: TrainSettings
    rank_folders: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TimingSettings:
    """The rollouts to trace (``--profile-rollouts``) into the output folder."""

    output_dir: str
    profile_rollouts: tuple[int, ...]


@dataclass(frozen=True)
class TrackerSettings:
    """The run's outputs: where, how many rollouts, which loggers; ``flags``: the
    resolved flags as written to ``config.json``."""

    output_dir: str
    num_rollouts: int
    use_tensorboard: bool
    use_wandb: bool
    wandb_project: str
    flags: dict[str, Any]


@dataclass(frozen=True)
class UpdateSettings:
    """How a rollout's batch is split into optimizer steps (``vime.trainer.plan_updates``);
    ``shuffle_seed``: the run's seed under ``--shuffle-updates``, else None."""

    global_batch_size: int
    dp_size: int
    micro_batch_size: int
    max_tokens_per_gpu: int | None
    shuffle_seed: int | None


@dataclass(frozen=True)
class WarmStartSettings:
    """``--sft-warmup-steps``: ``steps`` optimizer steps of ``batch_size`` demonstrations
    each (``vime.setup.warm_start``), drawn by ``seed``."""

    steps: int
    batch_size: int
    seed: int


@dataclass(frozen=True)
class LoopSettings:
    """What the loop (``vime.trainer.Run``) reads of the run's flags."""

    output_dir: str
    num_rollout: int
    updates: UpdateSettings
    colocate: bool
    rollout_temperature: float
    eval_interval: int | None
    save: str | None
    save_interval: int | None
    save_hf: str | None
    save_hf_merged: str | None
