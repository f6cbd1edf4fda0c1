"""Shared-memory tensors (reward_service/shared_memory.py, tandem/shared_memory_client.py)
over a real reward server on loopback: round trips against the bytes path,
every refusal with its status and message, ownership, limits, the lease, and
a region unregistered while a request uses it; a client shrinking its object
under requests (never a signal in the server), and, as root, a client of
another user (uid 65534) in a process of its own: only its own objects, its
own regions and its own share of the table. The region table's own rules
(lease renewal, a memfd's mapping outliving its region) are checked directly.
The CUDA IPC path is in test_shared_memory_gpu.py."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc
from test_reward_service import _float_model, boards, held

from loadtest.background import BackgroundLoad
from reward_service import server as reward_server
from reward_service.shared_memory import RegionTable, SharedMemoryError
from tandem import tensors
from tandem.config import SharedMemoryConfig
from tandem.gpu import cupy_module
from tandem.server import channel
from tandem.shared_memory_client import SealedMemory, SystemSharedMemoryRegion

MODEL = "connect4_value"
CLIENT, OTHER, THIRD = "client-a", "client-b", "client-c"
UINT8, FLOAT32 = reward_pb2.DATA_TYPE_UINT8, reward_pb2.DATA_TYPE_FLOAT32
BOARD_BYTES = 2 * 6 * 7  # one uint8 board
REGION_BYTES = 4096
LIMITS = {"max_regions_per_client": 3, "max_bytes_per_client": 1 << 20, "max_regions_per_user": 5, "max_regions": 6}
ME, NOBODY = os.getuid(), 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")


def _start(tmp_path_factory, **shared_memory_cfg):
    mean_path = _float_model(tmp_path_factory.mktemp("models") / "mean.onnx")
    models = [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 64},
              {"name": "mean", "path": mean_path}]
    cfg = loopback_config(reward={"models": models, "max_queue_delay_us": 0, "shared_memory": shared_memory_cfg})
    service = reward_server.start(cfg, follow_scheduler=False)
    return service, channel(cfg.reward.address)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service, ch = _start(tmp_path_factory, **LIMITS)
    yield service, reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()
    service.stop()


@pytest.fixture(autouse=True)
def _unregister_all(request):
    """Every test starts with no regions (the limits are per client and small)."""
    yield
    if "server" in request.fixturenames:
        _, stub = request.getfixturevalue("server")
        for client in (CLIENT, OTHER, THIRD):
            stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=client))


@pytest.fixture
def objects():
    """Makes POSIX shared-memory objects (the client's side); unlinks them after the test."""
    made = []

    def make(size: int = REGION_BYTES) -> shared_memory.SharedMemory:
        made.append(shared_memory.SharedMemory(create=True, size=size))
        return made[-1]

    yield make
    for shm in made:
        shm.unlink()
        shm.close()


def _register(stub, shm, *, name="in", client_id=CLIENT, byte_size=REGION_BYTES, offset=0):
    return stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
        client_id=client_id, name=name, byte_size=byte_size,
        system=reward_pb2.SystemSharedMemory(key=shm.name, offset=offset)), timeout=10)


def _ref(region="in", offset=0, byte_size=BOARD_BYTES):
    return reward_pb2.SharedMemoryRef(region=region, offset=offset, byte_size=byte_size)


def _board(region="in", offset=0, byte_size=BOARD_BYTES, shape=(1, 2, 6, 7), name="board", dtype=UINT8):
    return reward_pb2.Tensor(name=name, dtype=dtype, shape=shape, shared_memory=_ref(region, offset, byte_size))


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _evaluate_board(stub):
    """One board from region "in" of CLIENT."""
    return stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, client_id=CLIENT, inputs=[_board()]), timeout=10)


