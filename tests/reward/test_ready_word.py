"""The ready word's waits (tandem/ready_word.py), the reward service's end,
over the two words in real POSIX shared memory written by another thread as
the client's GPU stream would write them: WordWait's host poll, and
WordReleaser, which ends every GPU wait (here its driver call is a
recording stand-in: the stream wait itself needs a GPU and is tested with
the leaf channel in tests/reward/test_leaf_channel_gpu.py, as is ReadyWord)."""
from __future__ import annotations

import gc
import threading
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np
import pytest

from tandem.ready_word import READY, VOID, WORD_BYTES, WordReleaser, WordWait


@pytest.fixture()
def memory():
    shm = shared_memory.SharedMemory(create=True, size=WORD_BYTES)
    yield shm
    gc.collect()  # a raised exception's traceback holds the test's views in a cycle
    shm.close()
    shm.unlink()


def words_of(shm) -> np.ndarray:
    """The two words, uint64 [2], zeroed."""
    view = np.frombuffer(shm.buf, np.uint64, 2)
    view[:] = 0
    return view


def store_later(view: np.ndarray, value: int, after_s: float = 0.02, void: int | None = None) -> threading.Thread:
    def store():
        time.sleep(after_s)
        if void is not None:  # a cancel: the void word first
            view[VOID] = void
        view[READY] = value

    thread = threading.Thread(target=store)
    thread.start()
    return thread


def test_the_wave_s_sequence_number_ends_the_wait(memory):
    words = words_of(memory)
    thread = store_later(words, 3)
    assert WordWait(words, 3).wait_host(time.monotonic() + 30)
    thread.join()


@pytest.mark.parametrize("value, void", [(3, 3), (4, None), (4, 3)])
def test_a_cancelled_or_superseded_wave_ends_the_wait_unwritten(memory, value, void):
    words = words_of(memory)
    thread = store_later(words, value, void=void)
    assert not WordWait(words, 3).wait_host(time.monotonic() + 30)
    thread.join()


def test_a_void_word_of_an_earlier_wave_does_not_void_this_one(memory):
    words = words_of(memory)
    words[VOID] = 2  # wave 2 was given up; wave 3's inputs come
    thread = store_later(words, 3)
    assert WordWait(words, 3).wait_host(time.monotonic() + 30)
    thread.join()


def test_an_older_sequence_number_is_waited_past_until_the_limit(memory):
    words = words_of(memory)
    words[READY] = 2  # the previous wave's
    assert not WordWait(words, 3).wait_host(time.monotonic() + 0.01)


class PreviousRun:
    """The previous wave's ``done`` as WordWait asks it (``query``): pending until ``finish``."""

    def __init__(self):
        self.finished = threading.Event()

    def query(self) -> bool:
        return self.finished.is_set()


def test_the_limit_counts_only_once_the_previous_wave_s_outputs_are_done(memory):
    """While the previous wave's run is pending the client cannot have written
    this wave's inputs: the wait goes on past its limit and ends with the word."""
    words = words_of(memory)
    previous = PreviousRun()
    waiter = WordWait(words, 3, previous, window=0.01, hard_limit=time.monotonic() + 30)
    result = []
    thread = threading.Thread(target=lambda: result.append(waiter.wait_host(time.monotonic() + 0.01)))
    thread.start()
    time.sleep(0.05)  # five limits: still waiting
    assert thread.is_alive()
    previous.finished.set()
    words[READY] = 3
    thread.join(30)
    assert result == [True]


def test_the_client_gets_its_window_after_its_previous_outputs_whatever_the_caller_s_limit(memory):
    """A batch's limit is shared: a wave polled after another's long wait may
    find it passed. Its client still gets the window, counted from the moment
    the poll first sees its previous outputs done."""
    words = words_of(memory)
    previous = PreviousRun()
    previous.finished.set()
    thread = store_later(words, 3)
    assert WordWait(words, 3, previous, window=30.0, hard_limit=time.monotonic() + 30).wait_host(time.monotonic() - 1)
    thread.join()
    assert not WordWait(words, 4, previous, window=0.01, hard_limit=time.monotonic() + 30).wait_host(
        time.monotonic() - 1)


