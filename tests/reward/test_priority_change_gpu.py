"""A stream priority change while value-model searches run (issue 40: under
``scheduler.policy: dynamic`` a search failed in ``cuStreamWriteValue64``
right after the scheduler raised the search service's priority): a CUDA
search service whose leaves go by the leaf channel to a reward service in
another process, its priority switched between its held ones between
searches and during them, every search answered by the value model with no
evaluation failure. Marked ``gpu``; run it under MPS too (bench/gpu_setup.sh
starts a daemon where the host has one).

    pytest -m gpu tests/reward/test_priority_change_gpu.py
"""
from __future__ import annotations

import itertools
import threading

import pytest
from tandem.v1 import search_pb2, search_pb2_grpc

from tandem.server import channel

pytestmark = pytest.mark.gpu


def test_searches_keep_the_value_model_while_the_stream_priority_changes(gpu_reward):
    from search_service import server as search_server

    cfg, _ = gpu_reward
    search = search_server.start(cfg, follow_scheduler=False)
    stop, flips = threading.Event(), [0]
    held = search.servicer.streams.held

    def flip():  # during searches: as often as a busy scheduler could (its reports are 250 ms apart)
        for p in itertools.cycle(held):
            if stop.wait(0.002):
                return
            search.servicer.set_stream_priority(p)
            flips[0] += 1

    try:
        assert search.servicer.handoff.wait_attached(30.0)
        failures = []
        with channel(cfg.search.address) as ch:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            for phase in ("between", "during"):
                flipper = threading.Thread(target=flip, daemon=True) if phase == "during" else None
                if flipper:
                    flipper.start()
                for i in range(100):
                    if phase == "between":
                        search.servicer.set_stream_priority(held[i % len(held)])
                    reply = stub.Search(search_pb2.SearchRequest(
                        game="connect4", moves="4453"[: i % 5], simulations=256, seed=i,
                        evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=60)
                    if reply.evaluation_failure or reply.model_simulations != reply.simulations:
                        failures.append((phase, i, reply.evaluation_failure, reply.model_simulations))
                if flipper:
                    stop.set()
                    flipper.join(5)
        assert flips[0] > 100  # the priority did change during the searches
        assert failures == []
    finally:
        stop.set()
        search.stop()