def run_client(address: str, body: str, uid: int | None = None) -> dict:
    """Runs ``body`` in a client process of its own (as ``uid``, dropped after
    the imports, as root only) and returns the dict ``out`` it fills. It has
    ``stub`` (RewardService), ``oip`` (GRPCInferenceService), ``pb``
    (reward_pb2), ``service_pb2``, ``shared_memory``, ``make_object(key)``
    (a 4096-byte object of its own, without multiprocessing's resource
    tracker, which cannot start as another user; ``unlink(key)`` removes it)
    and ``code(call)``: the call's [status name, details], ["OK", ""] when it
    succeeds."""
    script = textwrap.dedent(f"""
        import _posixshmem, json, os, threading
        import grpc
        from multiprocessing import shared_memory
        from tandem.v1 import reward_pb2 as pb, reward_pb2_grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc
        uid = {uid!r}
        if uid is not None:
            os.setgid(uid)
            os.setuid(uid)
        def make_object(key):
            fd = _posixshmem.shm_open("/" + key, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
        def unlink(key):
            _posixshmem.shm_unlink("/" + key)
        ch = grpc.insecure_channel({address!r})
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        oip = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        def code(call):
            try:
                call()
                return ["OK", ""]
            except grpc.RpcError as exc:
                return [exc.code().name, exc.details()]
        out = {{}}
        """) + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bytes_outputs(stub, array, model=MODEL, name="board") -> dict:
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=model, inputs=[tensors.to_proto(name, array)]), timeout=10)
    return {t.name: tensors.from_proto(t) for t in reply.outputs}


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 64])
def test_the_client_helper_gives_what_the_bytes_path_gives(server, n):
    service, stub = server
    b = boards(n)
    expected = _bytes_outputs(stub, b)
    with SystemSharedMemoryRegion(stub, 1 << 16) as region:
        got, reply = region.evaluate(MODEL, {"board": b})
        assert all(t.WhichOneof("contents") == "shared_memory" and not t.data for t in reply.outputs)
        assert service.servicer.regions.stats()["regions"] == 1
    for name, array in expected.items():
        np.testing.assert_allclose(got[name], array, atol=1e-6)
    assert service.servicer.regions.stats()["regions"] == 0  # unregistered on close


def test_inputs_in_shared_memory_outputs_as_bytes_and_back(server, objects):
    """Either side may use shared memory alone; one output by reference, the other as bytes."""
    _, stub = server
    shm = objects()
    _register(stub, shm)
    b = boards(4)
    expected = _bytes_outputs(stub, b)
    np.frombuffer(shm.buf, np.uint8, b.size).reshape(b.shape)[...] = b
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(
        model=MODEL, client_id=CLIENT, inputs=[_board(byte_size=b.nbytes, shape=b.shape)],
        output_shared_memory={"value": _ref(offset=1024, byte_size=64)}), timeout=10)
    out = {t.name: t for t in reply.outputs}
    assert out["value"].shared_memory == _ref(offset=1024, byte_size=4 * 4)  # what was written: 4 rows of float32
    value = np.frombuffer(shm.buf, np.float32, 4, offset=1024).reshape(4, 1)
    np.testing.assert_allclose(value, expected["value"], atol=1e-6)
    np.testing.assert_allclose(tensors.from_proto(out["policy_logits"]), expected["policy_logits"], atol=1e-6)
    # Outputs only: inputs as bytes.
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(
        model=MODEL, client_id=CLIENT, inputs=[tensors.to_proto("board", b)], output_names=["policy_logits"],
        output_shared_memory={"policy_logits": _ref(offset=2048, byte_size=4 * 7 * 4)}), timeout=10)
    assert [t.name for t in reply.outputs] == ["policy_logits"]
    logits = np.frombuffer(shm.buf, np.float32, 28, offset=2048).reshape(4, 7)
    np.testing.assert_allclose(logits, expected["policy_logits"], atol=1e-6)


def test_status_lists_only_the_callers_regions_and_is_a_heartbeat(server, objects):
    service, stub = server
    a, b = objects(), objects()
    reply = _register(stub, a, name="in", byte_size=1024, offset=512)
    assert reply.lease_ttl_ms == service.servicer.shared_memory.lease_ttl_ms
    _register(stub, b, name="theirs", client_id=OTHER)
    status = stub.SharedMemoryStatus(reward_pb2.SharedMemoryStatusRequest(client_id=CLIENT), timeout=10)
    assert [r.name for r in status.regions] == ["in"]
    r = status.regions[0]
    assert (r.byte_size, r.system.key, r.system.offset, r.in_flight) == (1024, a.name, 512, 0)
    assert 0 < r.expires_in_ms <= status.lease_ttl_ms
    assert not stub.SharedMemoryStatus(reward_pb2.SharedMemoryStatusRequest(client_id=THIRD), timeout=10).regions


