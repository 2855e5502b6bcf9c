"""An agent for the built-in lookup task, written against the ``openai`` client alone.

Run it with ``vime-train --prompt-data builtin:lookup --agent-function-path
examples/lookup_agent.py:lookup_agent``: vime starts its OpenAI-compatible endpoint on
the run's engines and hands the agent a client pointed at it; the tokens the endpoint
captured are trained. The agent plays the task's tool loop in plain text: a turn
``get KEY`` is answered by the stored value and ``=`` (the task's prompts end so),
any other turn is the final answer. It returns None, so the task's own reward scores
the whole trajectory, as it does for the built-in loop.
"""

from __future__ import annotations

from typing import Any

from vime.data.tasks import get  # the task's tool: the value stored under a key


async def lookup_agent(sample: Any, client: Any) -> None:
    """Ask for completions until a turn is not a ``get`` call; the endpoint ends the
    trajectory (and cancels this coroutine) when its turns or tokens are spent."""
    prompt = sample.prompt.text
    while True:
        out = await client.completions.create(model="vime", prompt=prompt)
        choice = out.choices[0]
        words = choice.text.split()
        if choice.finish_reason == "length" or not words or words[0] != "get":
            return None
        answer = get(words[1]) if len(words) == 2 else "error: get takes one key"
        prompt += choice.text + answer + "="
