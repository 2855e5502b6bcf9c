"""``StepGate``: a weight load waiting on a generation gets in before its next step.

Proves: a load that arrives during a step runs as soon as that step ends, before the
next one, even when the stepping thread asks again at once (a plain lock would let it
keep going); steps and loads never overlap, and two loads never run together; a load
whose wait raises is forgotten, so the steps after it go on; a load nested in one of
the same thread is part of it.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from vime.rollout.step_gate import StepGate


def test_a_waiting_load_goes_before_the_next_step() -> None:
    gate, events, busy = StepGate(), [], threading.Lock()
    load_arrived = threading.Event()

    def generation() -> None:
        for step in range(50):
            with gate.step():
                assert busy.acquire(blocking=False), "a step overlapped a load"
                events.append(("step", step))
                if step == 3:
                    threading.Thread(target=loader).start()
                    load_arrived.wait(10)
                    while gate.loads_waiting == 0:
                        time.sleep(0.001)
                busy.release()

    def loader() -> None:
        load_arrived.set()
        with gate.load():
            assert busy.acquire(blocking=False), "a load overlapped a step"
            events.append(("load", None))
            time.sleep(0.01)
            busy.release()

    generation()
    time.sleep(0.05)
    assert events.index(("load", None)) == 4  # right after step 3, before step 4


def test_loads_run_one_at_a_time() -> None:
    gate, running, most = StepGate(), [0], [0]
    lock = threading.Lock()

    def loader() -> None:
        with gate.load():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=loader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1 and gate.loads_waiting == 0


class Interrupted(Exception):
    """What the test's signal handler raises inside the waiting load."""


def test_a_load_whose_wait_raises_does_not_block_later_steps() -> None:
    """A load interrupted while it waits for a step (a signal's exception raised in its
    wait) leaves no load counted: the next step runs instead of waiting for ever."""
    gate = StepGate()
    in_step, end_step = threading.Event(), threading.Event()

    def generation() -> None:
        with gate.step():
            in_step.set()
            end_step.wait(10)

    def interrupt_when_waiting() -> None:
        deadline = time.monotonic() + 10
        while gate.loads_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def raise_interrupted(signum, frame) -> None:
        raise Interrupted

    stepping = threading.Thread(target=generation)
    stepping.start()
    assert in_step.wait(10)
    # The handler runs in the main thread, this one: the load waits here.
    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    try:
        threading.Thread(target=interrupt_when_waiting, daemon=True).start()
        with pytest.raises(Interrupted), gate.load():
            pytest.fail("the load ran during a step")
    finally:
        signal.signal(signal.SIGUSR1, previous)
        end_step.set()
        stepping.join(10)
    later = threading.Event()

    def next_step() -> None:
        with gate.step():
            later.set()

    threading.Thread(target=next_step, daemon=True).start()
    assert later.wait(5), "a step after the interrupted load never ran"
    assert gate.loads_waiting == 0


def test_a_load_inside_a_load_of_the_same_thread_is_part_of_it() -> None:
    """Two loads nested in one thread (LoRA's base, then its adapter) land as one: a step
    waiting meanwhile runs only after the outer load ends, and nothing deadlocks."""
    gate, events = StepGate(), []

    def step() -> None:
        with gate.step():
            events.append("step")

    def loads() -> None:
        stepper = threading.Thread(target=step)
        with gate.load():
            events.append("base")
            stepper.start()
            time.sleep(0.05)  # the step would run here if the gate let it
            with gate.load():
                events.append("adapter")
            time.sleep(0.05)
            events.append(f"waiting {gate.loads_waiting}")
        stepper.join(10)

    loader = threading.Thread(target=loads, daemon=True)
    loader.start()
    loader.join(10)
    assert not loader.is_alive(), "the inner load waited for the outer one"
    assert events == ["base", "adapter", "waiting 1", "step"] and gate.loads_waiting == 0