# -- refusals: Evaluate --------------------------------------------------------------------------

BAD_EVALUATE = [
    ("unknown region", dict(inputs=[_board(region="nope")]), grpc.StatusCode.NOT_FOUND, "region 'nope': not registered"),
    ("no client_id", dict(inputs=[_board()], client_id=""), grpc.StatusCode.INVALID_ARGUMENT,
     "client_id: needed when a tensor names a shared-memory region"),
    ("another client's input region", dict(inputs=[_board()], client_id=OTHER), grpc.StatusCode.FAILED_PRECONDITION,
     "region 'in': registered by another client"),
    ("another client's output region", dict(inputs=[_board()], output_shared_memory={"value": _ref("theirs", 0, 4)}),
     grpc.StatusCode.FAILED_PRECONDITION, "region 'theirs': registered by another client"),
    ("input past the region's end", dict(inputs=[_board(offset=REGION_BYTES - 64)]), grpc.StatusCode.INVALID_ARGUMENT,
     f"inputs['board'].shared_memory: offset {REGION_BYTES - 64} + byte_size 84 exceeds region 'in' ({REGION_BYTES} bytes)"),
    ("input byte_size not the tensor's", dict(inputs=[_board(byte_size=80)]), grpc.StatusCode.INVALID_ARGUMENT,
     "inputs['board'].shared_memory.byte_size: 80, but shape [1, 2, 6, 7] of DATA_TYPE_UINT8 needs 84"),
    ("misaligned float input", dict(model="mean", inputs=[_board(name="x", dtype=FLOAT32, shape=(1, 4), offset=2, byte_size=16)]),
     grpc.StatusCode.INVALID_ARGUMENT, "inputs['x'].shared_memory: offset 2 is not a multiple of the dtype's 4 bytes"),
    ("wrong dtype in shared memory", dict(inputs=[_board(dtype=FLOAT32, byte_size=336)]), grpc.StatusCode.INVALID_ARGUMENT,
     "inputs['board'].dtype: expected DATA_TYPE_UINT8"),
    ("output past the region's end", dict(inputs=[_board()], output_shared_memory={"value": _ref(offset=REGION_BYTES, byte_size=4)}),
     grpc.StatusCode.INVALID_ARGUMENT, f"output_shared_memory['value']: offset {REGION_BYTES} + byte_size 4 exceeds region 'in'"),
    ("output room too small", dict(inputs=[_board()], output_shared_memory={"value": _ref(offset=1024, byte_size=2)}),
     grpc.StatusCode.INVALID_ARGUMENT, "output_shared_memory['value'].byte_size: 2, but the output needs 4"),
    ("misaligned output", dict(inputs=[_board()], output_shared_memory={"value": _ref(offset=1026, byte_size=4)}),
     grpc.StatusCode.INVALID_ARGUMENT, "output_shared_memory['value']: offset 1026 is not a multiple of the dtype's 4 bytes"),
    ("output the model lacks", dict(inputs=[_board()], output_shared_memory={"q": _ref(offset=1024, byte_size=4)}),
     grpc.StatusCode.INVALID_ARGUMENT, "output_shared_memory['q']: model 'connect4_value' has no output 'q'"),
    ("output not asked for", dict(inputs=[_board()], output_names=["value"],
                                  output_shared_memory={"policy_logits": _ref(offset=1024, byte_size=28)}),
     grpc.StatusCode.INVALID_ARGUMENT, "output_shared_memory['policy_logits']: not among the requested output_names ['value']"),
]


@pytest.mark.parametrize("why, fields, code, message", BAD_EVALUATE, ids=[b[0] for b in BAD_EVALUATE])
def test_a_bad_reference_gets_a_clear_status_and_the_server_keeps_serving(server, objects, why, fields, code, message):
    service, stub = server
    mine, theirs = objects(), objects()
    _register(stub, mine)
    _register(stub, theirs, name="theirs", client_id=OTHER)
    before = bytes(mine.buf[1024:1100])
    fields = {"model": MODEL, "client_id": CLIENT, **fields}
    err = _refusal(lambda: stub.Evaluate(reward_pb2.EvaluateRequest(**fields), timeout=10))
    assert (err.code(), message) == (code, message) and message in err.details(), err.details()
    assert bytes(mine.buf[1024:1100]) == before  # nothing written
    assert service.servicer.regions.status(CLIENT, uid=ME)[0].in_flight == 0  # the lease was released
    assert len(_evaluate_board(stub).outputs) == 2


