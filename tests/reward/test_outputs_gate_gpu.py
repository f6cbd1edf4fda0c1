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


@pytest.fixture()
def parts(cp):
    """A done word (zeroed, device memory) and a pair of gate words, given back after."""
    words = outputs_gate.GateWords()
    yield cp.zeros(1, np.uint64), words
    words.release()


def _queued(cp, done, words, seq=5, timeout_ns=FOREVER_NS):
    """A gate for ``seq`` queued on a stream of its own: (stream, verdict, token)."""
    token = outputs_gate.GateWords.token()
    verdict = cp.full(1, -1, np.int32)
    cp.cuda.Device().synchronize()  # the verdict's fill is done before the gate's stream starts
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        outputs_gate.queue(outputs_gate.Gate(done.data.ptr, seq, words.cancel_address, words.report_address, token,
                                             timeout_ns), verdict.data.ptr)
    return stream, verdict, token


def _still_waiting(stream, verdict, words, token) -> bool:
    """The gate has not ended: its stream is not done, and it wrote neither verdict."""
    time.sleep(0.05)  # a gate that had started would have seen a word that ends it by now (none should)
    # verdict.get() on the legacy default stream: the gate's stream is non-blocking, so no wait for it
    return not stream.done and int(verdict.get()[0]) == -1 and words.verdict(token, time.monotonic()) is None


def _verdicts(stream, verdict, words, token) -> tuple[int, int]:
    """The gate's verdict as the backup reads it, and as it reported it to the host."""
    stream.synchronize()
    return int(verdict.get()[0]), words.verdict(token, time.monotonic() + 10)


def test_the_done_words_number_opens_the_gate_and_an_older_one_does_not(cp, parts):
    done, words = parts
    done[:] = 4  # the previous wave's number
    stream, verdict, token = _queued(cp, done, words, seq=5)
    assert _still_waiting(stream, verdict, words, token)
    other = cp.cuda.Stream(non_blocking=True)  # as the reward service's stream stores it
    mapped_store(cp, done.data.ptr)(other.ptr, done.data.ptr, 5)
    assert _verdicts(stream, verdict, words, token) == (outputs_gate.OPEN, outputs_gate.OPEN)


def test_the_cancel_words_token_closes_the_gate_and_another_token_does_not(cp, parts):
    done, words = parts
    stream, verdict, token = _queued(cp, done, words)
    words.cancel(outputs_gate.GateWords.token())  # another wave's token: not this gate's
    assert _still_waiting(stream, verdict, words, token)
    words.cancel(token)
    assert _verdicts(stream, verdict, words, token) == (outputs_gate.CLOSED, outputs_gate.CLOSED)


def test_a_gate_closes_by_itself_once_its_time_is_up(cp, parts):
    done, words = parts
    stream, verdict, token = _queued(cp, done, words, timeout_ns=1_000_000)
    assert _verdicts(stream, verdict, words, token) == (outputs_gate.CLOSED, outputs_gate.CLOSED)


def test_released_words_are_reused_longest_free_first_and_tokens_never_repeat(cp):
    first, second = outputs_gate.GateWords(), outputs_gate.GateWords()
    addresses = (first.cancel_address, second.cancel_address)
    first.release()
    first.release()  # twice: nothing more
    second.release()
    taken = []
    try:
        while True:  # every free pair (another test's open channel may hold one)
            try:
                taken.append(outputs_gate.GateWords())
            except RuntimeError as exc:
                assert "taken" in str(exc)
                break
        got = [w.cancel_address for w in taken]
        assert addresses[0] in got and addresses[1] in got
        assert got.index(addresses[0]) < got.index(addresses[1])  # released first, reused first
        tokens = [outputs_gate.GateWords.token() for _ in range(100)]
        assert len(set(tokens)) == 100 and tokens == sorted(tokens)
    finally:
        for w in taken:
            w.release()
