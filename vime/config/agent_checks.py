"""Checks of the agent flags: ``--tools``, ``--custom-generate-function-path``,
``--agent-function-path``, ``--tool-parser`` and ``--environment``.

Where it fits: ``vime.config.validate`` calls ``check_agent`` with the other flag
checks; the tools, the generate function and the agent function are imported here,
at parse time, so a broken one fails at start-up rather than mid-run.
"""

from __future__ import annotations

import argparse
import importlib.util

from vime.config.flag_types import given_flags
from vime.data import verifiers_env
from vime.errors import ConfigError
from vime.rollout.tools import parsers as tool_parsers


def check_agent(args: argparse.Namespace) -> None:
    """Multi-turn rollouts: a built-in tool task implies its tools (unless a generate or
    agent function runs them itself); the tools, the generate function and the agent
    function import now, so a broken one fails at start-up."""
    from vime.data.prompts import builtin_task_of  # deferred: --help does without it

    task = builtin_task_of(args.prompt_data) if args.prompt_data else None
    if task:
        from vime.data.tasks import get_task

        implied = getattr(get_task(task), "tools", "")
        own = given_flags(args, "custom_generate_function_path", "agent_function_path")
        if implied and args.tools is None and not own:
            args.tools = implied
    given = given_flags(args, "tools", "custom_generate_function_path", "agent_function_path")
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} each generate the trajectories; give one (a custom "
            "function or an agent can run tools itself)"
        )
    _check_tool_parser(args)
    if args.tools is not None:
        from vime.config.rollout_settings import tool_loop_settings

        tool_loop_settings(args)  # the loop's limits, checked at parse time
        from vime.rollout.tools.toolbox import load_tools

        load_tools(args.tools).close()
    if args.custom_generate_function_path is not None:
        from vime.rollout.agent import load_generate_function

        load_generate_function(args.custom_generate_function_path)
    if args.agent_function_path is not None:
        _check_agent_function(args)


def _check_agent_function(args: argparse.Namespace) -> None:
    """``--agent-function-path``: the endpoint's packages are there, its settings in range
    and the function imports, now rather than when the run starts."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "openai") if not importlib.util.find_spec(m)]
    if missing:
        raise ConfigError(
            f"--agent-function-path needs {', '.join(missing)}: pip install -e '.[agents]'"
        )
    from vime.config.rollout_settings import endpoint_settings
    from vime.rollout.endpoint.agent import load_agent_function

    endpoint_settings(args)  # the endpoint's values, checked at parse time
    load_agent_function(args.agent_function_path)


def _check_tool_parser(args: argparse.Namespace) -> None:
    """``--tool-parser`` (default auto): only the tool loop reads turns with it, and a
    named parser must fit the prompts' form. Whether an ``--hf-checkpoint``'s tokenizer
    has a chat template is known once it is loaded (the run checks it then, before
    Ray starts: ``vime.rollout.tools.loop.check_tool_format``); the embedded model's has
    none."""
    name = args.tool_parser
    args.tool_parser = name or tool_parsers.AUTO
    if name is None:
        return
    endpoint = args.agent_function_path is not None or args.environment is not None
    if args.tools is None and not endpoint:
        why = (
            "a --custom-generate-function-path function reads its own turns"
            if args.custom_generate_function_path is not None
            else "add --tools MODULE:NAME, or drop it"
        )
        raise ConfigError(
            f"--tool-parser {name} applies only to --tools and --agent-function-path; {why}"
        )
    if name == tool_parsers.AUTO:
        return
    if endpoint:
        if not tool_parsers.get_tool_parser(name).chat:
            raise ConfigError(
                f"--tool-parser {name}: the endpoint reads tool calls from chat turns; use "
                "hermes, llama3_json or auto"
            )
        return
    if not tool_parsers.get_tool_parser(name).chat:
        if args.apply_chat_template:
            raise ConfigError(
                f"--tool-parser {name} appends the tools' answers as raw text, not as the "
                "chat template's tool turns; drop --apply-chat-template, or use "
                "--tool-parser hermes or llama3_json"
            )
    elif args.hf_checkpoint is None:
        raise ConfigError(
            f"--tool-parser {name} reads turns a chat template frames, and the embedded "
            "model (no --hf-checkpoint) has none; use --tool-parser plain or auto"
        )
    elif not args.apply_chat_template:
        raise ConfigError(
            f"--tool-parser {name} reads turns a chat template frames and renders the "
            "tools' answers with it; add --apply-chat-template"
        )


def check_environment(args: argparse.Namespace) -> None:
    """``--environment verifiers:MODULE:FACTORY``: it alone gives the prompts and the
    trajectories, and it loads now (verifiers imported, the factory called); its taskset
    becomes the prompt data."""
    spec = args.environment
    if spec is None:
        return
    if not verifiers_env.is_verifiers_spec(spec):
        raise ConfigError(f"--environment {spec}: write verifiers:MODULE:FACTORY")
    given = given_flags(
        args, "prompt_data", "tools", "custom_generate_function_path", "agent_function_path"
    )
    if given:
        raise ConfigError(
            f"--environment and {' and '.join(given)}: the environment gives the prompts "
            "and runs the trajectories itself; drop the other"
        )
    if not args.apply_chat_template:
        raise ConfigError("--environment talks to the model in chat: add --apply-chat-template")
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"--environment needs {', '.join(missing)}: pip install -e '.[agents]'")
    verifiers_env.check_spec(spec)
    args.prompt_data = spec
