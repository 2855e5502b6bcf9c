"""A verifiers environment's episodes as ``--agent-function-path`` agents (``--environment``).

Where it fits: ``build_endpoint_agent`` takes :func:`environment_agent`'s function in
place of a user's, so an environment's rollouts go through the run's OpenAI endpoint and
are captured token-exactly like any agent's. Per sample the function plays the sample's
task (``vime.data.verifiers_env.tasks_of``, by the prompt row's index) as one episode,
``Env.run_episode``, with a ``ModelContext`` whose endpoint is the client's: verifiers'
interception server relays every model call of the episode to vime's endpoint with the
trajectory's header, and the environment's rubric (its tasks' ``@vf.reward`` functions
and judges) scores the trace: that sum is the sample's reward. An episode that fails
(its harness or a hook raised) fails the rollout with verifiers' error.
The seat's harness is ``vime.rollout.endpoint.verifiers_harness.LocalChatHarness``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vime.rollout.endpoint.server import HEADER, MODEL

if TYPE_CHECKING:
    from vime.rollout.agent import AgentSample

# The endpoint's token reaches verifiers' client through the environment (its configs
# name a variable); "API_KEY" in the name keeps it from the harness's processes.
KEY_VARIABLE = "VIME_ENDPOINT_API_KEY"


def environment_agent(spec: str) -> Any:
    """``async fn(sample, client) -> float``: the episode of the sample's task, scored by
    the environment ``spec`` names."""
    from verifiers.v1 import EvalClientConfig, ModelContext

    from vime.data.verifiers_env import load_environment, tasks_of

    env, tasks = load_environment(spec), tasks_of(spec)

    async def play(sample: AgentSample, client: Any) -> float:
        os.environ[KEY_VARIABLE] = client.api_key
        endpoint = EvalClientConfig(
            base_url=str(client.base_url),
            api_key_var=KEY_VARIABLE,
            headers={HEADER: client.default_headers[HEADER]},
        )
        task = tasks[sample.prompt.label]
        async with env.serving():
            episode = await env.run_episode(task, ModelContext(model=MODEL, client=endpoint))
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.traces:
            what = f"{errors[0].type}: {errors[0].message}" if errors else "no trace"
            raise RuntimeError(f"--environment {spec}: task {sample.prompt.label}: {what}")
        return float(sum(t.reward for t in episode.traces))

    return play
