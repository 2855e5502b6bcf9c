"""Multi-turn rollouts: each sample is a coroutine that asks the engines for turns.

Where it fits: with ``--tools`` or ``--custom-generate-function-path`` the
``RolloutManager`` hands its prompts to :class:`AgentRollouts` instead of one
engine call. Every sample (prompt x ``--n-samples-per-prompt``) runs a generate
function ``async fn(sample: AgentSample, engine: EngineHandle) -> Trajectory``
(slime's custom-generate seam; the built-in tool loop, ``vime.rollout.tools.loop``,
is one). The function extends the prompt with the engine's tokens (mask 1, their
log-probs) and its own environment tokens (mask 0); it returns them as a
:class:`Trajectory`, which becomes a ``Completion`` with a ``loss_mask``: token in,
token out, nothing is decoded and re-tokenized on the way to training.

Turns are batched in lock step: a call goes to the engines once every live sample
has asked for its next turn (tools run concurrently meanwhile). Each turn is seeded
by its sample and its number alone (``SamplingParams.prompt_indices``), so a rollout
draws the same tokens however the turns were grouped into calls or split over
engines, and a resumed run continues identically.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vime.algo.custom import load_function
from vime.data.prompts import Prompt
from vime.errors import ConfigError
from vime.rollout.types import Completion, SamplingParams

# Turn t of sample i is seeded as prompt index i * CALLS_PER_SAMPLE + t.
CALLS_PER_SAMPLE = 1 << 16

Send = Callable[[list[list[int]], SamplingParams], Awaitable[list[list[Completion]]]]


@dataclass(frozen=True)
class AgentSample:
    """One trajectory to generate: its prompt row, the prompt's token ids (rendered with
    the tools when there are any), its place ``index`` in the rollout (group * n + j)
    and ``sample_index`` j within its group."""

    prompt: Prompt
    prompt_ids: list[int]
    index: int
    sample_index: int


@dataclass(frozen=True)
class Turn:
    """What the engine generated for one request: ids (the stop token kept, as EOS is),
    one log-prob per id, ``finish_reason`` "stop" or "length"."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    weight_versions: tuple[int, int] | None = None


@dataclass
class Trajectory:
    """Everything after the prompt: the model's tokens (``loss_mask`` 1) and the
    environment's (0), with the behaviour log-probs of the model's (0.0 elsewhere).

    ``reward``: the function's own (None: the run's reward scores it). ``metadata``
    reaches the reward with the prompt's. ``answer_start``: where the final answer
    (the last model turn) starts in ``response_ids``; the reward's ``response`` is
    the text from there, its ``trajectory`` the whole. ``finish_reason`` "length"
    marks a trajectory cut short; ``cut`` says by what ("budget", "max_turns").
    ``turns`` (model turns, counted by ``add_turn``), ``tool_calls``, ``tool_errors``
    (by kind) and ``tool_seconds`` feed the metrics. ``prompt_ids``: the prompt the
    trajectory follows when the function rendered its own (the OpenAI endpoint's agents,
    ``vime.rollout.endpoint``); None: the sample's. ``drift``: that endpoint's requests
    that did not extend the trajectory (``agent/endpoint_drift``).
    """

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    cut: str | None = None
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    answer_start: int = 0
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    tool_seconds: float = 0.0
    turns: int = 0
    prompt_ids: list[int] | None = None
    drift: int = 0

    def add_turn(self, turn: Turn) -> None:
        """Append the model's tokens; they are now the final answer, until env tokens follow."""
        self.turns += 1
        self.answer_start = len(self.response_ids)
        self.response_ids += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.log_probs += turn.log_probs
        self.finish_reason = turn.finish_reason

    def add_env(self, token_ids: Sequence[int]) -> None:
        """Append tokens the environment wrote: context for training, never trained."""
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)