def test_the_hard_limit_ends_a_wait_whose_previous_run_never_ends(memory):
    words = words_of(memory)
    waiter = WordWait(words, 3, PreviousRun(), hard_limit=time.monotonic() + 0.05)
    assert not waiter.wait_host(time.monotonic() + 0.01)


class Gpu:
    """The driver as WordReleaser uses it, for a CPU: ``wait`` records each
    (stream, address, seq); ``mark`` returns the event recorded before a
    wait (``before``: done unless given) or, right after one, the one that
    says the stream is past it -- once the stream has reached the wait
    (``reached``) and the word, compared as the GPU does, is at or past its
    number (then it stays past)."""

    def __init__(self, refuse: int | None = None, before: PreviousRun | None = None):
        self.calls, self.refuse, self.before, self.reached = [], refuse, before, True
        self.words: dict[int, np.ndarray] = {}
        self._queued = None

    def address(self, words: np.ndarray) -> int:
        address = 0x7000 + 0x100 * len(self.words)
        self.words[address] = words
        return address

    def wait(self, stream: int, address: int, seq: int) -> None:
        if self.refuse is not None:
            exc = RuntimeError(f"cuStreamWaitValue64: CUresult {self.refuse}")
            exc.status = self.refuse
            raise exc
        self.calls.append((stream, address, seq))
        self._queued = (self.words[address - 8 * READY], seq)

    def mark(self, stream: int):
        if self._queued is None:
            return self.before or done_run()
        (words, seq), self._queued = self._queued, None
        return Past(self, words, seq)


class Past:
    def __init__(self, gpu: Gpu, words: np.ndarray, seq: int):
        self.gpu, self.words, self.seq, self.past = gpu, words, seq, False

    def query(self) -> bool:
        word = int(self.words[READY])
        self.past = self.past or (self.gpu.reached and (word - self.seq) % (1 << 64) < 1 << 63)
        return self.past


def done_run() -> PreviousRun:
    run = PreviousRun()
    run.finished.set()
    return run


def releaser_of(gpu: Gpu, **kw) -> WordReleaser:
    return WordReleaser(gpu.wait, gpu.mark, **kw)


def waiter_on_gpu(gpu: Gpu, words, seq, releaser, **kw) -> WordWait:
    mapped = SimpleNamespace(device=gpu.address(words), view=words)  # MappedWords' two fields
    return WordWait(words, seq, mapped=(mapped, releaser), **kw)


