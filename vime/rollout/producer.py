"""``RolloutProducer``: the engines generate while the trainer trains (``--max-staleness``).

Where it fits: with ``--max-staleness K`` >= 1, ``vime.trainer`` takes each rollout's
batch from a producer instead of ``RolloutManager.generate``. A thread of the driver
keeps every engine busy: ``calls_per_engine`` calls of ``groups_per_call`` prompts
each queued on it, a new call admitted the moment one returns, as far as
``vime.rollout.staleness.Admission`` allows (at most K rollouts ahead of the weights
the engines serve). Each call's groups are scored as soon as it returns, while the
others generate, and wait in ``ReadyGroups``; ``take`` hands the trainer the
``--rollout-batch-size`` oldest groups (by weight version, then admission) that are at
most K versions old, whatever order they finished in. New
weights reach the engines while they generate (``vime.rollout.step_gate``). With
multi-turn rollouts (``vime.rollout.agent``) a call is its groups' turn loop, run in a
driver thread, every turn on that call's engine. A group's version is the oldest that
sampled one of its tokens; a trajectory with no model turn (a custom generate function
may return one) has no such token and counts for nothing there, and a group of nothing
but those has the version its call was admitted at; it trains as in the synchronous loop.

Data: prompts are drawn from the run's one ``PromptSource`` (each read once per
epoch). A group filtered out by dynamic sampling is consumed, as in the synchronous
loop; a group that finished too late goes back to be generated again, so nothing is
lost. ``state_dict`` names what was drawn and not yet trained, which a checkpoint
keeps and a resumed run generates first. A call whose engine dies or hangs is sent
again whole, with its own seed, to an engine that serves the run's weights (its
trajectories regenerated from their start); the engine is restarted by the trainer's
thread, which owns the training ranks its weights come from (``take``,
``vime.ray.engines.EngineGroup.recover``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from vime.data.batch import RolloutBatch
from vime.data.prompts import Prompt
from vime.ray.errors import ActorFailure, wait_all
from vime.rollout.manager import (
    DataExhausted,
    RolloutManager,
    _all_agree,
    rollout_seed,
)
from vime.rollout.settings import RolloutSettings
from vime.rollout.staleness import Admission, ReadyGroups

# How long the producer's thread waits for an engine call before it looks again for
# room to admit (new weights) or a stop.
POLL_S = 0.05


@dataclass(frozen=True)
class ProducerSettings:
    """How far ahead and in what pieces the producer generates."""

    batch_size: int  # groups a rollout trains (--rollout-batch-size)
    max_staleness: int  # K >= 1
    groups_per_call: int  # prompts per engine call
    dynamic_sampling_filter: bool
    seed: int
    calls_per_engine: int = 2  # one generating, one queued behind it: the engine never waits

    @classmethod
    def for_engines(
        cls, rollout: RolloutSettings, max_staleness: int, num_engines: int
    ) -> ProducerSettings:
        """The producer of a run with ``rollout``'s batches over ``num_engines`` engines."""
        per_engine = math.ceil(rollout.batch_size / max(1, num_engines))
        return cls(
            batch_size=rollout.batch_size,
            max_staleness=max_staleness,
            # Two calls per engine per rollout's share: admission every half rollout.
            groups_per_call=max(1, math.ceil(per_engine / 2)),
            dynamic_sampling_filter=rollout.dynamic_sampling_filter,
            seed=rollout.seed,
        )


@dataclass
class _Call:
    engine: int
    prompts: list[Prompt]
    version: int  # what the engines served when it was admitted
    admitted: int  # the admission number of its first group (Admission.started before it)
    params: Any = None  # its sampling settings, seed included: a resend draws the same
    actor: Any = None  # the engine actor it runs on


@dataclass
class _Ready:
    """A scored group, the oldest weight version that sampled it, its admission number."""

    group: Any
    version: int
    admitted: int


def _oldest_version(group: Any, admitted: int) -> int:
    """The oldest version that sampled a token of ``group``; ``admitted`` (the version
    served when its call started) for a group with no model token, which no version
    sampled (a generate function's trajectory without a model turn)."""
    sampled = [c for c in group.completions if c.generated]
    if any(c.weight_versions is None for c in sampled):
        raise RuntimeError("an engine returned completions without weight versions")
    return min((c.weight_versions[0] for c in sampled), default=admitted)


