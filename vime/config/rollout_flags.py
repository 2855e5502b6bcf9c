"""The rollout and agent flag groups.

Where it fits: ``vime.config.flags`` adds these groups to every parser, in its
``GROUPS`` order; ``vime.config.validate`` checks them across flags and
``vime.config.rollout_settings`` turns them into the rollout side's settings.
Argparse only, like every flag module: no torch import.
"""

from __future__ import annotations

import argparse

from vime.config.flag_types import non_negative_int, positive_float, positive_int
from vime.ray import transport_names
from vime.rollout.engines import registry as engine_registry
from vime.rollout.settings import EndpointSettings, FaultSettings, ToolLoopSettings, ToolSettings
from vime.rollout.tools import parsers as tool_parsers

# The engines' names and their own flags come from vime.rollout.engines.registry, the weight
# transports' names from vime.ray.transport_names (neither imports torch or Ray).
ROLLOUT_ENGINES = engine_registry.rollout_engine_choices()
RM_TYPES = ("math", "exact", "builtin")
CPU_SPLITS = ("auto", "on", "off")
WEIGHT_SYNC_TRANSPORTS = transport_names.weight_sync_choices()
# --over-sampling-factor with --dynamic-sampling-filter when not given (vime.config.validate).
DEFAULT_OVER_SAMPLING_FACTOR = 1.5


def _rollout_shape(p: argparse._ArgumentGroup) -> None:
    """The engine, the rollout's size and how far it may run ahead of training."""
    engines = "; ".join(f"{s.name}: {s.summary}" for s in engine_registry.ENGINES.values())
    p.add_argument(
        "--rollout-engine",
        choices=ROLLOUT_ENGINES,
        default=engine_registry.AUTO,
        help=f"{engines}; or auto: vllm when importable (hf for the embedded model)",
    )
    p.add_argument(
        "--rollout-batch-size", type=positive_int, default=32, help="prompts per rollout"
    )
    p.add_argument(
        "--max-staleness",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="0: generate, then train, in turn; K >= 1: the engines never wait for the "
        "trainer, which trains on samples of weights at most K rollouts old, each token's "
        "loss weighted by the behaviour correction (--use-tis, on by default there)",
    )
    p.add_argument(
        "--cpu-split",
        choices=CPU_SPLITS,
        default="auto",
        help="CPU runs on one machine: split the cores between the training ranks and "
        "the engines, each process pinned to its own (auto: with --max-staleness >= 1, "
        "when both sides work at once)",
    )
    p.add_argument(
        "--n-samples-per-prompt",
        type=positive_int,
        default=8,
        help="completions per prompt (the GRPO group size)",
    )


def _engine_faults(p: argparse._ArgumentGroup) -> None:
    """What a dead or hung rollout engine costs: a restart, or the run."""
    faults = FaultSettings()
    p.add_argument(
        "--max-engine-restarts",
        type=non_negative_int,
        default=faults.max_restarts,
        metavar="N",
        help="a rollout engine that dies or hangs is replaced on its bundle, given the "
        "current weights, and its requests are sent again, up to N times within "
        "--engine-restart-window rollouts (beyond: the run stops naming the engine and its "
        f"last error; 0: the first one stops the run; default {faults.max_restarts})",
    )
    p.add_argument(
        "--engine-restart-window",
        type=non_negative_int,
        default=faults.restart_window,
        metavar="R",
        help="the rollouts --max-engine-restarts counts over: more than N restarts within "
        "any R consecutive rollouts stop the run (0: the whole run; default "
        f"{faults.restart_window})",
    )
    p.add_argument(
        "--engine-timeout",
        type=positive_float,
        default=faults.timeout_s,
        metavar="SECONDS",
        help="an engine that answers no health call within this, or makes no decode step "
        "or weight load that long while generating, counts as hung: it is killed and "
        f"restarted as a dead one (default {faults.timeout_s:g})",
    )


def _sampling(p: argparse._ArgumentGroup) -> None:
    """How the engines sample."""
    p.add_argument(
        "--rollout-max-prompt-len",
        type=positive_int,
        default=1024,
        help="prompts longer than this (in tokens) are dropped and counted",
    )
    p.add_argument(
        "--rollout-max-response-len",
        type=positive_int,
        default=1024,
        help="maximum new tokens per completion",
    )
    p.add_argument(
        "--rollout-temperature",
        type=float,
        default=1.0,
        help="sampling temperature (> 0); log-probs are taken at this temperature",
    )
    p.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    p.add_argument("--rollout-top-k", type=int, default=-1, help="top-k sampling; -1 disables it")


def _rewards(p: argparse._ArgumentGroup) -> None:
    """The reward: built-in, a user function or a remote service."""
    p.add_argument(
        "--rm-type",
        choices=RM_TYPES,
        default=None,
        help="built-in reward: math (final answer, checked by math-verify: the agents "
        "extra), exact (string match), or the task's own (default for builtin: and "
        "reasoning-gym: data)",
    )
    p.add_argument(
        "--custom-rm-path",
        default=None,
        metavar="MODULE:FN",
        help="user reward function, sync or async",
    )
    p.add_argument(
        "--group-rm",
        action="store_true",
        help="call --custom-rm-path once per group with all its samples",
    )
    p.add_argument(
        "--rm-url", default=None, metavar="URL", help="remote reward: POST one JSON per sample"
    )
    p.add_argument(
        "--rm-timeout", type=float, default=30.0, help="seconds per reward call before it fails"
    )
    p.add_argument(
        "--rm-max-retries",
        type=non_negative_int,
        default=3,
        help="retries of a failed remote reward call (with backoff)",
    )


