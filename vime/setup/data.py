"""Builders of what a run knows before Ray starts: model, tokenizer, task, tools,
prompts and the reward scorer.

Where it fits: the first builders ``vime.setup.run.build_run`` calls, on
``vime.setup.settings``' ``DataSettings``. With no ``--hf-checkpoint`` the embedded
model is written into the output folder; prompts over ``--rollout-max-prompt-len`` are
dropped and counted. Then ``vime.config.setup_settings.resolve_run`` fixes the values
every process must agree on (the run's length, the checkpoint, the export folder), and
the scorer is built on the resolved flags' ``ScorerSettings``.
"""

from __future__ import annotations

import os
from typing import Any

from vime.data.prompts import (
    PromptSource,
    builtin_task_of,
    filter_prompt_lengths,
    load_prompts,
    render_prompt,
)
from vime.data.reasoning_gym import gym_task, is_gym_spec
from vime.data.verifiers_env import VerifiersTask, is_verifiers_spec
from vime.rollout.rewards import build_reward_scorer
from vime.rollout.settings import AgentSettings
from vime.rollout.tools.loop import check_tool_format
from vime.rollout.tools.toolbox import load_tools
from vime.setup.parts import Closer, Console, Model, Prompts
from vime.setup.settings import ModelSettings, PromptSettings, ScorerSettings

EMBEDDED_MODEL_DIR = "embedded_model"


def build_model(
    settings: ModelSettings, agent: AgentSettings, console: Console, closer: Closer
) -> Model:
    """The checkpoint (the embedded model written into the output folder when
    ``--hf-checkpoint`` names none), its tokenizer, the task and the tools."""
    embedded = settings.hf_checkpoint is None
    checkpoint = settings.hf_checkpoint or _embedded_checkpoint(settings.output_dir, settings.seed)
    console.say(f"vime: model {checkpoint}")
    tokenizer = _tokenizer(checkpoint, embedded=embedded)
    task = _task(settings.prompt_data)
    # Multi-turn rollouts: the tools, shown to the model in its prompts, and read from
    # its turns by --tool-parser, whose fit to the tokenizer is known only now.
    toolbox = None
    if agent.tools:
        check_tool_format(agent, tokenizer)
        toolbox = load_tools(agent.tools)
        closer.callback(toolbox.close)
    return Model(checkpoint, embedded, tokenizer, task, toolbox)


def build_prompts(settings: PromptSettings, model: Model, console: Console) -> Prompts:
    """The training and eval prompts as token ids, over-long ones dropped and counted (a
    row without a label refused where the reward reads it)."""
    train, ids, dropped = _token_prompts(settings, settings.prompt_data, model, console)
    source = PromptSource(train, num_epoch=settings.num_epoch, seed=settings.seed)
    # Prompts over --rollout-max-prompt-len, as recorded in metrics.jsonl and summary.json.
    counts = {"data/prompts_dropped": float(dropped)}
    eval_prompts = eval_ids = None
    if settings.eval_prompt_data:
        eval_prompts, eval_ids, eval_dropped = _token_prompts(
            settings, settings.eval_prompt_data, model, console
        )
        counts["data/eval_prompts_dropped"] = float(eval_dropped)
    return Prompts(source, ids, eval_prompts, eval_ids, counts)


def build_scorer(settings: ScorerSettings, model: Model, closer: Closer) -> Any:
    """The reward scorer: ``--rm-type`` or the task's own reward (a custom reward
    function is handed the run's flags, ``settings.hook_args``, as its documented first
    argument)."""
    task = model.task
    scorer = build_reward_scorer(
        settings.rewards,
        task.reward if task else None,
        task_reads_trajectory=bool(task and task.reads_trajectory),
        hook_args=settings.hook_args,
    )
    closer.callback(scorer.close)
    return scorer


def _token_prompts(
    settings: PromptSettings, spec: str, model: Model, console: Console
) -> tuple[list[Any], dict[int, list[int]], int]:
    """The prompts of ``spec`` that fit ``--rollout-max-prompt-len``, their token ids by
    prompt index, and how many were dropped."""
    prompts = load_prompts(
        spec,
        input_key=settings.input_key,
        label_key=settings.label_key,
        metadata_key=settings.metadata_key,
        seed=settings.seed,
        require_label=settings.require_label,
        apply_chat_template=settings.apply_chat_template,
        say=console.say,
    )
    tools = model.toolbox.schemas if model.toolbox else None
    template = settings.apply_chat_template
    ids = [render_prompt(p.text, model.tokenizer, template, tools) for p in prompts]
    limit = settings.max_prompt_len
    kept, kept_ids, dropped = filter_prompt_lengths(prompts, ids, limit, spec=spec)
    if dropped:
        console.say(
            f"vime: {spec}: dropped {dropped} of {len(prompts)} prompts longer than "
            f"--rollout-max-prompt-len {limit}"
        )
    return kept, {p.index: i for p, i in zip(kept, kept_ids, strict=True)}, dropped


def _embedded_checkpoint(output_dir: str, seed: int) -> str:
    from vime.data.tasks import CHARSET
    from vime.models.embedded import write_embedded_checkpoint

    return write_embedded_checkpoint(
        os.path.join(output_dir, EMBEDDED_MODEL_DIR), charset=CHARSET, seed=seed
    )


def _tokenizer(checkpoint_dir: str, *, embedded: bool) -> Any:
    """The checkpoint's tokenizer; the embedded model's without importing transformers'
    auto classes (seconds of the default run's start)."""
    if embedded:
        from vime.models.embedded import load_tokenizer

        return load_tokenizer(checkpoint_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)


def _task(spec: str | None) -> Any:
    """The task whose reward scores ``spec``'s prompts: a built-in task, a reasoning-gym
    task, or None for a file."""
    if is_gym_spec(spec):
        return gym_task(spec)
    if is_verifiers_spec(spec):
        return VerifiersTask(spec)
    name = builtin_task_of(spec or "")
    if name is None:
        return None
    from vime.data.tasks import get_task

    return get_task(name)