def until(condition, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_a_gpu_wait_whose_word_never_comes_is_abandoned_after_the_client_s_window(memory):
    """The releaser ends the wait itself: the void word names the wave, then
    the ready word is raised to it (what releases the stream), and it is
    held until the stream is past it; the output guard names the void
    word's device address; on_abandon hears of it once."""
    words = words_of(memory)
    words[READY] = 2
    gpu, heard = Gpu(), []
    releaser = releaser_of(gpu, on_abandon=heard.append)
    try:
        waiter = waiter_on_gpu(gpu, words, 3, releaser, window=0.02)
        assert waiter.ready_on_gpu and waiter.output_guard == (0x7000 + 8, 3)
        waiter.wait_on_stream(0x42)
        assert gpu.calls == [(0x42, 0x7000, 3)]
        assert until(lambda: releaser.abandoned == 1 and not releaser._pending)  # noqa: SLF001
        assert list(words) == [3, 3] and waiter.ready() is False and heard == [waiter]
    finally:
        releaser.close()
    assert heard == [waiter]


def test_a_gpu_wait_whose_word_comes_is_dropped_untouched(memory):
    words = words_of(memory)
    gpu = Gpu()
    releaser = releaser_of(gpu)
    try:
        waiter_on_gpu(gpu, words, 3, releaser, window=0.05).wait_on_stream(0x42)
        words[READY] = 3
        assert until(lambda: not releaser._pending)  # noqa: SLF001
        time.sleep(0.2)  # four windows
        assert releaser.abandoned == 0 and list(words) == [3, 0]
    finally:
        releaser.close()


def test_a_gpu_wait_is_not_abandoned_while_the_previous_outputs_are_pending(memory):
    words = words_of(memory)
    previous = PreviousRun()
    gpu = Gpu(before=previous)  # the work queued before the wait: pending
    releaser = releaser_of(gpu)
    try:
        waiter_on_gpu(gpu, words, 3, releaser, window=0.01, hard_limit=time.monotonic() + 30).wait_on_stream(0x42)
        time.sleep(0.1)
        assert releaser.abandoned == 0 and words[VOID] == 0
        previous.finished.set()
        assert until(lambda: releaser.abandoned == 1) and list(words) == [3, 3]
    finally:
        releaser.close()


def test_a_word_lowered_after_the_abandon_is_raised_again_until_the_stream_is_past(memory):
    """A late store of an earlier number (the client's, landing after the
    server gave the wave up) lowers the word before the stream looks: the
    releaser holds the wait until the stream is past it and raises the word
    again, so the wait ends all the same."""
    words = words_of(memory)
    gpu = Gpu()
    gpu.reached = False  # the stream has not reached the wait yet
    releaser = releaser_of(gpu)
    try:
        waiter_on_gpu(gpu, words, 3, releaser, window=0.01).wait_on_stream(0x42)
        assert until(lambda: releaser.abandoned == 1)
        words[READY] = 2  # the late store
        gpu.reached = True
        assert until(lambda: not releaser._pending)  # noqa: SLF001
        assert list(words) == [3, 3] and releaser.abandoned == 1
    finally:
        releaser.close()


def test_the_host_compares_as_the_gpu_does_cyclically(memory):
    """cuStreamWaitValue64's "greater or equal" is cyclic: a word 2^63 or more
    above the number is below it. Such a word is "not yet" for the host too,
    so the releaser does not drop a wait the GPU still blocks on."""
    words = words_of(memory)
    words[READY] = (1 << 63) + 10
    assert WordWait(words, 3).ready() is None
    words[READY] = 5
    assert WordWait(words, 3).ready() is False  # superseded: past it, not it


def test_release_abandons_one_connection_s_waits_at_once_and_close_every_one(memory):
    words = words_of(memory)
    other = np.zeros(2, np.uint64)
    gpu = Gpu()
    gpu.reached = False
    releaser = releaser_of(gpu)
    try:
        waiter_on_gpu(gpu, words, 5, releaser, window=30.0).wait_on_stream(1)
        waiter_on_gpu(gpu, other, 7, releaser, window=30.0).wait_on_stream(2)
        releaser.release(words)
        assert list(words) == [5, 5] and list(other) == [0, 0]
    finally:
        releaser.close()
    assert list(other) == [7, 7] and releaser.abandoned == 2
    with pytest.raises(RuntimeError, match="closed"):
        waiter_on_gpu(gpu, other, 8, releaser).wait_on_stream(2)


def test_a_driver_without_stream_waits_is_not_asked_again(memory):
    words = words_of(memory)
    releaser = releaser_of(Gpu(refuse=801))  # CUDA_ERROR_NOT_SUPPORTED
    try:
        with pytest.raises(RuntimeError, match="CUresult 801"):
            waiter_on_gpu(Gpu(), words, 3, releaser, window=0.0).wait_on_stream(1)
        time.sleep(0.05)
        assert releaser.abandoned == 0 and list(words) == [0, 0] and not releaser._pending  # noqa: SLF001
        assert not releaser.available  # later waves are polled
        with pytest.raises(RuntimeError, match="no stream waits"):
            waiter_on_gpu(Gpu(), words, 4, releaser).wait_on_stream(1)
    finally:
        releaser.close()


def test_another_refusal_costs_one_wave_only(memory):
    words = words_of(memory)
    gpu = Gpu(refuse=1)  # CUDA_ERROR_INVALID_VALUE: this wave's address, say
    releaser = releaser_of(gpu)
    try:
        with pytest.raises(RuntimeError, match="CUresult 1"):
            waiter_on_gpu(gpu, words, 3, releaser).wait_on_stream(1)
        assert releaser.available and not releaser._pending  # noqa: SLF001
    finally:
        releaser.close()