def _rollout_ends(p: argparse._ArgumentGroup) -> None:
    """Where a completion ends, and dynamic sampling's rounds."""
    p.add_argument(
        "--rollout-stop-token-ids",
        type=int,
        nargs="*",
        default=[],
        metavar="ID",
        help="token ids that end a completion, besides the tokenizer's EOS",
    )
    p.add_argument(
        "--dynamic-sampling-filter",
        action="store_true",
        help="drop groups whose rewards all agree; sample more prompts until the batch is full",
    )
    p.add_argument(
        "--over-sampling-factor",
        type=float,
        default=None,
        metavar="F",
        help="with --dynamic-sampling-filter, a round asks for ceil(F x the missing groups) "
        f"and keeps the first that pass (default {DEFAULT_OVER_SAMPLING_FACTOR})",
    )
    p.add_argument(
        "--dynamic-sampling-max-rounds",
        type=positive_int,
        default=8,
        help="generation rounds per rollout before training on the groups kept so far",
    )


def _weight_sync(p: argparse._ArgumentGroup) -> None:
    """How new weights reach the engines, and every engine's own flags."""
    p.add_argument(
        "--weight-sync",
        choices=WEIGHT_SYNC_TRANSPORTS,
        default="auto",
        help=f"how new weights reach the engines (auto: {transport_names.AUTO_RULE})",
    )
    for add_engine_flags in engine_registry.flag_adders():  # every engine's: auto may pick any
        add_engine_flags(p)
    p.add_argument(
        "--update-weight-buffer-size",
        type=positive_int,
        default=512 * 1024**2,
        metavar="BYTES",
        help="bytes per weight-sync bucket",
    )


def add_rollout_flags(p: argparse._ArgumentGroup) -> None:
    """The rollout group: generation, reward, weight sync."""
    _rollout_shape(p)
    _engine_faults(p)
    _sampling(p)
    _rewards(p)
    _rollout_ends(p)
    _weight_sync(p)


def add_agent_flags(p: argparse._ArgumentGroup) -> None:
    """The agent group: tools, a custom generate function, the tool loop's limits."""
    p.add_argument(
        "--tools",
        default=None,
        metavar="MODULE:NAME",
        help="a list of Python functions the model may call: each sample becomes a "
        "multi-turn trajectory, the tools' answers appended as untrained tokens "
        "(builtin: tool tasks name their own)",
    )
    p.add_argument(
        "--custom-generate-function-path",
        default=None,
        metavar="MODULE:FN",
        help="async fn(sample, engine) -> vime.rollout.agent.Trajectory: your own "
        "multi-turn generation in place of the tool loop",
    )
    p.add_argument(
        "--agent-function-path",
        default=None,
        metavar="MODULE:FN",
        help="async fn(sample, client) -> float | dict: agent code written against the "
        "openai client, given an AsyncOpenAI on an OpenAI-compatible endpoint over the "
        "run's engines that records each trajectory as token ids (docs/agents.md)",
    )
    p.add_argument(
        "--environment",
        default=None,
        metavar="verifiers:MODULE:FACTORY",
        help="a verifiers environment (FACTORY() returns a verifiers.v1.Env): its taskset "
        "gives the prompts, its episodes run through the OpenAI endpoint as agents do, "
        "its rubric gives the rewards (docs/agents.md)",
    )
    _endpoint_flags(p)
    _tool_loop_flags(p)


def _endpoint_flags(p: argparse._ArgumentGroup) -> None:
    """Where --agent-function-path's OpenAI-compatible endpoint listens."""
    p.add_argument(
        "--endpoint-host",
        default=EndpointSettings.host,
        help="--agent-function-path: the address the endpoint listens on",
    )
    p.add_argument(
        "--endpoint-port",
        type=int,
        default=EndpointSettings.port,
        help="--agent-function-path: the endpoint's port (0: a free one)",
    )


def _tool_loop_flags(p: argparse._ArgumentGroup) -> None:
    """How a trajectory's turns and tool calls are bounded and read."""
    p.add_argument(
        "--max-turns",
        type=positive_int,
        default=ToolLoopSettings.max_turns,
        help="--tools: model turns per trajectory at most (one that still calls a tool "
        "is cut there); --agent-function-path: requests per trajectory at most",
    )
    parsers = "; ".join(f"{s.name}: {s.summary}" for s in tool_parsers.PARSERS.values())
    p.add_argument(
        "--tool-parser",
        choices=tool_parsers.tool_parser_choices(),
        default=None,
        help=f"--tools, --agent-function-path: how a model turn's calls are read. {parsers}; "
        "auto (default): "
        "hermes with a chat template, a turn without <tool_call> read as llama3_json, "
        "else plain",
    )
    p.add_argument(
        "--tool-timeout",
        type=float,
        default=ToolSettings.timeout_s,
        metavar="SECONDS",
        help="--tools: a call running longer becomes an error the model reads",
    )
    p.add_argument(
        "--tool-max-output-tokens",
        type=positive_int,
        default=ToolSettings.max_output_tokens,
        help="--tools: a tool's answer is cut to this many tokens before the model sees it",
    )