class EngineHandle:
    """One sample's way to the engines: ``await generate(ids)`` gives the next turn.

    ``ids`` is the whole context (prompt and everything after it); the engine's
    prefix cache serves the part earlier turns already saw. ``max_new_tokens``
    defaults to the room left in the response budget of ``ids``. The handle keeps
    the oldest and newest weight version its turns were sampled with.
    """

    def __init__(self, batcher: LockStep, sample: AgentSample, budget: int) -> None:
        self._batcher, self._sample, self.budget = batcher, sample, budget
        self.turns = 0
        self.weight_versions: tuple[int, int] | None = None

    def room(self, ids: Sequence[int]) -> int:
        """Response tokens left for a context of ``ids``."""
        return max(0, self.budget - (len(ids) - len(self._sample.prompt_ids)))

    async def generate(self, ids: Sequence[int], max_new_tokens: int | None = None) -> Turn:
        room = self.room(ids) if max_new_tokens is None else max_new_tokens
        if self.turns >= CALLS_PER_SAMPLE:
            raise RuntimeError(f"sample {self._sample.index} asked for over {self.turns} turns")
        stream = self._sample.index * CALLS_PER_SAMPLE + self.turns
        self.turns += 1
        completion = await self._batcher.request(stream, list(ids), room)
        versions = completion.weight_versions
        if versions is not None:
            old = self.weight_versions
            self.weight_versions = (
                versions
                if old is None
                else (
                    min(old[0], versions[0]),
                    max(old[1], versions[1]),
                )
            )
        return Turn(
            list(completion.response_ids),
            list(completion.log_probs),
            completion.finish_reason,
            versions,
        )


