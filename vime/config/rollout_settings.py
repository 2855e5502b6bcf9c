"""The rollout side's settings, converted from the parsed flags.

Where it fits: ``vime.config.settings.build_settings`` converts the whole namespace once
into per-component frozen settings; this module holds the rollout side's conversions
(sampling, the rollout manager, rewards, the agent and its tool loop) and the reward
check ``vime.config.validate`` runs while parsing. The dataclasses are ``vime.rollout.settings``'s
(light) and ``vime.rollout.rewards.RewardSettings``; no module there reads a flag.
Light: parsing imports this module (no torch).
"""

from __future__ import annotations

import argparse
import math
import urllib.parse

from vime.config.flags import BUILTIN_DATA_PREFIX
from vime.data.reasoning_gym import is_gym_spec
from vime.data.verifiers_env import is_verifiers_spec
from vime.errors import ConfigError
from vime.rollout.rewards import RewardSettings, load_custom_reward, reward_source
from vime.rollout.settings import (
    AgentSettings,
    EndpointSettings,
    RolloutSettings,
    SamplingSettings,
    ToolLoopSettings,
    ToolSettings,
)


def sampling_settings(args: argparse.Namespace) -> SamplingSettings:
    return SamplingSettings(
        n_samples_per_prompt=args.n_samples_per_prompt,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_response_len=args.rollout_max_response_len,
        stop_token_ids=tuple(args.rollout_stop_token_ids),
        eval_n_samples_per_prompt=args.eval_n_samples_per_prompt,
        eval_temperature=args.eval_temperature,
    )


def rollout_settings(args: argparse.Namespace) -> RolloutSettings:
    return RolloutSettings(
        batch_size=args.rollout_batch_size,
        sampling=sampling_settings(args),
        seed=args.seed,
        dynamic_sampling_filter=args.dynamic_sampling_filter,
        dynamic_sampling_max_rounds=args.dynamic_sampling_max_rounds,
        over_sampling_factor=args.over_sampling_factor,
        advantage_estimator=args.advantage_estimator,
        custom_advantage_function_path=args.custom_advantage_function_path,
        use_tis=args.use_tis,
    )


def reward_settings(args: argparse.Namespace) -> RewardSettings:
    # No --prompt-data means the embedded built-in task, which brings its reward; so
    # does a reasoning-gym task (its dataset's score_answer).
    data = args.prompt_data
    return RewardSettings(
        rm_type=args.rm_type,
        url=args.rm_url,
        custom_path=args.custom_rm_path,
        group=args.group_rm,
        timeout_s=args.rm_timeout,
        max_retries=args.rm_max_retries,
        task_data=data is None
        or data.startswith(BUILTIN_DATA_PREFIX)
        or is_gym_spec(data)
        or is_verifiers_spec(data),
    )


def check_rewards(args: argparse.Namespace) -> None:
    """The reward flags, checked while parsing: the reward is picked now (and
    ``--custom-rm-path`` imported), so a broken choice fails at start-up."""
    if not (args.rm_timeout > 0 and math.isfinite(args.rm_timeout)):
        raise ConfigError(
            f"--rm-timeout must be a positive number of seconds, got {args.rm_timeout}"
        )
    if args.rm_url is not None:
        parts = urllib.parse.urlsplit(args.rm_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--rm-url {args.rm_url}: expected http://host[:port]/path")
    settings = reward_settings(args)
    if reward_source(settings, settings.task_data) == "custom":
        load_custom_reward(settings.custom_path, settings.group)


def tool_loop_settings(args: argparse.Namespace) -> ToolLoopSettings:
    """The tool loop's limits; ``ConfigError`` for one out of range."""
    return ToolLoopSettings(
        args.max_turns,
        ToolSettings(args.tool_timeout, args.tool_max_output_tokens),
        args.tool_parser,
    )


def endpoint_settings(args: argparse.Namespace) -> EndpointSettings:
    """The OpenAI endpoint of ``--agent-function-path``; ``ConfigError`` for a bad value."""
    return EndpointSettings(
        args.endpoint_host, args.endpoint_port, args.max_turns, args.tool_parser
    )


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    agent_function = args.agent_function_path
    return AgentSettings(
        generate_function=args.custom_generate_function_path,
        tools=args.tools,
        loop=tool_loop_settings(args) if args.tools else None,
        apply_chat_template=args.apply_chat_template,
        budget=args.rollout_max_response_len,
        stop_token_ids=tuple(args.rollout_stop_token_ids),
        agent_function=agent_function,
        endpoint=endpoint_settings(args) if agent_function or args.environment else None,
        environment=args.environment,
    )
