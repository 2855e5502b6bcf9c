"""``RolloutManager``: prompts in, a scored ``RolloutBatch`` with advantages out.

Where it fits: the first half of every step of ``vime.trainer``. It draws
``--rollout-batch-size`` prompts from the ``PromptSource``, asks the engines
for ``--n-samples-per-prompt`` completions each, scores them with the
``RewardScorer``, optionally drops groups whose rewards all agree (dynamic
sampling), and turns the rest into the token-level ``RolloutBatch`` both
training backends consume. It also scores held-out prompts for evaluation.

A sample whose reward failed stays in the batch (so the batch keeps its shape)
with an all-zero loss mask and advantage 0: it adds nothing to the gradient and
is counted in ``rollout/reward_failures`` (over every sample scored in the
rollout, filtered groups included). The advantages of the others are what they
would be if the failed samples had never been drawn: the built-in estimators get
a ``valid`` mask and compute each group over its scored samples only. A custom
estimator that takes no ``valid`` keyword sees a failed sample as one that scored
its group's mean over the rewards that did not fail (so the group mean is right,
but a spread or a group size is the whole group's). A group with fewer than two
rewards that did not fail carries no signal and counts as agreeing.

Dynamic sampling (``--dynamic-sampling-filter``): each round draws
ceil(``--over-sampling-factor`` × the groups still missing) new prompts, drops
the groups whose rewards all agree and keeps the first of the others, in prompt
order, until the batch is full; passing groups beyond that are counted
(``rollout/groups_surplus``) and not trained. After
``--dynamic-sampling-max-rounds`` rounds a short batch is filled with dropped
groups (advantage 0), counted in ``rollout/groups_short``. Every drawn prompt is
consumed. ``DataExhausted`` when the prompts run out before the batch is full.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vime.algo import compute_advantages, load_function
from vime.data.batch import RolloutBatch
from vime.data.prompts import Prompt, PromptSource
from vime.errors import ConfigError
from vime.rollout.agent import AgentRollouts
from vime.rollout.decoding import decode_turns, stop_token_ids
from vime.rollout.rewards import RewardInput, RewardScorer
from vime.rollout.settings import RolloutSettings
from vime.rollout.tools.toolbox import ERROR_KINDS
from vime.rollout.types import Completion, SamplingParams

PROMPT_INDICES_KEY = "rollout/prompt_indices"


class DataExhausted(Exception):
    """Every epoch of the prompts has been used; the run ends after the last full rollout."""


@dataclass
class _Group:
    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float | None]
    responses: list[str]  # as the reward saw them (``RolloutManager.decode_all``)


def rollout_seed(seed: int, rollout_id: int, round_index: int = 0) -> int:
    """The sampling seed of one generation round: a function of the run seed and position
    alone, so a resumed run samples exactly what the uninterrupted run would have."""
    return (seed * 1_000_003 + rollout_id * 7919 + round_index * 104_729) % (2**31 - 1)


class RolloutManager:
    """Generation, reward and advantages for one rollout at a time."""

    def __init__(
        self,
        settings: RolloutSettings,
        engines: Any,
        tokenizer: Any,
        scorer: RewardScorer,
        source: PromptSource,
        prompt_ids: dict[int, list[int]],
        *,
        is_correct: Callable[[str, Any], bool] | None = None,
        warn: Callable[[str], None] = print,
        agent: AgentRollouts | None = None,
    ) -> None:
        """``agent``: multi-turn trajectories (``--tools`` or a custom generate function)
        in place of one engine call per prompt."""
        self.settings = settings
        self.engines = engines
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.source = source
        self.prompt_ids = prompt_ids  # Prompt.index -> token ids
        self.is_correct = is_correct
        self.warn = warn
        self.agent = agent
        self.stop_token_ids = stop_token_ids(
            settings.sampling.stop_token_ids, tokenizer.eos_token_id
        )
        self.advantage_fn = compute_advantages
        if settings.custom_advantage_function_path:
            self.advantage_fn = load_function(
                settings.custom_advantage_function_path, expected=compute_advantages
            )
        self._takes_valid = "valid" in inspect.signature(self.advantage_fn).parameters
        self._score_lock = threading.Lock()

    # ----- training rollouts ---------------------------------------------------------------

    def generate(self, rollout_id: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One rollout: ``rollout_batch_size`` groups, scored, with advantages."""
        settings = self.settings
        want = settings.batch_size
        start = time.perf_counter()
        kept: list[_Group] = []
        agreeing: list[_Group] = []
        rounds = drawn = surplus = 0
        generated_tokens = 0
        failures = 0
        while len(kept) < want:
            if rounds > 0 and (
                not settings.dynamic_sampling_filter
                or rounds >= settings.dynamic_sampling_max_rounds
            ):
                break
            if self.source.exhausted:
                break
            ask = want - len(kept)
            if settings.dynamic_sampling_filter:
                ask = math.ceil(ask * settings.over_sampling_factor)
            prompts = self.source.next_batch(ask)
            drawn += len(prompts)
            groups = self._sample(prompts, rollout_seed(settings.seed, rollout_id, rounds))
            # The scorer describes its latest call only: report each round's failures.
            warning = self.scorer.failure_warning()
            if warning:
                where = f"rollout {rollout_id}" + (f" round {rounds}" if rounds else "")
                self.warn(f"vime: {where}: {warning}")
            rounds += 1
            for group in groups:
                generated_tokens += sum(c.generated for c in group.completions)
                failures += sum(r is None for r in group.rewards)
                if settings.dynamic_sampling_filter and _all_agree(group.rewards):
                    agreeing.append(group)
                elif len(kept) < want:
                    kept.append(group)
                else:
                    surplus += 1
        # Short after the last round: fill with agreeing groups (advantage 0) so the batch
        # keeps the shape the plan expects; counted so the user sees it.
        short = want - len(kept)
        kept += agreeing[:short]
        if len(kept) < want:
            raise DataExhausted(f"the prompts ran out during rollout {rollout_id}")
        elapsed = time.perf_counter() - start
        metrics = self.batch_metrics(kept, failures=failures, drawn=drawn)
        metrics["perf/rollout_time_s"] = elapsed
        metrics["perf/rollout_tokens_per_s"] = generated_tokens / max(elapsed, 1e-9)
        if settings.dynamic_sampling_filter:
            metrics["rollout/groups_filtered"] = float(len(agreeing) - max(0, short))
            metrics["rollout/groups_short"] = float(max(0, short))
            metrics["rollout/groups_surplus"] = float(surplus)
        return self.to_batch(kept), metrics

    def batch_metrics(self, kept: list[_Group], *, failures: int, drawn: int) -> dict[str, Any]:
        """Reward, length and accuracy figures of the groups a rollout trains, and which
        prompts they are (``PROMPT_INDICES_KEY``: their dataset rows, in batch order)."""
        rewards = [r for g in kept for r in g.rewards if r is not None]
        lengths = [len(c.response_ids) for g in kept for c in g.completions]
        truncated = [c.finish_reason == "length" for g in kept for c in g.completions]
        metrics = {
            "rollout/reward_mean": _mean(rewards),
            "rollout/reward_std": _std(rewards),
            "rollout/reward_min": min(rewards, default=math.nan),
            "rollout/reward_max": max(rewards, default=math.nan),
            "rollout/response_len_mean": _mean(lengths),
            "rollout/truncated_frac": _mean(truncated),
            "rollout/reward_failures": float(failures),
            "rollout/prompts_drawn": float(drawn),
            # A list, not a figure (TensorBoard and wandb skip it): metrics.jsonl then says
            # which rows each rollout trained, across resumes too (bench/soak.py reads it).
            PROMPT_INDICES_KEY: [g.prompt.index for g in kept],
        }
        if self.is_correct is not None:
            metrics["rollout/accuracy"] = _mean(self._correct(kept))
        if self.agent is not None:
            metrics.update(agent_metrics([c for g in kept for c in g.completions]))
        return metrics

    def _sample(self, prompts: Sequence[Prompt], seed: int) -> list[_Group]:
        params = self.sampling_params(seed)
        return self.score(prompts, self.complete(prompts, self.ids(prompts), params))

    def complete(
        self, prompts: Sequence[Prompt], ids: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt from every engine: one call, or with an
        agent one trajectory each, turn by turn."""
        if self.agent is not None:
            return self.agent.generate(prompts, ids, params)
        return self.engines.generate(ids, params)

    def sampling_params(self, seed: int) -> SamplingParams:
        """The training rollouts' sampling settings, drawn with ``seed``."""
        sampling = self.settings.sampling
        return SamplingParams(
            n=sampling.n_samples_per_prompt,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_response_len,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
        )

    def ids(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        return [self.prompt_ids[p.index] for p in prompts]

    def score(self, prompts: Sequence[Prompt], completions: list[list[Completion]]) -> list[_Group]:
        """Each prompt's completions, decoded and scored, as one group. One caller at a
        time (the asynchronous producer scores in a thread of its own while eval may)."""
        with self._score_lock:
            return self._score(prompts, completions)

    def _score(
        self, prompts: Sequence[Prompt], completions: list[list[Completion]]
    ) -> list[_Group]:
        flat = [c for group in completions for c in group]
        # A trajectory's reward reads its final answer (the last model turn) as the
        # response, and the whole of it, tool turns included, as the trajectory.
        answers = [c.response_ids[_agent(c).get("answer_start", 0) :] for c in flat]
        texts = self.decode_all(answers)
        # Only a trajectory with turns before its answer reads differently as a whole.
        longer = [k for k, c in enumerate(flat) if _agent(c).get("answer_start")]
        whole = list(texts)
        decoded = self.decode_all([flat[k].response_ids for k in longer])
        for k, text in zip(longer, decoded, strict=True):
            whole[k] = text
        n = len(completions[0]) if completions else 0
        inputs = [
            RewardInput(
                prompt=self._prompt_text(p, group[0].prompt_ids),
                response=texts[g * n + j],
                label=p.label,
                metadata={**p.metadata, **_agent(group[j]).get("metadata", {})},
                group=g,
                trajectory=whole[g * n + j],
            )
            for g, (p, group) in enumerate(zip(prompts, completions, strict=True))
            for j in range(len(group))
        ]
        own = [_agent(c).get("reward") for c in flat]
        if all(r is not None for r in own):
            rewards = [float(r) for r in own]
        else:
            rewards = self.scorer.score_sync(inputs)
            rewards = [r if o is None else float(o) for r, o in zip(rewards, own, strict=True)]
        return [
            _Group(
                p,
                list(group[0].prompt_ids),
                group,
                rewards[g * n : (g + 1) * n],
                texts[g * n : (g + 1) * n],
            )
            for g, (p, group) in enumerate(zip(prompts, completions, strict=True))
        ]

    def _prompt_text(self, prompt: Prompt, ids: list[int]) -> str:
        """The prompt as the reward sees it: its text, or for a row of chat messages the
        templated prompt the model was given (rewards take text, as they do in slime)."""
        if isinstance(prompt.text, str):
            return prompt.text
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_all(self, responses: Sequence[Sequence[int]]) -> list[str]:
        """Each response as the reward sees it (``vime.rollout.decoding.decode_turns``)."""
        return decode_turns(self.tokenizer, responses, self.stop_token_ids)

    def to_batch(self, groups: list[_Group]) -> RolloutBatch:
        """The groups as the token-level batch training takes, advantages computed."""
        n = self.settings.sampling.n_samples_per_prompt
        rewards = []
        for group in groups:
            valid = [r for r in group.rewards if r is not None]
            fill = sum(valid) / len(valid) if valid else 0.0
            # For an estimator without ``valid``: a failed sample gets its group's mean
            # reward, so the group mean stays what the scored samples make it.
            rewards += [fill if r is None else r for r in group.rewards]
        scored = torch.tensor([r is not None for g in groups for r in g.rewards])
        extra = {"valid": scored} if self._takes_valid else {}
        advantages = self.advantage_fn(
            torch.tensor(rewards, dtype=torch.float64),
            n,
            self.settings.advantage_estimator,
            **extra,
        ).tolist()
        tokens, prompt_lengths, masks, logps, advs = [], [], [], [], []
        i = 0
        for group in groups:
            for completion, reward in zip(group.completions, group.rewards, strict=True):
                if self.settings.use_tis and len(completion.log_probs) != len(
                    completion.response_ids
                ):
                    raise ConfigError(
                        "--use-tis weights each token by the engine's log-prob, and the engine "
                        f"returned {len(completion.log_probs)} log-probs for a response of "
                        f"{len(completion.response_ids)} tokens; run without --use-tis (with "
                        "--max-staleness, give --no-use-tis)"
                    )
                ok = reward is not None
                # Its own prompt: an endpoint agent's trajectory follows the prompt it rendered.
                tokens.append(list(completion.prompt_ids) + list(completion.response_ids))
                prompt_lengths.append(len(completion.prompt_ids))
                mask = completion.loss_mask or [1] * len(completion.response_ids)
                masks.append([m * int(ok) for m in mask])
                logps.append(list(completion.log_probs))
                advs.append(advantages[i] if ok else 0.0)
                i += 1
        return RolloutBatch(tokens, prompt_lengths, masks, advs, rollout_log_probs=logps)

    def _correct(self, groups: list[_Group]) -> list[bool]:
        return [bool(self.is_correct(text, g.prompt.label)) for g in groups for text in g.responses]

    # ----- evaluation ----------------------------------------------------------------------

    def evaluate(self, prompts: Sequence[Prompt], prompt_ids: dict[int, list[int]]) -> dict:
        """Mean reward and pass@1 on held-out prompts; nothing is trained."""
        sampling = self.settings.sampling
        greedy = sampling.eval_temperature == 0
        params = SamplingParams(
            n=sampling.eval_n_samples_per_prompt,
            temperature=sampling.eval_temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy else sampling.top_k,
            max_new_tokens=sampling.max_response_len,
            stop_token_ids=self.stop_token_ids,
            seed=rollout_seed(self.settings.seed, -1),
        )
        # Its own id table, never swapped in: the asynchronous producer reads the training
        # one from its thread meanwhile.
        ids = [prompt_ids[p.index] for p in prompts]
        groups = self.score(prompts, self.complete(prompts, ids, params))
        rewards = [r for g in groups for r in g.rewards if r is not None]
        if self.is_correct is not None:
            correct = self._correct(groups)
        else:  # binary rewards (math, exact): a sample is correct when it scores 1
            correct = [r is not None and r >= 1.0 for g in groups for r in g.rewards]
        metrics = {
            "eval/reward_mean": _mean(rewards),
            "eval/pass@1": _mean(correct),
            "eval/num_prompts": float(len(prompts)),
        }
        if self.agent is not None:
            calls = agent_metrics([c for g in groups for c in g.completions])
            metrics["eval/calling_frac"] = calls["agent/calling_frac"]
        return metrics

    def state_dict(self) -> dict:
        return {"prompts": self.source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["prompts"])


def _agent(completion: Completion) -> dict[str, Any]:
    return completion.extra.get("agent", {})


def agent_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """Per rollout: turns, tool calls and their errors by kind, tool seconds, the
    trajectories cut by ``--max-turns`` or the budget, model against environment tokens."""
    stats = [_agent(c) for c in completions]
    turns = [s.get("turns", 1) for s in stats]
    calls = [s.get("tool_calls", 0) for s in stats]
    model = [c.generated for c in completions]
    env = [len(c.response_ids) - m for c, m in zip(completions, model, strict=True)]
    metrics = {
        "agent/turns_mean": _mean(turns),
        "agent/turns_max": float(max(turns, default=0)),
        "agent/tool_calls": float(sum(calls)),
        "agent/calling_frac": _mean([k > 0 for k in calls]),
        "agent/tool_seconds": float(sum(s.get("tool_seconds", 0.0) for s in stats)),
        "agent/model_tokens_mean": _mean(model),
        "agent/env_tokens_mean": _mean(env),
        "agent/endpoint_drift": float(sum(s.get("drift", 0) for s in stats)),
    }
    for cut in ("max_turns", "budget"):
        metrics[f"agent/cut_{cut}"] = float(sum(s.get("cut") == cut for s in stats))
    for kind in ERROR_KINDS:
        errors = sum(s.get("tool_errors", {}).get(kind, 0) for s in stats)
        metrics[f"agent/tool_errors_{kind}"] = float(errors)
    return metrics


def _all_agree(rewards: list[float | None]) -> bool:
    valid = [r for r in rewards if r is not None]
    return len(valid) < 2 or max(valid) - min(valid) < 1e-9


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0 if values else math.nan
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