class LockStep:
    """Collects the live samples' requests and sends them as one call once every live
    sample waits (or has finished): deterministic calls, as large as they can be."""

    def __init__(self, send: Send, params: SamplingParams, live: int) -> None:
        self._send, self._params, self._live = send, params, live
        self._waiting: list[tuple[int, list[int], int, asyncio.Future[Completion]]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def request(self, stream: int, ids: list[int], max_new: int) -> Completion:
        if max_new <= 0:
            return Completion(ids, [], [], "length")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._waiting.append((stream, ids, max_new, future))
        self._maybe_flush()
        return await future

    def finished(self) -> None:
        """One sample's function returned (or raised): no more requests from it."""
        self._live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._waiting and len(self._waiting) >= self._live and self._flushing is None:
            batch = sorted(self._waiting, key=lambda r: r[0])
            self._waiting = []
            self._flushing = asyncio.ensure_future(self._flush(batch))

    async def _flush(self, batch: list[tuple[int, list[int], int, Any]]) -> None:
        try:
            params = dataclasses.replace(
                self._params,
                n=1,
                max_new_tokens=max(r[2] for r in batch),
                prompt_indices=tuple(r[0] for r in batch),
            )
            out = await self._send([r[1] for r in batch], params)
            for (_, _, max_new, future), (completion,) in zip(batch, out, strict=True):
                future.set_result(_cut_to(completion, max_new))
        except BaseException as err:
            # The samples waiting on this call raise it; a cancellation also ends the task.
            for *_, future in batch:
                if not future.done():
                    future.set_exception(err)
            if not isinstance(err, Exception):
                raise
        finally:
            self._flushing = None
        self._maybe_flush()


def _cut_to(completion: Completion, max_new: int) -> Completion:
    """A turn sampled with a larger budget than its own, cut to it: the kept tokens are
    exactly what a call with ``max_new`` would have drawn (same seed, causal)."""
    if len(completion.response_ids) <= max_new:
        return completion
    return dataclasses.replace(
        completion,
        response_ids=list(completion.response_ids[:max_new]),
        log_probs=list(completion.log_probs[:max_new]),
        finish_reason="length",
    )


GenerateFn = Callable[[AgentSample, EngineHandle], Awaitable[Trajectory]]


async def _reference_generate(sample: AgentSample, engine: EngineHandle) -> Trajectory:
    """The seam's contract, for ``load_function``'s signature check."""
    raise NotImplementedError


def load_generate_function(spec: str) -> GenerateFn:
    """``--custom-generate-function-path MODULE:FN``: an ``async def fn(sample, engine)``."""
    return load_async_function(spec, "--custom-generate-function-path", _reference_generate)


def load_async_function(spec: str, flag: str, expected: Callable[..., Any]) -> Any:
    """The ``async`` function ``flag`` names by ``spec`` (``MODULE:FN``), taking
    ``expected``'s parameters; a one-line ConfigError otherwise."""
    try:
        fn = load_function(spec, expected=expected)
    except ValueError as err:
        raise ConfigError(f"{flag} {spec}: {err}") from None
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    if not inspect.iscoroutinefunction(call):
        params = ", ".join(inspect.signature(expected).parameters)
        raise ConfigError(
            f"{flag} {spec}: {getattr(fn, '__name__', fn)} is not async; define it with "
            f"'async def fn({params})'"
        )
    return fn


class AgentRollouts:
    """Runs one generate function over every sample of a request; the manager's
    multi-turn stand-in for ``EngineGroup.generate`` / ``submit``."""

    def __init__(
        self,
        fn: GenerateFn,
        engines: Any,
        budget: int,
        *,
        name: str = "",
        close: Callable[[], object] | None = None,
    ) -> None:
        self.fn, self.engines, self.budget = fn, engines, budget
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self._close = close

    def close(self) -> None:
        """Release what the generate function holds (the OpenAI endpoint's server)."""
        if self._close is not None:
            self._close()

    def generate(
        self, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` trajectories per prompt, over every engine (one call per turn)."""

        async def send(ids: list[list[int]], turn: SamplingParams) -> list[list[Completion]]:
            return await asyncio.to_thread(self.engines.generate, ids, turn)

        return asyncio.run(self.run(prompts, prompt_ids, params, send))

    def generate_on(
        self,
        engine: int,
        prompts: Sequence[Prompt],
        prompt_ids: Sequence[list[int]],
        params: SamplingParams,
        actor: Any = None,
    ) -> list[list[Completion]]:
        """As :meth:`generate`, every turn on engine ``engine`` (the asynchronous producer's
        calls, each in a thread of its own), on its ``actor`` when given: a call whose
        engine is restarted fails whole, and is sent again from its first turn."""
        from vime.ray.errors import wait_all

        def call(ids: list[list[int]], turn: SamplingParams) -> list[list[Completion]]:
            ref = self.engines.submit(engine, ids, turn, actor)
            (out,) = wait_all([ref], "generating turns")
            return out

        async def send(ids: list[list[int]], turn: SamplingParams) -> list[list[Completion]]:
            return await asyncio.to_thread(call, ids, turn)

        return asyncio.run(self.run(prompts, prompt_ids, params, send))

    async def run(
        self,
        prompts: Sequence[Prompt],
        prompt_ids: Sequence[list[int]],
        params: SamplingParams,
        send: Send,
    ) -> list[list[Completion]]:
        n = params.n
        first = params.first_prompt_index * n
        samples = [
            AgentSample(p, list(ids), first + g * n + j, j)
            for g, (p, ids) in enumerate(zip(prompts, prompt_ids, strict=True))
            for j in range(n)
        ]
        batcher = LockStep(send, params, len(samples))

        async def one(sample: AgentSample) -> Completion:
            handle = EngineHandle(batcher, sample, self.budget)
            try:
                trajectory = await self.fn(sample, handle)
            finally:
                batcher.finished()
            return self._completion(sample, trajectory, handle)

        flat = await asyncio.gather(*(one(s) for s in samples))
        return [list(flat[g * n : (g + 1) * n]) for g in range(len(prompts))]

    def _completion(self, sample: AgentSample, traj: Any, handle: EngineHandle) -> Completion:
        where = f"{self.name}: sample {sample.index}"
        if not isinstance(traj, Trajectory):
            raise TypeError(f"{where}: returned {type(traj).__name__}, expected a Trajectory")
        sizes = (len(traj.response_ids), len(traj.loss_mask), len(traj.log_probs))
        if len(set(sizes)) != 1:
            raise ValueError(
                f"{where}: response_ids, loss_mask and log_probs differ in length {sizes}; "
                "one mask value and one log-prob per response token"
            )
        if any(m not in (0, 1) for m in traj.loss_mask):
            raise ValueError(f"{where}: loss_mask holds values other than 0 and 1")
        stats = {
            "turns": traj.turns,
            "tool_calls": traj.tool_calls,
            "tool_errors": dict(traj.tool_errors),
            "tool_seconds": traj.tool_seconds,
            "cut": traj.cut,
            "answer_start": traj.answer_start,
            "reward": traj.reward,
            "metadata": dict(traj.metadata),
            "drift": traj.drift,
        }
        prompt = sample.prompt_ids if traj.prompt_ids is None else traj.prompt_ids
        return Completion(
            list(prompt),
            list(traj.response_ids),
            list(traj.log_probs),
            traj.finish_reason,
            extra={"agent": stats},
            weight_versions=handle.weight_versions,
            loss_mask=list(traj.loss_mask),
        )