def test_an_object_shrunk_under_its_registration_is_refused_not_touched(server, objects):
    _, stub = server
    shm = objects()
    _register(stub, shm)
    os.ftruncate(shm._fd, 0)  # what a misbehaving client could do; reading past the end would raise SIGBUS
    err = _refusal(lambda: _evaluate_board(stub))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"region 'in': its object {shm.name!r} shrank to 0 bytes" in err.details()


# -- refusals: registration, limits, unregistration -----------------------------------------------

BAD_REGISTER = [
    ("no such object", dict(system=reward_pb2.SystemSharedMemory(key="tandem-test-no-such-object")),
     grpc.StatusCode.NOT_FOUND, "system.key: no shared-memory object 'tandem-test-no-such-object'"),
    ("malformed key", dict(system=reward_pb2.SystemSharedMemory(key="a/b")),
     grpc.StatusCode.INVALID_ARGUMENT, "system.key: 'a/b' is not a POSIX shared-memory name"),
    ("window past the object", dict(byte_size=200, system=reward_pb2.SystemSharedMemory(key="{key}", offset=4000)),
     grpc.StatusCode.INVALID_ARGUMENT, "system: offset 4000 + byte_size 200 exceeds the object"),
    ("empty client_id", dict(client_id=""), grpc.StatusCode.INVALID_ARGUMENT, "client_id: must not be empty"),
    ("empty name", dict(name=""), grpc.StatusCode.INVALID_ARGUMENT, "name: must not be empty"),
    ("zero byte_size", dict(byte_size=0), grpc.StatusCode.INVALID_ARGUMENT, "byte_size: must be > 0"),
    ("neither system nor cuda", dict(system=None), grpc.StatusCode.INVALID_ARGUMENT, "memory: set system or cuda"),
    ("name taken by another client", dict(name="taken", client_id=OTHER), grpc.StatusCode.ALREADY_EXISTS,
     "name: a region 'taken' is already registered"),
]


@pytest.mark.parametrize("why, fields, code, message", BAD_REGISTER, ids=[b[0] for b in BAD_REGISTER])
def test_a_bad_registration_gets_a_clear_status(server, objects, why, fields, code, message):
    service, stub = server
    shm = objects()
    _register(stub, shm, name="taken")
    request = {"client_id": CLIENT, "name": "in", "byte_size": 64, "system": reward_pb2.SystemSharedMemory(key=shm.name)}
    request.update(fields)
    system = request.pop("system")
    if system is not None:  # "{key}": the object made here
        request["system"] = reward_pb2.SystemSharedMemory(key=shm.name if system.key == "{key}" else system.key,
                                                          offset=system.offset)
    err = _refusal(lambda: stub.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(**request), timeout=10))
    assert err.code() == code and message in err.details(), err.details()
    assert service.servicer.regions.stats()["regions"] == 1  # only "taken"


@pytest.mark.skipif(cupy_module() is not None, reason="a GPU host: test_shared_memory_gpu.py covers CUDA regions")
def test_a_cuda_region_on_a_host_without_a_gpu_fails_its_precondition(server):
    _, stub = server
    request = reward_pb2.RegisterSharedMemoryRequest(
        client_id=CLIENT, name="gpu", byte_size=64, cuda=reward_pb2.CudaSharedMemory(raw_handle=bytes(64)))
    err = _refusal(lambda: stub.RegisterSharedMemory(request, timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cuda: this server has no GPU that CuPy can use" in err.details()


def test_limits_per_client_and_per_server_are_resource_exhausted(server, objects):
    _, stub = server
    shm = objects(LIMITS["max_bytes_per_client"] + 64)
    for i in range(3):
        _register(stub, shm, name=f"a{i}", byte_size=64)
    err = _refusal(lambda: _register(stub, shm, name="a3", byte_size=64))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "client 'client-a' holds 3 regions, the most reward.shared_memory.max_regions_per_client allows" in err.details()
    too_many = LIMITS["max_bytes_per_client"] + 1
    err = _refusal(lambda: _register(stub, shm, name="b0", client_id=OTHER, byte_size=too_many))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "passes reward.shared_memory.max_bytes_per_client (1048576)" in err.details()
    _register(stub, shm, name="b0", client_id=OTHER, byte_size=64)
    _register(stub, shm, name="b1", client_id=OTHER, byte_size=64)
    err = _refusal(lambda: _register(stub, shm, name="c0", client_id=THIRD, byte_size=64))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (f"uid {ME} holds 5 regions (all its client ids together), the most "
            "reward.shared_memory.max_regions_per_user allows") in err.details()
    stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=CLIENT, name="a0"), timeout=10)
    _register(stub, shm, name="c0", client_id=THIRD, byte_size=64)  # room again