class RolloutProducer:
    """Keeps the engines generating in a thread of its own; ``take`` gives whole batches."""

    def __init__(
        self,
        settings: ProducerSettings,
        manager: RolloutManager,
        engines: Any,
        *,
        weight_version: int = 0,
        pending: list[int] | None = None,
    ) -> None:
        """``weight_version``: what the engines serve now, the rollout the run starts at;
        ``pending``: prompts a checkpoint names as drawn and not trained (generated first)."""
        self.settings = settings
        self.manager, self.engines = manager, engines
        self.admission = Admission(
            settings.batch_size, settings.max_staleness, first_rollout=weight_version
        )
        self.ready: ReadyGroups[_Ready] = ReadyGroups(
            lambda r: r.version, settings.max_staleness, order=lambda r: (r.version, r.admitted)
        )
        by_index = {p.index: p for p in manager.source.prompts}
        self._retry: collections.deque[Prompt] = collections.deque(
            by_index[i] for i in pending or ()
        )
        self._cond = threading.Condition()
        self._in_flight: dict[Any, _Call] = {}
        self._resend: collections.deque[_Call] = collections.deque()  # their engine died
        self._engine_version = weight_version
        self._calls = 0  # engine calls made: each one's sampling seed
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._exhausted = False
        # Since the last take: what the trained batch's metrics report.
        self._counts = collections.Counter()
        self._last_take = time.perf_counter()
        # The last batch's groups: (prompt index, oldest weight version), for checks.
        self.last_taken: list[tuple[int, int]] = []
        self._thread = threading.Thread(target=self._run, name="vime-rollout-producer", daemon=True)
        # Multi-turn calls run their turn loop in a driver thread each (engine calls are
        # Ray refs otherwise): every call an engine may have queued.
        self._agent_threads = None
        if manager.agent is not None:
            self._agent_threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(engines.actors) * settings.calls_per_engine,
                thread_name_prefix="vime-agent",
            )

    # ----- the trainer's side ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def weights_synced(self, version: int) -> None:
        """The engines serve ``version`` now: more groups may start."""
        with self._cond:
            self._engine_version = version
            self._cond.notify_all()

    def take(self, rollout_id: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Rollout ``rollout_id``'s batch (blocks until one is ready) and its metrics."""
        waited = time.perf_counter()
        while True:
            if self.engines.needs_recovery():  # this thread's: the weights are the trainer's
                self.engines.recover()
            with self._cond:
                if self._error is not None:
                    raise self._error
                taken, stale = self.ready.take(self.settings.batch_size, rollout_id)
                if stale:  # finished too late for any rollout to come: generate them again
                    self.admission.discard(len(stale))
                    self._retry.extend(r.group.prompt for r in stale)
                    self._counts["stale"] += len(stale)
                    self._cond.notify_all()
                if taken:
                    break
                if self._exhausted and not (self._in_flight or self._retry or self._resend):
                    raise DataExhausted(f"the prompts ran out during rollout {rollout_id}")
                self._cond.wait(POLL_S)
        with self._cond:
            counts, self._counts = self._counts, collections.Counter()
            now, since = time.perf_counter(), self._last_take
            self._last_take = now
            in_flight = sum(len(c.prompts) for c in self._in_flight.values())
            buffered = len(self.ready)
        groups = [r.group for r in taken]
        self.last_taken = [(r.group.prompt.index, r.version) for r in taken]
        staleness = [rollout_id - v for _, v in self.last_taken]
        metrics = self.manager.batch_metrics(
            groups, failures=counts["failures"], drawn=counts["drawn"]
        )
        metrics.update(
            {
                "perf/rollout_time_s": now - waited,
                # What the engines generated since the last batch was taken, over that time.
                "perf/rollout_tokens_per_s": counts["tokens"] / max(now - since, 1e-9),
                "async/staleness_mean": sum(staleness) / len(staleness),
                "async/staleness_max": float(max(staleness)),
                "async/groups_stale_dropped": float(counts["stale"]),
                "async/groups_in_flight": float(in_flight),
                "async/buffer_groups": float(buffered),
            }
        )
        if self.settings.dynamic_sampling_filter:
            metrics["rollout/groups_filtered"] = float(counts["filtered"])
        return self.manager.to_batch(groups), metrics

    def state_dict(self) -> dict[str, Any]:
        """The data position a checkpoint keeps: the prompt source's, and the dataset
        indices of prompts drawn and not yet trained, both taken at one instant."""
        with self._cond:
            calls = [p for c in [*self._in_flight.values(), *self._resend] for p in c.prompts]
            ready = [r.group.prompt for r in self.ready.groups]
            pending = [p.index for p in [*self._retry, *calls, *ready]]
            return {**self.manager.state_dict(), "pending": pending}

    def close(self) -> None:
        """Stop admitting and let the thread end; calls in flight are left to Ray."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._agent_threads is not None:
            self._agent_threads.shutdown(wait=False, cancel_futures=True)

    # ----- the producer's thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                refs = list(self._in_flight)
                if not refs:
                    with self._cond:
                        self._cond.wait(POLL_S)
                    continue
                if self._agent_threads is None:
                    done, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
                else:
                    done, _ = concurrent.futures.wait(
                        refs, timeout=POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                for ref in done:
                    self._finish(ref)
        except BaseException as err:  # the trainer raises it from take()
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _admit(self) -> None:
        """Queue calls on every engine with room, as many groups as admission allows."""
        settings = self.settings
        with self._cond:
            for engine in range(len(self.engines.actors)):
                if not self.engines.ready(engine):  # lost, or waiting for its weights
                    continue
                busy = sum(c.engine == engine for c in self._in_flight.values())
                while busy < settings.calls_per_engine:
                    call = self._resend.popleft() if self._resend else self._new_call()
                    if call is None:
                        return
                    call.engine, call.version = engine, self._engine_version
                    call.actor = self.engines.actor(engine)
                    self._in_flight[self._submit(call)] = call
                    busy += 1

    def _new_call(self) -> _Call | None:
        """The next call's prompts, as many as admission allows, and its seed; None if
        there is none to make now."""
        settings = self.settings
        room = self.admission.room(self._engine_version)
        prompts = self._draw(min(room, settings.groups_per_call))
        if not prompts:
            return None
        admitted = self.admission.started
        self.admission.start(len(prompts))
        # Seeded by the rollout this producer started at and the call's number.
        seed = rollout_seed(settings.seed, self.admission.first_rollout, self._calls)
        self._calls += 1
        params = self.manager.sampling_params(seed)
        return _Call(-1, prompts, self._engine_version, admitted, params)

    def _submit(self, call: _Call) -> Any:
        """Start ``call`` on its engine's actor: a Ray ref, or a future of its multi-turn
        loop (every turn on that actor)."""
        ids = self.manager.ids(call.prompts)
        if self._agent_threads is None:
            return self.engines.submit(call.engine, ids, call.params, call.actor)
        generate = self.manager.agent.generate_on
        return self._agent_threads.submit(
            generate, call.engine, call.prompts, ids, call.params, call.actor
        )

    def _draw(self, n: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        while len(prompts) < n and self._retry:
            prompts.append(self._retry.popleft())
        if len(prompts) < n and not self.manager.source.exhausted:
            fresh = self.manager.source.next_batch(n - len(prompts))
            self._counts["drawn"] += len(fresh)
            prompts += fresh
        self._exhausted = self.manager.source.exhausted
        return prompts

    def _finish(self, ref: Any) -> None:
        call = self._in_flight[ref]
        try:
            if self._agent_threads is None:
                (completions,) = wait_all([ref], "generating completions")
            else:
                completions = ref.result()
        except ActorFailure as failure:
            # Raised unless its engine died and may be restarted; then sent again whole.
            self.engines.lost(call.engine, call.actor, failure)
            self.engines.count_resent(len(call.prompts))
            with self._cond:
                del self._in_flight[ref]
                self._resend.append(call)
                self._cond.notify_all()
            return
        groups = self.manager.score(call.prompts, completions)
        versions = [_oldest_version(g, call.version) for g in groups]
        warning = self.manager.scorer.failure_warning()
        if warning:
            self.manager.warn(f"vime: asynchronous rollout: {warning}")
        with self._cond:
            del self._in_flight[ref]
            for k, (group, version) in enumerate(zip(groups, versions, strict=True)):
                self._counts["failures"] += sum(r is None for r in group.rewards)
                self._counts["tokens"] += sum(c.generated for c in group.completions)
                if self.settings.dynamic_sampling_filter and _all_agree(group.rewards):
                    self.admission.discard()
                    self._counts["filtered"] += 1
                else:
                    self.ready.add(_Ready(group, version, call.admitted + k))
            self._cond.notify_all()
