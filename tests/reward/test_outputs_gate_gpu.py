"""The outputs' gate (tandem/outputs_gate.py) on the GPU: its kernel holds a
stream until the done word holds the wave's number (OPEN), the cancel word
its token or its time is up (CLOSED), and nothing else ends it. Through a
real leaf channel: tests/reward/test_leaf_channel_gpu.py."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tandem import outputs_gate
from tandem.gpu import cupy_module
from tandem.ready_word import mapped_store

pytestmark = pytest.mark.gpu

FOREVER_NS = 60 * 10**9  # a timeout no test reaches


@pytest.fixture()
def cp():
    cupy = cupy_module()
    if cupy is None:
        pytest.skip("CuPy sees no GPU")
    return cupy


def _queued(cp, done, cancel, seq=5, token=None, timeout_ns=FOREVER_NS):
    """A gate for ``seq`` queued on a stream of its own: (stream, verdict, token)."""
    token = outputs_gate.CancelWord.token() if token is None else token
    verdict = cp.full(1, -1, np.int32)
    cp.cuda.Device().synchronize()  # the verdict's fill is done before the gate's stream starts
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        outputs_gate.queue(outputs_gate.Gate(done.data.ptr, seq, cancel.address, token, timeout_ns),
                           verdict.data.ptr)
    return stream, verdict, token


def _still_waiting(stream) -> bool:
    time.sleep(0.05)  # the gate had time to see a word that would end it (none should)
    return not stream.done


def test_the_done_words_number_opens_the_gate_and_an_older_one_does_not(cp):
    done, cancel = cp.zeros(1, np.uint64), outputs_gate.CancelWord()
    try:
        done[:] = 4  # the previous wave's number
        stream, verdict, _ = _queued(cp, done, cancel, seq=5)
        assert _still_waiting(stream)
        other = cp.cuda.Stream(non_blocking=True)  # as the reward service's stream stores it
        mapped_store(cp, done.data.ptr)(other.ptr, done.data.ptr, 5)
        stream.synchronize()
        assert int(verdict.get()[0]) == outputs_gate.OPEN
    finally:
        cancel.release()


def test_the_cancel_words_token_closes_the_gate_and_another_token_does_not(cp):
    done, cancel = cp.zeros(1, np.uint64), outputs_gate.CancelWord()
    try:
        stream, verdict, token = _queued(cp, done, cancel)
        cancel.cancel(outputs_gate.CancelWord.token())  # another wave's token: not this gate's
        assert _still_waiting(stream)
        cancel.cancel(token)
        stream.synchronize()
        assert int(verdict.get()[0]) == outputs_gate.CLOSED
    finally:
        cancel.release()


def test_a_gate_closes_by_itself_once_its_time_is_up(cp):
    done, cancel = cp.zeros(1, np.uint64), outputs_gate.CancelWord()
    try:
        stream, verdict, _ = _queued(cp, done, cancel, timeout_ns=1_000_000)
        stream.synchronize()
        assert int(verdict.get()[0]) == outputs_gate.CLOSED
    finally:
        cancel.release()


def test_a_released_cancel_word_is_reused_and_tokens_never_repeat(cp):
    first = outputs_gate.CancelWord()
    address = first.address
    first.release()
    first.release()  # twice: nothing more
    second = outputs_gate.CancelWord()
    try:
        assert second.address == address
        tokens = [outputs_gate.CancelWord.token() for _ in range(100)]
        assert len(set(tokens)) == 100 and tokens == sorted(tokens)
    finally:
        second.release()