def test_the_server_wide_limit_is_resource_exhausted():
    table = RegionTable(SharedMemoryConfig(max_regions_per_user=8, max_regions=2))
    for i in range(2):
        table.register_fd(CLIENT, f"m{i}", os.dup(SealedMemory(64).fd), ME)
    with pytest.raises(SharedMemoryError) as info:
        table.register_fd(OTHER, "m2", os.dup(SealedMemory(64).fd), ME)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the server holds 2 regions, reward.shared_memory.max_regions" in str(info.value)
    table.close()


def test_unregister_checks_the_owner_and_frees_all_of_a_clients_regions(server, objects):
    service, stub = server
    shm = objects()
    for name in ("in", "out"):
        _register(stub, shm, name=name, byte_size=64)
    unregister = stub.UnregisterSharedMemory
    err = _refusal(lambda: unregister(reward_pb2.UnregisterSharedMemoryRequest(client_id=OTHER, name="in"), timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "region 'in': registered by another client" in err.details()
    err = _refusal(lambda: unregister(reward_pb2.UnregisterSharedMemoryRequest(client_id=CLIENT, name="nope"), timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "region 'nope': not registered" in err.details()
    err = _refusal(lambda: stub.SharedMemoryStatus(
        reward_pb2.SharedMemoryStatusRequest(client_id=OTHER, name="in"), timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = _refusal(lambda: unregister(reward_pb2.UnregisterSharedMemoryRequest(client_id=""), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_id: must not be empty" in err.details()
    assert service.servicer.regions.stats()["regions"] == 2  # refusals freed nothing
    names = unregister(reward_pb2.UnregisterSharedMemoryRequest(client_id=CLIENT), timeout=10).names
    assert sorted(names) == ["in", "out"] and service.servicer.regions.stats()["regions"] == 0


# -- a region freed while in use, and the lease --------------------------------------------------


def test_a_region_unregistered_in_flight_fails_that_request_cleanly(server, objects):
    """Unregister does not wait: the mapping stays until the request lets go,
    the request fails with FAILED_PRECONDITION and writes nothing, the server serves on."""
    service, stub = server
    shm = objects()
    _register(stub, shm)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.frombuffer(shm.buf, np.float32, 8).reshape(2, 4)[...] = x
    shm.buf[1024:1032] = b"\xff" * 8
    request = reward_pb2.EvaluateRequest(
        model="mean", client_id=CLIENT, inputs=[_board(name="x", dtype=FLOAT32, shape=(2, 4), byte_size=32)],
        output_shared_memory={"y": _ref(offset=1024, byte_size=8)})
    with held(service, "mean") as (pool, entered, seen):
        call = pool.submit(stub.Evaluate, request, timeout=20)
        assert entered.wait(10)
        assert service.servicer.regions.status(CLIENT, uid=ME)[0].in_flight == 1
        names = stub.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=CLIENT, name="in"), timeout=10)
        assert list(names.names) == ["in"] and service.servicer.regions.stats()["regions"] == 0
    with pytest.raises(grpc.RpcError) as info:
        call.result()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "region 'in': unregistered while this request used it; no outputs written" in info.value.details()
    assert bytes(shm.buf[1024:1032]) == b"\xff" * 8
    np.testing.assert_allclose(_bytes_outputs(stub, x, model="mean", name="x")["y"], x.mean(axis=1))  # serving


def test_a_region_left_unused_is_freed_when_its_lease_runs_out(tmp_path_factory, objects):
    service, ch = _start(tmp_path_factory, lease_ttl_ms=50.0)
    stub = reward_pb2_grpc.RewardServiceStub(ch)
    try:
        shm = objects()
        assert _register(stub, shm).lease_ttl_ms == 50.0
        deadline = time.monotonic() + 30
        while service.servicer.regions.stats()["regions"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the reaper thread, not this loop, frees it
        err = _refusal(lambda: _evaluate_board(stub))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "region 'in': not registered" in err.details()
        _register(stub, shm)  # the name is free again
    finally:
        ch.close()
        service.stop()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_lease_is_renewed_by_use_and_status_and_never_reaps_a_region_in_use(objects):
    clock = _Clock()
    table = RegionTable(SharedMemoryConfig(lease_ttl_ms=1000.0), clock=clock)
    shm = objects()
    table.register_system(CLIENT, "in", 64, shm.name, 0, ME)
    clock.now += 0.9
    table.status(CLIENT, uid=ME)  # the heartbeat
    clock.now += 0.9
    assert table.reap() == []
    lease = table.acquire(CLIENT, ["in"], uid=ME)  # a use renews too, and holds the region
    clock.now += 5.0
    assert table.reap() == []  # in use: never reaped
    lease.close()  # released: renewed from now
    clock.now += 0.9
    assert table.reap() == []
    clock.now += 0.2
    assert table.reap() == ["in"] and table.stats()["regions"] == 0
    with pytest.raises(SharedMemoryError) as info:
        table.acquire(CLIENT, ["in"], uid=ME)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_a_memfd_mapping_outlives_its_region_while_an_array_over_it_lives():
    """A memfd region's inputs are views over its mapping (no copy): one that
    outlives the region (the batcher keeps its last batch) keeps the mapping,
    which goes with the last array over it."""
    table = RegionTable(SharedMemoryConfig())
    memory = SealedMemory(64)
    memory.array(0, np.uint8, (4,))[:] = [1, 2, 3, 4]
    table.register_fd(CLIENT, "in", os.dup(memory.fd), ME)
    with table.acquire(CLIENT, ["in"], uid=ME) as lease:
        array = np.frombuffer(lease.input(_board(byte_size=4, shape=(4,))).data, np.uint8)
        assert table.unregister(CLIENT, "in", uid=ME) == ["in"]
        assert table.stats() == {"regions": 0, "bytes": 0}
        with pytest.raises(SharedMemoryError) as info:
            lease.check_live()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    memory.close()  # the client's side gone too: the server's mapping alone holds the memory
    assert array.tolist() == [1, 2, 3, 4] and not array.flags.writeable
    table.close()


def test_a_system_regions_inputs_are_copies_the_server_owns(objects):
    """Read with pread, not mapped: what the client writes after the read does not reach the request's arrays."""
    table = RegionTable(SharedMemoryConfig())
    shm = objects()
    shm.buf[:4] = b"\x01\x02\x03\x04"
    table.register_system(CLIENT, "in", 64, shm.name, 0, ME)
    with table.acquire(CLIENT, ["in"], uid=ME) as lease:
        array = np.frombuffer(lease.input(_board(byte_size=4, shape=(4,))).data, np.uint8)
        shm.buf[:4] = b"\x00" * 4
        lease.write("in", 8, np.array([7, 8], np.uint8))
    assert array.tolist() == [1, 2, 3, 4] and bytes(shm.buf[8:10]) == b"\x07\x08"
    table.close()


@pytest.mark.parametrize("make, seals, message", [
    (lambda: os.memfd_create("unsealable"), 0, "not sealed against shrinking"),
    (lambda: os.memfd_create("unsealed", os.MFD_ALLOW_SEALING), 0, "not sealed against shrinking"),
    (lambda: os.memfd_create("write-sealed", os.MFD_ALLOW_SEALING), SealedMemory.SEALS | 0x0008,  # F_SEAL_WRITE
     "cannot be mapped read-write"),
    (lambda: os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR), 0, "not an ordinary memfd"),  # tmpfs: seals, no memfd
    (lambda: os.open(os.path.dirname(__file__), os.O_TMPFILE | os.O_RDWR), 0, "not a memfd (it has no seals)"),
])
def test_a_descriptor_that_is_not_a_memfd_sealed_against_shrinking_is_refused(make, seals, message):
    import fcntl

    table = RegionTable(SharedMemoryConfig())
    fd = make()
    os.ftruncate(fd, 64)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    with pytest.raises(SharedMemoryError) as info:
        table.register_fd(CLIENT, "in", fd, ME)  # closes it
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in str(info.value), str(info.value)
    assert table.stats()["regions"] == 0
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, refused or not
    table.close()


# -- a client shrinking its object, and clients of another user -----------------------------------


def test_a_client_shrinking_its_object_under_requests_never_crashes_the_server(server, objects):
    """A client process registers its object, then truncates it and restores it
    in a loop while its other thread sends Evaluates reading and writing it:
    each is answered OK or FAILED_PRECONDITION naming the region (a mapping
    would have raised SIGBUS in the server: this process), and the server
    serves the next good request."""
    service, stub = server
    out = run_client(_address(service), f"""
        shm = shared_memory.SharedMemory(create=True, size=4096)
        stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(client_id="shrinker", name="shrinking",
            byte_size=4096, system=pb.SystemSharedMemory(key=shm.name)), timeout=10)
        board = pb.Tensor(name="board", dtype=pb.DATA_TYPE_UINT8, shape=[1, 2, 6, 7],
                          shared_memory=pb.SharedMemoryRef(region="shrinking", offset=0, byte_size=84))
        request = pb.EvaluateRequest(model={MODEL!r}, client_id="shrinker", inputs=[board],
            output_shared_memory={{"value": pb.SharedMemoryRef(region="shrinking", offset=1024, byte_size=4)}})
        stop = threading.Event()

        def shrink():
            while not stop.is_set():
                os.ftruncate(shm._fd, 0)
                os.ftruncate(shm._fd, 4096)

        shrinker = threading.Thread(target=shrink)
        shrinker.start()
        out["codes"] = [code(lambda: stub.Evaluate(request, timeout=60)) for _ in range(150)]
        stop.set()
        shrinker.join()
        shm.unlink()
        """)
    for status, details in out["codes"]:
        assert status in ("OK", "FAILED_PRECONDITION"), (status, details)
        if status != "OK":
            assert "region 'shrinking'" in details and "bytes" in details, details
    assert service.servicer.regions.stats()["regions"] == 1  # the client's region, left to its lease
    service.servicer.regions.unregister("shrinker", uid=ME)
    shm = objects()
    _register(stub, shm)
    assert len(_evaluate_board(stub).outputs) == 2  # serving
    assert len(_bytes_outputs(stub, boards(2))["value"]) == 2


def _address(service) -> str:
    return f"127.0.0.1:{service.port}"


@as_root
def test_another_user_may_register_its_own_objects_only(server, objects):
    """The confused deputy: a client running as uid 65534 names a root-owned
    0600 object it could not open itself; the server (root) could, and refuses.
    Its own object registers, and its client_id does not reach root's regions."""
    service, stub = server
    mine = objects()
    _register(stub, mine)  # root's region "in" of CLIENT
    key = f"tandem-test-nobody-{os.getpid()}"
    out = run_client(_address(service), f"""
        make_object({key!r})
        def register(name, key):
            return code(lambda: stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(client_id={CLIENT!r},
                name=name, byte_size=4096, system=pb.SystemSharedMemory(key=key)), timeout=10))
        out["root's"] = register("stolen", {mine.name!r})
        out["own"] = register("own", {key!r})
        board = pb.Tensor(name="board", dtype=pb.DATA_TYPE_UINT8, shape=[1, 2, 6, 7],
                          shared_memory=pb.SharedMemoryRef(region="in", offset=0, byte_size=84))
        out["evaluate root's"] = code(lambda: stub.Evaluate(pb.EvaluateRequest(model={MODEL!r},
            client_id={CLIENT!r}, inputs=[board]), timeout=10))
        out["unregister root's"] = code(lambda: stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(
            client_id={CLIENT!r}, name="in"), timeout=10))
        unlink({key!r})
        """, uid=NOBODY)
    status, details = out["root's"]
    assert status == "PERMISSION_DENIED", out
    assert f"the object {mine.name!r} belongs to uid 0, not to the caller's uid {NOBODY}" in details
    assert out["own"] == ["OK", ""]
    for what in ("evaluate root's", "unregister root's"):
        assert out[what][0] == "FAILED_PRECONDITION" and "registered by another client" in out[what][1], out
    assert [r.name for r in service.servicer.regions.status(CLIENT, uid=NOBODY)] == ["own"]
    assert [r.name for r in service.servicer.regions.status(CLIENT, uid=ME)] == ["in"]
    assert len(_evaluate_board(stub).outputs) == 2
    service.servicer.regions.unregister(CLIENT, uid=NOBODY)


@as_root
def test_one_user_rotating_client_ids_meets_its_own_limit_not_everyones(server, objects):
    service, stub = server
    key = f"tandem-test-nobody-{os.getpid()}"
    out = run_client(_address(service), f"""
        make_object({key!r})
        out["codes"] = [code(lambda: stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
            client_id=f"rotating-{{i}}", name=f"rotating-{{i}}", byte_size=64,
            system=pb.SystemSharedMemory(key={key!r})), timeout=10)) for i in range(6)]
        unlink({key!r})
        """, uid=NOBODY)
    assert [c[0] for c in out["codes"]] == ["OK"] * 5 + ["RESOURCE_EXHAUSTED"]
    assert f"uid {NOBODY} holds 5 regions" in out["codes"][-1][1] and "max_regions_per_user" in out["codes"][-1][1]
    _register(stub, objects())  # another user's registration: room left in the table
    for i in range(5):
        service.servicer.regions.unregister(f"rotating-{i}", uid=NOBODY)


# -- registration behind the token --------------------------------------------------------------


def test_registration_without_the_token_is_unauthenticated(tmp_path_factory, objects):
    """With auth_token set, RegisterSharedMemory (RewardService's and OIP's) is
    refused before it opens anything; with the token it works."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    token = "shm-s3cret"
    cfg = dataclasses.replace(loopback_config(reward={"models": [
        {"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 8}]}), auth_token=token)
    service = reward_server.start(cfg, follow_scheduler=False)
    shm = objects()
    try:
        with grpc.insecure_channel(cfg.reward.address) as ch:
            calls = {
                "reward": lambda md: reward_pb2_grpc.RewardServiceStub(ch).RegisterSharedMemory(
                    reward_pb2.RegisterSharedMemoryRequest(client_id=CLIENT, name="in", byte_size=64,
                                                           system=reward_pb2.SystemSharedMemory(key=shm.name)),
                    timeout=10, metadata=md),
                "oip": lambda md: service_pb2_grpc.GRPCInferenceServiceStub(ch).SystemSharedMemoryRegister(
                    service_pb2.SystemSharedMemoryRegisterRequest(name="oip-in", key=shm.name, byte_size=64),
                    timeout=10, metadata=md),
            }
            for registered, (name, call) in enumerate(calls.items()):
                for md in (None, [("authorization", "Bearer nope")]):
                    err = _refusal(lambda: call(md))
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md, err.details())
                assert service.servicer.regions.stats()["regions"] == registered  # refused before anything opened
                call([("authorization", f"Bearer {token}")])
            assert service.servicer.regions.stats()["regions"] == 2
    finally:
        service.stop()


# -- the trainer of the load test -------------------------------------------------------------------


@pytest.fixture(scope="module")
def frame_server():
    cfg = loopback_config(reward={"models": [{"name": "frame_reward", "path": "reward_service/models/frame_reward.onnx",
                                              "max_batch_size": 8}]})
    service = reward_server.start(cfg, follow_scheduler=False)
    yield service, cfg
    service.stop()


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_the_background_trainer_runs_over_either_transport(frame_server, transport):
    service, cfg = frame_server
    bg = BackgroundLoad(cfg.reward.address, cfg, batch=2, workers=2, transport=transport)
    try:
        bg.start()
        assert service.servicer.regions.stats()["regions"] == (2 if transport == "shm" else 0)
        deadline = time.monotonic() + 60
        while bg.report()["batches"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        bg.stop()
    finally:
        bg.close()
    report = bg.report()
    assert report["batches"] >= 4 and report["refused"] == {} and report["transport"] == transport
    assert service.servicer.regions.stats()["regions"] == 0


def test_an_unknown_background_transport_is_refused():
    with pytest.raises(ValueError, match="transport: must be one of grpc, shm, got 'carrier pigeon'"):
        BackgroundLoad("127.0.0.1:1", transport="carrier pigeon")
