"""The rollout side's settings: frozen dataclasses, one per component.

Where it fits: ``vime.config`` builds these from the parsed flags once
(``vime.config.rollout_settings``); the rollout manager, the tool loop and the agent
take them and read no flag. Light on purpose (no torch): the flag parser reads the
tool limits' defaults from here, so each is stated once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vime.errors import ConfigError
from vime.rollout.tools.parsers import AUTO


@dataclass(frozen=True)
class FaultSettings:
    """Dead and hung rollout engines (``vime.ray.engine_watch``): ``--max-engine-restarts``
    (restarts within ``--engine-restart-window`` rollouts, 0 of those: the whole run; 0
    restarts: the first death stops the run) and ``--engine-timeout`` (seconds a health
    call, or a generation's step, may take before the engine counts as hung)."""

    max_restarts: int = 3
    timeout_s: float = 300.0
    restart_window: int = 100

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-engine-restarts must be >= 0, got {self.max_restarts}")
        if self.restart_window < 0:
            raise ConfigError(
                f"--engine-restart-window must be >= 0 rollouts, got {self.restart_window}"
            )


@dataclass(frozen=True)
class SamplingSettings:
    """How the engines sample: training rollouts (``--rollout-*``, ``--n-samples-per-prompt``)
    and evaluation (``--eval-*``)."""

    n_samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop_token_ids: tuple[int, ...]  # --rollout-stop-token-ids (EOS is added per tokenizer)
    eval_n_samples_per_prompt: int
    eval_temperature: float


@dataclass(frozen=True)
class RolloutSettings:
    """One rollout's size, dynamic sampling and advantages (built by ``vime.config``)."""

    batch_size: int  # groups a rollout trains (--rollout-batch-size)
    sampling: SamplingSettings
    seed: int
    dynamic_sampling_filter: bool
    dynamic_sampling_max_rounds: int
    over_sampling_factor: float
    advantage_estimator: str
    custom_advantage_function_path: str | None
    use_tis: bool


@dataclass(frozen=True)
class ToolSettings:
    """Per-run limits: seconds a call may take (``--tool-timeout``); tokens of a tool's
    output the model sees (``--tool-max-output-tokens``)."""

    timeout_s: float = 30.0
    max_output_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"--tool-timeout must be > 0 seconds, got {self.timeout_s}")
        if self.max_output_tokens < 1:
            raise ConfigError(
                f"--tool-max-output-tokens must be >= 1, got {self.max_output_tokens}"
            )


@dataclass(frozen=True)
class ToolLoopSettings:
    """``max_turns`` model turns at most; the tools' own limits; ``parser``, the
    ``--tool-parser`` name (``vime.rollout.tools.parsers``; ``auto`` resolved by the
    tokenizer when the loop is built)."""

    max_turns: int = 4
    tools: ToolSettings = field(default_factory=ToolSettings)
    parser: str = AUTO

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"--max-turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class EndpointSettings:
    """The OpenAI-compatible endpoint of ``--agent-function-path`` (``vime.rollout.endpoint``):
    where it listens (``--endpoint-host``, ``--endpoint-port``, 0 for a free one), requests
    per trajectory at most (``--max-turns``) and how tool calls are read (``--tool-parser``)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_turns: int = 4
    parser: str = AUTO

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"--max-turns must be >= 1, got {self.max_turns}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--endpoint-port must be in 0..65535, got {self.port}")


@dataclass(frozen=True)
class AgentSettings:
    """The run's multi-turn generation: a custom generate function
    (``--custom-generate-function-path``), the tool loop over ``--tools`` (``loop``, None
    without them), an agent function behind the OpenAI endpoint (``--agent-function-path``,
    ``endpoint``), or none; ``budget`` and ``stop_token_ids`` are the rollout's
    (``--rollout-max-response-len``, ``--rollout-stop-token-ids``)."""

    generate_function: str | None
    tools: str | None
    loop: ToolLoopSettings | None
    apply_chat_template: bool
    budget: int
    stop_token_ids: tuple[int, ...]
    agent_function: str | None = None
    endpoint: EndpointSettings | None = None
    environment: str | None = None  # --environment: a verifiers environment's agent
