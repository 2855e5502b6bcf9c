"""Reward scoring: one float (or None) per sampled response.

Where it fits: the rollout manager decodes each completion into a
:class:`RewardInput` and awaits :meth:`RewardScorer.score` once per rollout;
advantages are computed from what comes back. The scorer is picked once from
its settings (:class:`RewardSettings`, built from the flags in ``vime.config``) by
:func:`build_reward_scorer`; config validation picks it first, so a missing or
broken choice fails at start-up, not after the first generation. In order of
precedence:

``--rm-url URL``
    POST ``{"prompt", "response", "label", "metadata", "trajectory", "sample_id"}``
    (JSON) per sample; the answer is a JSON number or ``{"reward": number}``. Dropped
    connections, attempts not answered within ``--rm-timeout``, 5xx and 429 are
    retried ``--rm-max-retries`` times with exponential backoff; any other 4xx fails
    at once. Every attempt for one sample carries the same ``sample_id``, also sent as
    the ``Idempotency-Key`` header: a retry after an answer that was lost on the way
    (or came too late) is the same request again, which a server can answer from
    what it answered before instead of scoring the sample twice.
``--custom-rm-path MODULE:FN``
    A user function, sync or ``async``, called positionally as
    ``fn(args, sample: RewardInput) -> float``, or with ``--group-rm`` once per
    prompt group as ``fn(args, samples: list[RewardInput]) -> list[float]``
    (same order as given). Sync functions run on worker threads so that
    ``--rm-timeout`` can abandon them; a thread that never returns cannot be
    killed and keeps its worker until it does.
``--rm-type math | exact``
    Final-answer match / stripped string match. ``math`` is math-verify's verdict, run
    in a process of its own (``vime.rollout.math_checker``), with vime's few rules
    around it (think tags, the last box, GSM8K labels: ``vime.rollout.math_answer``);
    without math-verify installed (``pip install -e '.[agents]'``) it is refused at
    start-up rather than scored by other rules.
``--rm-type builtin`` (the default for ``builtin:<task>`` and ``reasoning-gym:<task>`` data)
    The task's own ``reward(response, label)``, passed in by the caller (a reasoning-gym
    task's is its dataset's ``score_answer``: ``vime.data.reasoning_gym``).

The rule-based rewards (math, exact, builtin) compare against the prompt's
label: :func:`reward_needs_label` tells the prompt loader to refuse rows
without one, and a sample that still has none fails (None) rather than being
compared with the text "None".

A reward that cannot be computed is ``None``, never an exception: the function
raised, timed out, or returned something that is not a finite number (a bool
counts as 0/1). After each ``score`` call ``last_failure_count`` and
``last_failures`` (the first few messages) say what failed, for the
``rollout/reward_failures`` metric and one warning line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import http.client
import inspect
import json
import math
import numbers
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vime.errors import ConfigError
from vime.rollout.math_answer import math_reward
from vime.rollout.math_checker import MATH_VERIFY_MISSING, math_verify_installed

MAX_CONCURRENCY = 32  # reward calls in flight at once (threads, requests)
MAX_KEPT_FAILURES = 5
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
IDEMPOTENCY_HEADER = "Idempotency-Key"  # a remote reward's sample id, on every attempt
_NO_LABEL = "the prompt has no label to compare with (see --label-key)"

TaskReward = Callable[[str, Any], float]
_AsyncCall = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class RewardInput:
    """One sample to score; ``group`` is the index of its prompt in the rollout.

    ``prompt`` is the row's text, or for a row of chat messages the templated prompt the
    model was given; ``response`` the decoded completion without its final stop token
    (of a multi-turn trajectory: its final answer, the last model turn);
    ``trajectory`` everything after the prompt, tool turns included (for a single
    turn, the response).
    """

    prompt: str
    response: str
    label: Any
    metadata: dict = field(default_factory=dict)
    group: int = 0
    trajectory: str = ""


class RewardError(Exception):
    """A sample (or group) could not be scored; the message says why."""


@dataclass(frozen=True)
class RewardSettings:
    """The reward the flags pick (``--rm-*``, ``--custom-rm-path``, ``--group-rm``).

    ``task_data``: the prompts are a built-in or reasoning-gym task's, which brings its
    own reward.
    """

    rm_type: str | None
    url: str | None
    custom_path: str | None
    group: bool
    timeout_s: float
    max_retries: int
    task_data: bool


def exact_reward(response: str, label: Any) -> float:
    """1.0 when ``response`` equals ``label`` up to surrounding whitespace, else 0.0.

    Raises ``RewardError`` for a None label: there is nothing to compare with.
    """
    if label is None:
        raise RewardError(_NO_LABEL)
    return 1.0 if response.strip() == str(label).strip() else 0.0


# ---------------------------------------------------------------- choosing


def reward_source(settings: RewardSettings, has_task_reward: bool) -> str:
    """The reward ``settings`` pick: remote, custom, math, exact or task; ``ConfigError``
    for a choice that contradicts itself or none at all."""
    url, custom, rm_type = settings.url, settings.custom_path, settings.rm_type
    if url is not None and custom is not None:
        raise ConfigError("--rm-url and --custom-rm-path both pick the reward; give only one")
    picked = "--rm-url" if url is not None else "--custom-rm-path" if custom is not None else None
    if picked is not None and rm_type is not None:
        raise ConfigError(f"--rm-type {rm_type} and {picked} both pick the reward; give only one")
    if settings.group and custom is None:
        raise ConfigError("--group-rm needs --custom-rm-path MODULE:FN (the group function)")
    if url is not None:
        return "remote"
    if custom is not None:
        return "custom"
    if rm_type == "math" and not math_verify_installed():
        raise ConfigError(MATH_VERIFY_MISSING)
    if rm_type in ("math", "exact"):
        return rm_type
    if has_task_reward:
        return "task"
    if rm_type == "builtin":
        raise ConfigError(
            "--rm-type builtin scores with a built-in task's reward and needs --prompt-data "
            "builtin:<task> or reasoning-gym:<task>; for file data pass --rm-type math|exact, "
            "--custom-rm-path or --rm-url"
        )
    raise ConfigError(
        "no reward function for this data: pass --rm-type math|exact, "
        "--custom-rm-path MODULE:FN or --rm-url URL"
    )


def load_custom_reward(spec: str, group: bool) -> Callable:
    """Import ``--custom-rm-path`` and check it can be called as ``fn(args, sample(s))``."""
    # Deferred: vime.algo imports torch, which only a custom hook should cost here.
    from vime.algo.custom import load_function

    try:
        fn = load_function(spec)
    except ValueError as err:
        raise ConfigError(f"--custom-rm-path {spec}: {err}") from None
    shape = "fn(args, samples: list[RewardInput])" if group else "fn(args, sample: RewardInput)"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no introspectable signature: the first call will tell
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"--custom-rm-path {spec}: signature {signature} cannot be called as {shape}"
        ) from None
    return fn


def reward_needs_label(settings: RewardSettings) -> bool:
    """Whether the reward ``settings`` pick compares responses against each prompt's label.

    True for ``--rm-type math|exact`` and a built-in task's reward; False for
    ``--rm-url`` and ``--custom-rm-path``, which may score without one.
    """
    return reward_source(settings, settings.task_data) in ("math", "exact", "task")


def build_reward_scorer(
    settings: RewardSettings,
    task_reward: TaskReward | None = None,
    *,
    task_reads_trajectory: bool = False,
    hook_args: Any = None,
) -> RewardScorer:
    """The scorer ``settings`` ask for; ``task_reward`` is the built-in task's reward, if any
    (given the sample's ``trajectory`` in place of its response with
    ``task_reads_trajectory``). ``hook_args``: what a custom reward function is given as its
    first argument (``fn(args, sample)``: the run's flags), passed on unread."""
    source = reward_source(settings, task_reward is not None)
    timeout = settings.timeout_s
    if source == "remote":
        threads = _Threads()
        remote = _RemoteReward(settings.url, timeout, settings.max_retries, threads)
        return RewardScorer(f"remote {settings.url}", sample_fn=remote, threads=threads)
    if source == "custom":
        fn = load_custom_reward(settings.custom_path, settings.group)
        threads = _Threads()
        call = _custom_call(fn, hook_args, threads)
        name = f"custom {settings.custom_path}"
        if settings.group:
            return RewardScorer(name, group_fn=call, timeout=timeout, threads=threads)
        return RewardScorer(name, sample_fn=call, timeout=timeout, threads=threads)
    rule = {"math": math_reward, "exact": exact_reward, "task": task_reward}[source]
    assert rule is not None
    whole = task_reads_trajectory and source == "task"

    def call(sample: RewardInput) -> Any:
        # Every rule compares with the label; without one math_reward would match a
        # response that says "None".
        if sample.label is None:
            raise RewardError(_NO_LABEL)
        return rule(sample.trajectory if whole else sample.response, sample.label)

    # Rule-based rewards are cheap: a plain loop, no event loop, thread or timeout.
    return RewardScorer(source, inline_fn=call)


# ---------------------------------------------------------------- calling


class _Threads:
    """A private worker pool, so abandoned (timed-out) calls never block ``asyncio.run``."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CONCURRENCY, thread_name_prefix="vime-reward"
        )

    async def run(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _custom_call(fn: Callable, hook_args: Any, threads: _Threads) -> _AsyncCall:
    if inspect.iscoroutinefunction(fn):
        return functools.partial(fn, hook_args)

    async def call(arg: Any) -> Any:
        result = await threads.run(fn, hook_args, arg)
        # A sync wrapper may hand back a coroutine (e.g. a partial of an async fn).
        return await result if inspect.isawaitable(result) else result

    return call


class _Retry(Exception):
    """A remote failure worth another attempt (5xx, 429)."""


class _RemoteReward:
    def __init__(self, url: str, timeout: float, max_retries: int, threads: _Threads) -> None:
        self.url, self.timeout, self.max_retries, self.threads = url, timeout, max_retries, threads

    def _post(self, body: bytes, key: str) -> bytes:
        headers = {"Content-Type": "application/json", IDEMPOTENCY_HEADER: key}
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return reply.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:200].decode("utf-8", "replace").strip()
            message = f"HTTP {err.code} from {self.url}" + (f": {detail}" if detail else "")
            if err.code >= 500 or err.code == 429:
                raise _Retry(message) from None
            raise RewardError(message) from None

    async def __call__(self, sample: RewardInput) -> Any:
        # One key per sample, the same on each of its attempts (the server's dedup key).
        key = uuid.uuid4().hex
        payload = {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
            "trajectory": sample.trajectory,
            "sample_id": key,
        }
        body = json.dumps(payload, default=str).encode()
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))
            try:
                # urlopen's timeout is per socket read; wait_for bounds the whole call.
                raw = await asyncio.wait_for(self.threads.run(self._post, body, key), self.timeout)
            except TimeoutError:
                last = f"no answer from {self.url} within {self.timeout} s (--rm-timeout)"
            except (_Retry, OSError, http.client.HTTPException) as err:
                last = str(err) or type(err).__name__
            else:
                return _parse_reply(raw, self.url)
        tries = self.max_retries + 1
        raise RewardError(f"{last} (gave up after {tries} attempt{'s' * (tries > 1)})")


def _parse_reply(raw: bytes, url: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        raise RewardError(f"{url} answered non-JSON {raw[:60]!r}") from None
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise RewardError(f'{url} answered an object without "reward": {raw[:60]!r}')
        return value["reward"]
    return value


def _as_reward(value: Any) -> float:
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        # numpy / torch scalars; a many-element array stays as it is and fails below
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardError(f"returned non-finite {reward}")
    return reward


# ---------------------------------------------------------------- scorer


class RewardScorer:
    """Scores a rollout's samples concurrently; see the module docstring for the sources."""

    def __init__(
        self,
        name: str,
        *,
        sample_fn: _AsyncCall | None = None,
        group_fn: _AsyncCall | None = None,
        inline_fn: Callable[[RewardInput], Any] | None = None,
        timeout: float | None = None,
        threads: _Threads | None = None,
    ) -> None:
        if sum(fn is not None for fn in (sample_fn, group_fn, inline_fn)) != 1:
            raise ValueError("give exactly one of sample_fn, group_fn and inline_fn")
        self.name = name
        self._sample_fn, self._group_fn, self._inline_fn = sample_fn, group_fn, inline_fn
        self._timeout, self._threads = timeout, threads
        self.last_total = 0
        self.last_failure_count = 0
        self.last_failures: list[str] = []

    async def _call(self, fn: _AsyncCall, arg: Any, gate: asyncio.Semaphore) -> Any:
        async with gate:
            if self._timeout is None:
                return await fn(arg)
            return await asyncio.wait_for(fn(arg), self._timeout)

    def _describe(self, err: Exception) -> str:
        if isinstance(err, TimeoutError):
            return f"timed out after {self._timeout} s (--rm-timeout)"
        if isinstance(err, RewardError):
            return str(err)
        return f"raised {type(err).__name__}: {err}"[:300]

    def _score_inline(self, samples: list[RewardInput]) -> list[float | None]:
        """``inline_fn`` over ``samples`` in this thread: what ``score`` does, less the
        concurrency a cheap rule does not need (its cost would be most of the scoring)."""
        assert self._inline_fn is not None
        rewards: list[float | None] = [None] * len(samples)
        failures: list[str] = []
        for i, sample in enumerate(samples):
            try:
                rewards[i] = _as_reward(self._inline_fn(sample))
            except Exception as err:
                failures.append(f"sample {i}: {self._describe(err)}")
        self._record(rewards, failures)
        return rewards

    def _record(self, rewards: list[float | None], failures: list[str]) -> None:
        self.last_total = len(rewards)
        self.last_failure_count = sum(r is None for r in rewards)
        self.last_failures = failures[:MAX_KEPT_FAILURES]

    async def score(self, samples: list[RewardInput]) -> list[float | None]:
        """One reward per sample, in order; None where scoring failed (never raises)."""
        if self._inline_fn is not None:
            return self._score_inline(samples)
        rewards: list[float | None] = [None] * len(samples)
        failures: list[tuple[int, str]] = []
        # Made per call: an asyncio.Semaphore belongs to the loop that first uses it.
        gate = asyncio.Semaphore(MAX_CONCURRENCY)

        async def one(i: int) -> None:
            try:
                rewards[i] = _as_reward(await self._call(self._sample_fn, samples[i], gate))
            except Exception as err:
                failures.append((i, f"sample {i}: {self._describe(err)}"))

        async def group(g: int, members: list[int]) -> None:
            try:
                values = await self._call(self._group_fn, [samples[i] for i in members], gate)
                if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__iter__"):
                    raise RewardError(f"returned {type(values).__name__}, not a list of rewards")
                values = list(values)
                if len(values) != len(members):
                    raise RewardError(f"returned {len(values)} rewards for {len(members)} samples")
            except Exception as err:
                failures.append((members[0], f"group {g}: {self._describe(err)}"))
                return
            for i, value in zip(members, values, strict=True):
                try:
                    rewards[i] = _as_reward(value)
                except RewardError as err:
                    failures.append((i, f"sample {i} (group {g}): {err}"))

        if self._group_fn is None:
            await asyncio.gather(*(one(i) for i in range(len(samples))))
        else:
            groups: dict[int, list[int]] = {}
            for i, sample in enumerate(samples):
                groups.setdefault(sample.group, []).append(i)
            await asyncio.gather(*(group(g, members) for g, members in groups.items()))
        failures.sort()
        self._record(rewards, [message for _, message in failures])
        return rewards

    def score_sync(self, samples: list[RewardInput]) -> list[float | None]:
        """:meth:`score` for synchronous callers.

        ``asyncio.run`` is not allowed while this thread already runs an event
        loop (a notebook, an async caller); there the scoring runs on a fresh
        loop in a helper thread and this call blocks that loop until it is
        done, so async code should ``await score(...)`` instead.
        """
        if self._inline_fn is not None:
            return self._score_inline(samples)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score(samples))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as helper:
            return helper.submit(asyncio.run, self.score(samples)).result()

    def failure_warning(self) -> str | None:
        """One line about the last ``score`` call's failures, or None when all scored."""
        if not self.last_failure_count:
            return None
        return (
            f"reward ({self.name}): {self.last_failure_count} of {self.last_total} samples "
            f"failed and have no reward; first: {'; '.join(self.last_failures[:3])}"
        )

    def close(self) -> None:
        """Release the worker threads (calls still running finish on their own)."""
        if self._threads is not None:
            self._threads.close()
