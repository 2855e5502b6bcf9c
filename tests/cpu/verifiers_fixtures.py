"""verifiers environments built from local data, for ``--environment`` tests
(``verifiers:tests.cpu.verifiers_fixtures:single_turn_env`` / ``tool_env``).

Both are ``vf.SingleAgentEnv`` over a two-task in-memory taskset whose tasks score with
one ``@vf.reward``: ``answer_reward``, a known function of the final answer (0.25 plus
0.5 when its length is odd), recorded with the answer to ``$VIME_VF_LOG`` when set so a
test can check the run's rewards are the rubric's. The tool environment adds a local
``add`` tool (a ``vf.Toolset`` served by verifiers as an MCP server: this module runs
as its process, hence ``__main__``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import verifiers.v1 as vf

PROMPTS = ["What is 2 + 3?", "Add 2 and 3, please."]
LOG = "VIME_VF_LOG"


def answer_reward_of(answer: str) -> float:
    """The rubric: 0.25, plus 0.5 for an answer of odd length."""
    return 0.25 + 0.5 * (len(answer) % 2)


class AddTools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is called "add", as the fixture model spells it

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AnswerTaskConfig(vf.TaskConfig):
    tools: bool = False  # the tool environment's tasks serve AddTools


class AnswerTasksetConfig(vf.TasksetConfig):
    task: AnswerTaskConfig = AnswerTaskConfig()


class AnswerTask(vf.Task[vf.TaskData, vf.State, AnswerTaskConfig]):
    @classmethod
    def toolsets(cls, config: AnswerTaskConfig) -> list[vf.Toolset]:
        return [AddTools(vf.ToolsetConfig())] if config.tools else []

    @vf.reward
    async def answer_reward(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        answer = vf.types.content_text(replies[-1].content) if replies else ""
        reward = answer_reward_of(answer)
        if os.environ.get(LOG):
            with open(os.environ[LOG], "a", encoding="utf-8") as f:
                f.write(json.dumps({"answer": answer, "reward": reward}) + "\n")
        return reward


class AnswerTaskset(vf.Taskset[AnswerTask, AnswerTasksetConfig]):
    def load(self) -> Iterable[AnswerTask]:
        for prompt in PROMPTS:
            yield AnswerTask(vf.TaskData(prompt=prompt), self.config.task)


__all__ = ["AnswerTaskset"]  # verifiers finds the taskset of the id (this module) here


def _env(tools: bool) -> vf.SingleAgentEnv:
    # A taskset id is a top-level module name: this file's, with tests/cpu on the path.
    config = AnswerTasksetConfig(id="verifiers_fixtures", task=AnswerTaskConfig(tools=tools))
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=config))


def single_turn_env() -> vf.SingleAgentEnv:
    """The tasks with no tools: one model turn each, scored by ``answer_reward``."""
    return _env(tools=False)


def tool_env() -> vf.SingleAgentEnv:
    """The tasks with the ``add`` tool: the model calls it and answers."""
    return _env(tools=True)


def not_an_env() -> dict:
    """A factory returning something else."""
    return {"taskset": "x"}


if __name__ == "__main__":
    AddTools.run()
