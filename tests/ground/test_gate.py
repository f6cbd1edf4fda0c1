"""The interpreter gate (tandem/gate.py): one holder at a time, re-entrant,
let go around a holder's waits, off when disabled."""
from __future__ import annotations

import threading

from tandem.gate import GATED, WAITS, Gate


def _enters(gate: Gate, entered: threading.Event) -> threading.Thread:
    def run():
        with gate.held():
            entered.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _waits() -> float:
    return next(s.value for m in WAITS.collect() for s in m.samples if s.name.endswith("_count"))


def test_one_thread_holds_the_gate_at_a_time_and_a_wait_for_it_is_counted():
    gate, entered = Gate(), threading.Event()
    waits = _waits()
    with gate.held():
        assert gate.holds()
        t = _enters(gate, entered)
        assert not entered.wait(0.2)  # it waits for the holder
    assert entered.wait(10)
    t.join(10)
    assert not gate.holds()
    assert _waits() == waits + 1  # the other thread's wait; the first take found the gate free


def test_held_is_reentrant_and_released_gives_the_gate_to_another_thread():
    gate, entered = Gate(), threading.Event()
    with gate.held():
        with gate.held():  # the same thread again: no deadlock
            assert gate.holds()
        assert gate.holds()
        t = _enters(gate, entered)
        with gate.released():
            assert not gate.holds()
            assert entered.wait(10)  # the other thread got the gate while this one waited
            t.join(10)
        assert gate.holds()  # taken back
    assert not gate.holds()


def test_released_without_the_gate_does_nothing_and_a_disabled_gate_excludes_no_one():
    gate = Gate()
    with gate.released():
        assert not gate.holds()
    off, entered = Gate(enabled=False), threading.Event()
    with off.held():
        t = _enters(off, entered)
        assert entered.wait(10)
        t.join(10)


def test_an_exception_inside_gives_the_gate_back():
    gate, entered = Gate(), threading.Event()
    try:
        with gate.held():
            raise ValueError("handler failed")
    except ValueError:
        pass
    t = _enters(gate, entered)
    assert entered.wait(10)
    t.join(10)


def test_the_gated_methods_are_the_hot_unary_ones():
    assert GATED == {"/tandem.v1.SearchService/Search", "/tandem.v1.SearchService/SearchBatch",
                     "/tandem.v1.RewardService/Evaluate"}


def test_the_first_server_sets_the_gate_and_a_co_located_one_can_only_turn_it_on():
    gate = Gate()
    gate.configure(False)
    assert not gate.enabled
    gate.configure(True)
    assert gate.enabled
    gate.configure(False)  # a third server's "off" does not turn the others' gate off
    assert gate.enabled
    first_on = Gate()
    first_on.configure(True)
    first_on.configure(False)
    assert first_on.enabled
