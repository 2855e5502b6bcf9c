"""Which finished groups asynchronous rollout trains first: the oldest, or the first done.

Where it fits: the measurement behind ``vime.rollout.staleness.ReadyGroups`` taking the
oldest groups first (bench/README.md). A small deterministic simulation, no model and
no Ray: the real ``Admission`` and ``ReadyGroups`` bookkeeping, engines that run up to
``--slots`` groups each at a time, a group taking time in proportion to its longest
response (lengths long-tailed, each prompt longer or shorter than the others, drawn
from seeded generators), and a trainer that takes a batch, trains for a fixed time and
syncs. Each setting runs twice on the very same draws: taking the first groups to
finish (what the producer did before) and taking the oldest first.

Printed per row: the groups dropped as stale and generated again (per 100 trained),
the generated tokens they wasted (% of those trained), the mean response length of the
trained samples against the reference, the length the synchronous loop would train
(each trained prompt's first draw), and the mean staleness and simulated time per
rollout. Times are in units of one token's decode.

    PYTHONPATH=. python bench/ready_order.py              # the table of bench/README.md
    PYTHONPATH=. python bench/ready_order.py --smoke      # tiny, for the tests
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from vime.rollout.staleness import Admission, ReadyGroups


@dataclass(frozen=True)
class Setting:
    """One simulated run: batch B of groups of n samples, K, the engines, the trainer."""

    batch: int = 8  # groups a rollout trains
    samples: int = 4  # per group
    max_staleness: int = 1
    engines: int = 2
    slots: int = 4  # groups each engine generates at a time
    train_time: float = 250.0  # a training step, in token-decode times
    median_len: float = 100.0  # response lengths: lognormal around this, per prompt scaled
    sigma: float = 0.8
    prompt_sigma: float = 0.5  # how much prompts differ in their typical length
    max_len: int = 1024
    rollouts: int = 300
    seed: int = 0


@dataclass
class Group:
    prompt: int
    version: int  # what the engines served when it started (its oldest token's)
    admitted: int  # admission number
    lengths: list[int]
    engine: int
    finished: int = -1  # finish number, once done


@dataclass
class Outcome:
    trained_len: list[int] = field(default_factory=list)
    reference_len: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    stale: int = 0
    stale_tokens: int = 0
    trained_tokens: int = 0
    time: float = 0.0


def draw(s: Setting, prompt: int, attempt: int) -> list[int]:
    """The response lengths of ``prompt``'s ``attempt``-th generation: a function of the
    seed, the prompt and the attempt alone, so both orders see the same draws."""
    scale = random.Random(f"{s.seed}/{prompt}").lognormvariate(0.0, s.prompt_sigma)
    rng = random.Random(f"{s.seed}/{prompt}/{attempt}")
    mu = math.log(s.median_len * scale)
    return [
        max(1, min(s.max_len, round(rng.lognormvariate(mu, s.sigma)))) for _ in range(s.samples)
    ]


def simulate(s: Setting, oldest_first: bool) -> Outcome:
    admission = Admission(s.batch, s.max_staleness)
    order = (lambda g: (g.version, g.admitted)) if oldest_first else (lambda g: g.finished)
    ready: ReadyGroups[Group] = ReadyGroups(lambda g: g.version, s.max_staleness, order=order)
    running = [0] * s.engines
    events: list[tuple[float, int, Group]] = []
    retry: collections.deque[int] = collections.deque()
    attempts: collections.Counter[int] = collections.Counter()
    out, now, version, rollout = Outcome(), 0.0, 0, 0
    next_prompt = finished = 0
    train_until: float | None = None

    def admit() -> None:
        nonlocal next_prompt
        while admission.room(version) > 0 and min(running) < s.slots:
            engine = running.index(min(running))
            if retry:
                prompt = retry.popleft()
            else:
                prompt, next_prompt = next_prompt, next_prompt + 1
            lengths = draw(s, prompt, attempts[prompt])
            attempts[prompt] += 1
            group = Group(prompt, version, admission.started, lengths, engine)
            admission.start()
            running[engine] += 1
            heapq.heappush(events, (now + max(lengths), group.admitted, group))

    while rollout < s.rollouts:
        admit()
        if train_until is None:
            batch, stale = ready.take(s.batch, rollout)
            admission.discard(len(stale))
            retry.extend(g.prompt for g in stale)
            out.stale += len(stale)
            out.stale_tokens += sum(sum(g.lengths) for g in stale)
            if batch:
                for g in batch:
                    out.trained_len += g.lengths
                    out.trained_tokens += sum(g.lengths)
                    out.reference_len += draw(s, g.prompt, 0)
                    out.staleness.append(rollout - g.version)
                train_until = now + s.train_time
                continue
        if train_until is not None and (not events or train_until <= events[0][0]):
            now, train_until = train_until, None
            rollout += 1
            version = rollout  # the sync: the engines serve what rollout - 1 trained
            continue
        now, _, group = heapq.heappop(events)
        running[group.engine] -= 1
        group.finished, finished = finished, finished + 1
        ready.add(group)
    out.time = now
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=5, help="runs per row, averaged")
    parser.add_argument("--smoke", action="store_true")
    flags = parser.parse_args()
    rollouts, seeds = (5, 1) if flags.smoke else (flags.rollouts, flags.seeds)
    base = Setting(rollouts=rollouts)
    paces = [("balanced", 1.0), ("trainer 2x slower", 2.0), ("trainer 2x faster", 0.5)]
    rows = [
        (
            f"K={k}, {pace}",
            Setting(rollouts=rollouts, max_staleness=k, train_time=base.train_time * f),
        )
        for k in (1, 2)
        for pace, f in paces
    ]
    print(
        f"ready-order simulation: B={base.batch} groups x n={base.samples}, {base.engines} "
        f"engines x {base.slots} slots, lengths lognormal (median {base.median_len:.0f}, "
        f"sigma {base.sigma}, prompts sigma {base.prompt_sigma}, cap {base.max_len}), "
        f"{rollouts} rollouts x {seeds} seeds"
    )
    header = (
        "| setting | take | stale dropped /100 trained | wasted tokens % | trained len "
        "| sync-loop len | bias % | staleness mean | time / rollout |"
    )
    print(header)
    print("|---" * 9 + "|")
    for label, setting in rows:
        for oldest_first in (False, True):
            runs = [
                simulate(Setting(**{**setting.__dict__, "seed": k}), oldest_first)
                for k in range(seeds)
            ]
            trained = sum(len(r.staleness) for r in runs)
            stale = 100 * sum(r.stale for r in runs) / trained
            wasted = 100 * sum(r.stale_tokens for r in runs) / sum(r.trained_tokens for r in runs)
            got = statistics.fmean(x for r in runs for x in r.trained_len)
            want = statistics.fmean(x for r in runs for x in r.reference_len)
            age = statistics.fmean(x for r in runs for x in r.staleness)
            per = statistics.fmean(r.time / setting.rollouts for r in runs)
            take = "oldest first" if oldest_first else "first finished"
            print(
                f"| {label} | {take} | {stale:.1f} | {wasted:.1f} | {got:.1f} | {want:.1f} "
                f"| {100 * (got / want - 1):+.1f} | {age:.2f} | {per:.0f} |"
            )


if __name__ == "__main__":
    main()
