"""A search session belongs to the caller that first named it (issue 41, part 3):
another user naming the same session id gets a session of its own and leaves
the first caller's tree untouched. Real search service on loopback (CPU
reference backend, rollouts); the other user is a child process as uid 65534."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import closed, loopback_config, own_connection
from tandem.v1 import search_pb2, search_pb2_grpc

from search_service import server as search_server
from search_service.sessions import Owners, SessionStore, owner
from tandem.server import channel

NOBODY = 65534


@pytest.fixture(scope="module")
def served():
    cfg = loopback_config(search={"backend": "cpu", "evaluator": "rollout"})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch), service, cfg.search.address
    ch.close()
    service.stop()


def _req(moves: str, session_id: str, simulations: int = 50) -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(game="connect4", moves=moves, simulations=simulations, seed=1,
                                    session_id=session_id, evaluator=search_pb2.EVALUATOR_ROLLOUT)


def test_owner_is_the_socket_user_on_this_host_else_the_remote_host():
    assert owner("ipv4:10.1.2.3:5000") == ("host", "10.1.2.3")
    assert owner("ipv6:[2001:db8::1]:5000") == ("host", "2001:db8::1")
    assert owner("unix:/tmp/tandem.sock") == owner("garbage") == ("unknown",)


class _Tree:
    pass


def test_one_id_of_two_owners_is_two_sessions():
    store = SessionStore(max_sessions=10, ttl_ms=60_000)
    mine, theirs = (("uid", 0), "game-1"), (("uid", NOBODY), "game-1")
    tree = _Tree()
    assert store.put(mine, "4", tree)
    assert store.take(theirs, "4", lambda t, a: t) == (None, True)  # theirs is not mine ...
    assert store.take(mine, "4", lambda t, a: t) == (tree, True)  # ... and taking it left mine where it was


def test_a_session_continues_for_its_own_caller(served):
    stub, service, _ = served
    first = stub.Search(_req("44", "own-1", 300), timeout=60)
    follow = stub.Search(_req("44" + first.move + "3", "own-1"), timeout=60)
    assert follow.tree_reused and sum(follow.visit_counts) > 50
    assert (("uid", os.getuid()), "connect4", "own-1") in service.servicer.sessions._entries


# The other user's client: imports grpc before it drops to uid 65534 (as tests/stack/test_peer.py),
# then continues, resets (a position off the game) and batch-searches the root client's session.
_OTHER_USER = """
import json, os, sys
import grpc
from tandem.v1 import search_pb2, search_pb2_grpc
os.setgid({uid}); os.setuid({uid})
stub = search_pb2_grpc.SearchServiceStub(grpc.insecure_channel({address!r}))
def req(moves):
    return search_pb2.SearchRequest(game="connect4", moves=moves, simulations=20, seed=2,
                                    session_id={session!r}, evaluator=search_pb2.EVALUATOR_ROLLOUT)
out = [stub.Search(req({moves!r}), timeout=60).tree_reused,
       stub.Search(req("11"), timeout=60).tree_reused,
       stub.SearchBatch(search_pb2.SearchBatchRequest(searches=[req({moves!r})]), timeout=60).results[0].tree_reused]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_naming_a_session_neither_continues_nor_resets_it(served):
    stub, service, address = served
    first = stub.Search(_req("44", "game-1", 300), timeout=60)
    continued = "44" + first.move + "3"
    code = _OTHER_USER.format(uid=NOBODY, address=address, session="game-1", moves=continued)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    # The other user's searches were answered, none from root's tree: the continuation started fresh, and so
    # did the reset and the batch (its own session, rooted at "11" by then, does not lead to that position).
    assert json.loads(child.stdout) == [False, False, False]
    assert (("uid", NOBODY), "connect4", "game-1") in service.servicer.sessions._entries
    # The root client's tree is where it was: continued, with the visits of its first search below it.
    follow = stub.Search(_req(continued, "game-1"), timeout=60)
    assert follow.tree_reused and sum(follow.visit_counts) > 50


def test_owners_remember_a_peer_for_their_ttl_only():
    import socket

    owners = Owners(ttl_s=3600.0, max_entries=2)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        peer = f"ipv4:127.0.0.1:{client.getsockname()[1]}"
        assert owners(peer) == ("uid", os.getuid())
    # The connection is gone: within the TTL the address still names its user, after it no one.
    assert owners(peer) == ("uid", os.getuid())
    assert Owners(ttl_s=0.0)(peer) == ("unknown",)
    assert owners("ipv4:10.1.2.3:1") == ("host", "10.1.2.3")


def test_a_session_is_bound_to_its_connection_until_that_one_closes():
    store = SessionStore(max_sessions=10, ttl_ms=60_000)
    key, tree = (("uid", 0), "game-1"), _Tree()
    closed = set()
    gone = closed.__contains__
    assert store.take(key, "4", lambda t, a: t, "conn-a", gone) == (None, True)  # bound to A by its first search
    assert store.take(key, "4", lambda t, a: t, "conn-b", gone) == (None, False)  # B, while A searches
    assert not store.put(key, "4", _Tree(), "conn-b")
    assert store.put(key, "4", tree, "conn-a")
    assert store.take(key, "4", lambda t, a: t, "conn-b", gone) == (None, False)  # nor once A's tree is back
    assert store.take(key, "4", lambda t, a: t, "conn-a", gone) == (tree, True)
    assert store.put(key, "4", tree, "conn-a")
    closed.add("conn-a")  # A's connection closed: the next connection takes the session over, tree and all
    assert store.take(key, "4", lambda t, a: t, "conn-c", gone) == (tree, True)
    assert store.put(key, "4", tree, "conn-c")
    assert store.take(key, "4", lambda t, a: t, "conn-b", gone) == (None, False)


def test_another_connection_of_the_same_user_gets_a_fresh_tree_and_leaves_the_first_one(served):
    """Issue 41 part 3: client B of the same user, on a connection of its own,
    names client A's session: B's search is answered from a fresh tree (not
    kept), and A's next move still reuses A's tree. Once A's connection is
    closed, a new connection (A reconnected) continues the tree."""
    _, service, address = served
    with own_connection(address) as a_ch, own_connection(address) as b_ch:
        a, b = search_pb2_grpc.SearchServiceStub(a_ch), search_pb2_grpc.SearchServiceStub(b_ch)
        first = a.Search(_req("44", "shared-1", 300), timeout=60)
        continued = "44" + first.move + "3"
        taken = b.Search(_req(continued, "shared-1"), timeout=60)
        assert not taken.tree_reused and sum(taken.visit_counts) <= 50
        assert not b.Search(_req(continued, "shared-1"), timeout=60).tree_reused  # B's tree was not kept either
        follow = a.Search(_req(continued, "shared-1"), timeout=60)
        assert follow.tree_reused and sum(follow.visit_counts) > 50
        a_peer = service.servicer.sessions._entries[(("uid", os.getuid()), "connect4", "shared-1")].connection
    assert closed(a_peer, service.port)
    with own_connection(address) as again:
        after = search_pb2_grpc.SearchServiceStub(again).Search(_req(continued + "4", "shared-1"), timeout=60)
    assert after.tree_reused
