"""verifiers environments as a run's prompts, rollouts and rewards (``--environment``).

Where it fits: ``--environment verifiers:MODULE:FACTORY`` names a function returning a
``verifiers.v1.Env`` (PyPI ``verifiers`` 0.4, the ``agents`` extra). The flags are
checked with ``check_spec`` while parsing (verifiers imported, the factory called once);
``vime.data.prompts.load_prompts`` reads the environment's taskset here as the prompt
rows (``load_env_prompts``), and ``vime.rollout.endpoint.verifiers_agent`` plays each
sample's task as an episode through the run's OpenAI endpoint, the environment's own
rubric giving the reward. ``VerifiersTask`` stands where a built-in task's reward would:
it scores only a trajectory the run cut (the episode was stopped, its rubric never ran).

Local only: every seat runs in verifiers' subprocess runtime with its chat program on
this interpreter, so a seat that pins another harness (which installs a program) or
runtime (a container or a cloud sandbox), and a task that needs a container, are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vime.errors import ConfigError

PREFIX = "verifiers:"
INSTALL = "needs verifiers, which is not installed; pip install -e '.[agents]'"
CHAT_HARNESSES = frozenset({"bash", "null"})  # the in-house chat loops: no program to install


def is_verifiers_spec(spec: str | None) -> bool:
    """Whether ``spec`` names a verifiers environment."""
    return bool(spec) and spec.startswith(PREFIX)


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"--environment {INSTALL}") from None
    return vf


@functools.lru_cache(maxsize=4)
def load_environment(spec: str) -> Any:
    """The ``Env`` ``spec``'s factory returns, its seats set up to run here; a one-line
    ConfigError for a bad spec, a factory that fails or returns something else, or an
    environment that needs a download, a container or the network."""
    from vime.algo.custom import load_function

    vf = _verifiers()
    target = spec[len(PREFIX) :]
    try:
        factory = load_function(target)
    except ValueError as err:
        raise ConfigError(f"--environment {spec}: {err}") from None
    try:
        env = factory()
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        raise ConfigError(f"--environment {spec}: the factory raised {why}") from None
    if not isinstance(env, vf.Env):
        raise ConfigError(
            f"--environment {spec}: the factory returned {type(env).__name__}, not a "
            "verifiers.v1.Env (e.g. vf.SingleAgentEnv(vf.SingleAgentEnvConfig(...)))"
        )
    return _run_locally(env, spec, vf)


def _run_locally(env: Any, spec: str, vf: Any) -> Any:
    """``env`` rebuilt with every seat in the subprocess runtime on ``LocalChatHarness``
    (verifiers' own chat program, on this interpreter)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.harnesses.null import NullHarnessConfig

    from vime.rollout.endpoint.verifiers_harness import HARNESS_ID  # registers it

    if type(env.taskset).task_type().NEEDS_CONTAINER:
        raise ConfigError(f"--environment {spec}: its tasks need a container; vime runs locally")
    seats = {}
    for name, seat in agent_config_fields(env.config).items():
        harness = seat.harness.id if seat.harness is not None else "bash"
        if harness not in CHAT_HARNESSES:
            raise ConfigError(
                f"--environment {spec}: seat '{name}' runs the '{harness}' harness, which "
                "installs a program (a download); vime runs verifiers' chat program"
            )
        if "runtime" in seat.model_fields_set and seat.runtime.type != "subprocess":
            raise ConfigError(
                f"--environment {spec}: seat '{name}' needs the '{seat.runtime.type}' runtime "
                "(a container or a remote sandbox); vime runs seats locally"
            )
        if seat.model is not None or seat.client is not None:
            raise ConfigError(
                f"--environment {spec}: seat '{name}' pins its own model or endpoint; "
                "every seat must be the policy trained"
            )
        seats[name] = seat.model_copy(
            update={"harness": NullHarnessConfig(id=HARNESS_ID), "runtime": vf.SubprocessConfig()}
        )
    if len(seats) != 1:
        raise ConfigError(
            f"--environment {spec}: {len(seats)} seats; vime trains one policy per "
            "trajectory, so give an environment with one seat"
        )
    return type(env)(env.config.model_copy(update=seats))


def check_spec(spec: str) -> None:
    """The environment loads (see ``load_environment``) and its taskset is finite."""
    env = load_environment(spec)
    if not env.taskset.bounded:
        raise ConfigError(f"--environment {spec}: its taskset is infinite; bound it (take(n))")


@functools.lru_cache(maxsize=4)
def tasks_of(spec: str) -> list[Any]:
    """The environment's tasks, in its taskset's order (a prompt row's index is its task's)."""
    return list(load_environment(spec).taskset)


def load_env_prompts(spec: str) -> list[tuple[str | list[dict], int]]:
    """(prompt, task index) rows of the environment's tasks: the prompt as the chat
    program opens the conversation (the system prompt first, then the task's messages)."""
    from verifiers.v1.types import content_text

    rows = []
    for index, task in enumerate(tasks_of(spec)):
        data = task.data
        prompt = data.prompt
        if prompt is None:
            raise ConfigError(f"--environment {spec}: task {index} has no prompt")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [{"role": m.role, "content": content_text(m.content)} for m in prompt]
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        rows.append((messages, index))
    if not rows:
        raise ConfigError(f"--environment {spec}: its taskset holds no tasks")
    return rows


@dataclass(frozen=True)
class VerifiersTask:
    """A verifiers environment in the place of a built-in ``Task``: the rubric scores
    every episode that ends; one the run cut (budget, ``--max-turns``) scores 0."""

    name: str
    reads_trajectory: bool = False

    def reward(self, response: str, label: Any) -> float:
        return 0.0

    def is_correct(self, response: str, label: Any) -> bool:
        return False
