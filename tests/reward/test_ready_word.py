"""The ready word's poll (tandem/ready_word.py, WordWait), the reward
service's end, over a word in real POSIX shared memory written by another
thread as the client's GPU stream would write it. The GPU's end (ReadyWord)
is tested with the leaf channel in tests/reward/test_leaf_channel_gpu.py."""
from __future__ import annotations

import threading
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

from tandem.ready_word import WordWait


@pytest.fixture()
def memory():
    shm = shared_memory.SharedMemory(create=True, size=8)
    yield shm
    shm.close()  # the tests' views are gone with their frames
    shm.unlink()


def word_of(shm) -> np.ndarray:
    """The word, uint64 [1], zeroed."""
    view = np.frombuffer(shm.buf, np.uint64, 1)
    view[0] = 0
    return view


def store_later(view: np.ndarray, value: int, after_s: float = 0.02) -> threading.Thread:
    def store():
        time.sleep(after_s)
        view[0] = value

    thread = threading.Thread(target=store)
    thread.start()
    return thread


def test_the_wave_s_sequence_number_ends_the_wait(memory):
    word = word_of(memory)
    thread = store_later(word, 3)
    assert WordWait(word, 3).wait_host(time.monotonic() + 30)
    thread.join()


@pytest.mark.parametrize("value", [4, 9])
def test_a_superseded_wave_ends_the_wait_unwritten(memory, value):
    word = word_of(memory)
    thread = store_later(word, value)
    assert not WordWait(word, 3).wait_host(time.monotonic() + 30)
    thread.join()


def test_an_older_sequence_number_is_waited_past_until_the_limit(memory):
    word = word_of(memory)
    word[0] = 2  # the previous wave's
    assert not WordWait(word, 3).wait_host(time.monotonic() + 0.01)


class PreviousRun:
    """The previous wave's ``done`` as WordWait asks it (``query``): pending until ``finish``."""

    def __init__(self):
        self.finished = threading.Event()

    def query(self) -> bool:
        return self.finished.is_set()


def test_the_limit_counts_only_once_the_previous_wave_s_outputs_are_done(memory):
    word = word_of(memory)
    """While the previous wave's run is pending the client cannot have written
    this wave's inputs: the wait goes on past its limit and ends with the word."""
    previous = PreviousRun()
    waiter = WordWait(word, 3, previous, window=0.01, hard_limit=time.monotonic() + 30)
    result = []
    thread = threading.Thread(target=lambda: result.append(waiter.wait_host(time.monotonic() + 0.01)))
    thread.start()
    time.sleep(0.05)  # five limits: still waiting
    assert thread.is_alive()
    previous.finished.set()
    word[0] = 3
    thread.join(30)
    assert result == [True]


def test_the_client_gets_its_window_after_its_previous_outputs_whatever_the_caller_s_limit(memory):
    """A batch's limit is shared: a wave polled after another's long wait may
    find it passed. Its client still gets the window, counted from the moment
    the poll first sees its previous outputs done."""
    word = word_of(memory)
    previous = PreviousRun()
    previous.finished.set()
    thread = store_later(word, 3)
    assert WordWait(word, 3, previous, window=30.0, hard_limit=time.monotonic() + 30).wait_host(time.monotonic() - 1)
    thread.join()
    assert not WordWait(word, 4, previous, window=0.01, hard_limit=time.monotonic() + 30).wait_host(
        time.monotonic() - 1)


def test_the_hard_limit_ends_a_wait_whose_previous_run_never_ends(memory):
    word = word_of(memory)
    waiter = WordWait(word, 3, PreviousRun(), hard_limit=time.monotonic() + 0.05)
    assert not waiter.wait_host(time.monotonic() + 0.01)
