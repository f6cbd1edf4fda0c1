"""The Open Inference Protocol beside RewardService (reward_service/oip.py),
called with Triton's own client, ``tritonclient.grpc``, against a real reward
server on loopback with the shipped model."""
from __future__ import annotations

import base64
import os

import grpc
import numpy as np
import pytest
from conftest import closed, loopback_config, own_connection, wait_for
from tandem.v1 import reward_pb2, reward_pb2_grpc

from reward_service import server as reward_server
from tandem import heap, tensors
from tandem.server import channel

try:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import InferenceServerException
except (ImportError, RuntimeError):  # tritonclient.grpc raises RuntimeError when its grpc part is missing
    pytest.fail("tritonclient[grpc] is not installed: pip install -e '.[test]'", pytrace=False)

MODEL = "connect4_value"


@pytest.fixture(scope="module")
def served():
    cfg = loopback_config(reward={"models": [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx",
                                              "max_batch_size": 64}]})
    service = reward_server.start(cfg, follow_scheduler=False)
    client = grpcclient.InferenceServerClient(cfg.reward.address)
    ch = channel(cfg.reward.address)
    yield client, service, reward_pb2_grpc.RewardServiceStub(ch), service_pb2_grpc.GRPCInferenceServiceStub(ch)
    client.close()
    ch.close()
    service.stop()


def boards(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((n, 2, 6, 7)) < 0.2).astype(np.uint8)


def infer(client, array, datatype="UINT8", **kw):
    x = grpcclient.InferInput("board", list(array.shape), datatype)
    x.set_data_from_numpy(array)
    return client.infer(MODEL, [x], client_timeout=30, **kw)


def lane_submitted(service) -> dict[str, int]:
    lanes = service.servicer.batchers[MODEL].stats()["lanes"]
    return {name: lane["submitted"] for name, lane in lanes.items()}


def test_server_live_ready_and_metadata(served):
    client, *_ = served
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "tandem" and meta.version
    assert {"model_configuration", "statistics", "parameters"} <= set(meta.extensions)


def test_model_ready_and_metadata(served):
    client, service, stub, _ = served
    version = stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL)).version
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, version)
    assert not client.is_model_ready("nope") and not client.is_model_ready(MODEL, "7")
    meta = client.get_model_metadata(MODEL)
    assert meta.name == MODEL and list(meta.versions) == [version] and meta.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("board", "UINT8", [-1, 2, 6, 7])]
    assert {(t.name, t.datatype) for t in meta.outputs} == {("value", "FP32"), ("policy_logits", "FP32")}


def test_model_config_describes_batching_and_priorities(served):
    client, service, *_ = served
    config = client.get_model_config(MODEL).config
    assert config.name == MODEL and config.max_batch_size == 64
    assert [(i.name, list(i.dims)) for i in config.input] == [("board", [2, 6, 7])]  # the batch dimension left out
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_UINT8
    assert config.dynamic_batching.priority_levels == 2 and config.dynamic_batching.default_priority_level == 2
    assert list(config.dynamic_batching.preferred_batch_size) == list(service.servicer.sessions[MODEL].buckets)
    assert config.parameters["execution_provider"].string_value.endswith("ExecutionProvider")


@pytest.mark.parametrize("n", [1, 5, 64])
def test_infer_answers_what_evaluate_answers(served, n):
    client, _, stub, _ = served
    b = boards(n, seed=n)
    result = infer(client, b, request_id=f"r{n}")
    assert result.get_response().id == f"r{n}"
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", b)]), timeout=30)
    expected = {t.name: tensors.from_proto(t) for t in reply.outputs}
    for name in ("value", "policy_logits"):
        got = result.as_numpy(name)
        assert got.shape == expected[name].shape and got.dtype == np.float32
        np.testing.assert_allclose(got, expected[name], atol=1e-5)


def test_requested_outputs_only(served):
    client, *_ = served
    result = infer(client, boards(3), outputs=[grpcclient.InferRequestedOutput("value")])
    assert [o.name for o in result.get_response().outputs] == ["value"]
    assert result.as_numpy("value").shape == (3, 1)


@pytest.mark.parametrize("priority, lane", [(1, "critical"), (2, "bulk"), (0, "bulk")])
def test_priority_parameter_picks_the_lane(served, priority, lane):
    client, service, *_ = served
    before = lane_submitted(service)
    infer(client, boards(2), priority=priority)
    after = lane_submitted(service)
    other = "bulk" if lane == "critical" else "critical"
    assert after[lane] == before[lane] + 1 and after[other] == before[other]


def test_statistics_count_the_calls(served):
    client, *_ = served
    before = client.get_inference_statistics(MODEL).model_stats[0]
    for n in (1, 3, 4):
        infer(client, boards(n))
    after = client.get_inference_statistics(MODEL).model_stats[0]
    assert after.name == MODEL
    assert after.inference_count == before.inference_count + 8
    assert after.inference_stats.success.count == before.inference_stats.success.count + 3
    assert after.inference_stats.success.ns > before.inference_stats.success.ns
    assert after.inference_stats.queue.count == before.inference_stats.queue.count + 3
    assert after.execution_count >= before.execution_count + 1
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count
    assert after.last_inference > 0
    every = client.get_inference_statistics("").model_stats
    assert [s.name for s in every] == [MODEL]


def _raw(**fields) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest for one [1, 2, 6, 7] UINT8 board, with ``fields`` replaced."""
    tensor = dict(name="board", datatype="UINT8", shape=[1, 2, 6, 7])
    tensor.update(fields.pop("tensor", {}))
    request = service_pb2.ModelInferRequest(model_name=MODEL, inputs=[service_pb2.ModelInferRequest.InferInputTensor(
        **tensor)], raw_input_contents=[bytes(84)])
    for key, value in fields.items():
        if key == "parameters":
            for name, p in value.items():
                request.parameters[name].CopyFrom(p)
        elif key in ("raw_input_contents", "outputs"):
            del getattr(request, key)[:]
            getattr(request, key).extend(value)
        else:
            setattr(request, key, value)
    return request


P = service_pb2.InferParameter
BAD = [
    ("wrong datatype", _raw(tensor={"datatype": "FP32"}, raw_input_contents=[bytes(336)]), "INVALID_ARGUMENT",
     "dtype: expected DATA_TYPE_UINT8, got DATA_TYPE_FLOAT32"),
    ("datatype not served", _raw(tensor={"datatype": "BYTES"}), "INVALID_ARGUMENT", "inputs[0] ('board').datatype"),
    ("wrong shape", _raw(tensor={"shape": [1, 2, 7, 6]}), "INVALID_ARGUMENT", "inputs['board'].shape: expected"),
    ("wrong rank", _raw(tensor={"shape": [1, 84]}), "INVALID_ARGUMENT", "inputs['board'].shape"),
    ("short bytes", _raw(raw_input_contents=[bytes(83)]), "INVALID_ARGUMENT", "83 bytes, but shape [1, 2, 6, 7]"),
    ("long bytes", _raw(raw_input_contents=[bytes(85)]), "INVALID_ARGUMENT", "85 bytes"),
    ("no raw contents", _raw(raw_input_contents=[]), "INVALID_ARGUMENT", "raw_input_contents: 0 entries for 1 inputs"),
    ("typed contents", _raw(tensor={"contents": service_pb2.InferTensorContents(uint_contents=[0] * 84)}),
     "INVALID_ARGUMENT", "inputs[0] ('board').contents"),
    ("unknown input", _raw(tensor={"name": "extra"}), "INVALID_ARGUMENT", "no input 'extra'"),
    ("unknown model", _raw(model_name="nope"), "NOT_FOUND", "model_name: no model named 'nope'"),
    ("unknown version", _raw(model_version="7"), "NOT_FOUND", "model_version: model 'connect4_value' has version"),
    ("unknown parameter", _raw(parameters={"temperature": P(double_param=0.5)}), "INVALID_ARGUMENT",
     "parameters['temperature']: unknown parameter"),
    ("sequence parameter", _raw(parameters={"sequence_id": P(int64_param=3)}), "INVALID_ARGUMENT",
     "parameters['sequence_id']"),
    ("priority out of range", _raw(parameters={"priority": P(uint64_param=3)}), "INVALID_ARGUMENT",
     "parameters['priority']: 3 is not a priority level"),
    ("priority not a number", _raw(parameters={"priority": P(string_param="high")}), "INVALID_ARGUMENT",
     "parameters['priority']"),
    ("negative timeout", _raw(parameters={"timeout": P(int64_param=-1)}), "INVALID_ARGUMENT",
     "parameters['timeout']"),
    ("input parameter", _raw(tensor={"parameters": {"classification": P(int64_param=3)}}),
     "INVALID_ARGUMENT", "inputs[0] ('board').parameters: unknown parameter 'classification'"),
    ("output parameter", _raw(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(
        name="value", parameters={"classification": P(int64_param=3)})]),
     "INVALID_ARGUMENT", "outputs[0] ('value').parameters: unknown parameter 'classification'"),
    ("region without byte size", _raw(tensor={"parameters": {"shared_memory_region": P(string_param="r")}},
                                      raw_input_contents=[]),
     "INVALID_ARGUMENT", "inputs[0] ('board').parameters['shared_memory_byte_size']"),
    ("unknown region", _raw(tensor={"parameters": {"shared_memory_region": P(string_param="nowhere"),
                                                   "shared_memory_byte_size": P(int64_param=84)}},
                            raw_input_contents=[]),
     "NOT_FOUND", "nowhere"),
    ("unknown output", _raw(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="q")]),
     "INVALID_ARGUMENT", "output_names: model 'connect4_value' has no output 'q'"),
    # Counted before any work per entry (issue 41): the model has 1 input and 2 outputs.
    ("many outputs", _raw(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="value")] * 1000),
     "INVALID_ARGUMENT", "outputs: 1000 entries; model 'connect4_value' takes at most 2"),
    ("many raw contents", _raw(raw_input_contents=[b""] * 1000), "INVALID_ARGUMENT",
     "raw_input_contents: 1000 entries; model 'connect4_value' takes at most 1"),
    # A large message of many entries is refused before it is parsed (tandem/guard.py).
    ("a flood of outputs", _raw(outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="value")]
                                * 100_000),
     "INVALID_ARGUMENT", "request: more than 4096 fields in a"),
    # ... counting the entries nested in its fields: 10,000 of one input's parameters.
    ("a flood of nested parameters", _raw(tensor={"parameters": {f"p{i}": P(int64_param=i) for i in range(10_000)}}),
     "INVALID_ARGUMENT", "request: more than 4096 fields in a"),
    ("many inputs", service_pb2.ModelInferRequest(model_name=MODEL, inputs=[
        service_pb2.ModelInferRequest.InferInputTensor(name="board", datatype="UINT8", shape=[1, 2, 6, 7])] * 3),
     "INVALID_ARGUMENT", "inputs: 3 entries; model 'connect4_value' takes at most 1"),
]


@pytest.mark.parametrize("why, request_, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_the_protocol_status_naming_the_field(served, why, request_, code, message):
    client, _, _, oip_stub = served
    with pytest.raises(grpc.RpcError) as info:
        oip_stub.ModelInfer(request_, timeout=30)
    assert info.value.code().name == code, info.value.details()
    assert message in info.value.details()
    # The server keeps serving.
    assert infer(client, boards(1)).as_numpy("value").shape == (1, 1)


def test_nested_entries_are_counted_before_parsing_and_large_fields_are_not(served):
    client, _, _, oip_stub = served
    request = _raw(tensor={"parameters": {f"p{i}": P(int64_param=i) for i in range(10_000)}})
    with pytest.raises(grpc.RpcError) as info:
        oip_stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"more than 4096 fields in a {request.ByteSize()}-byte /inference.GRPCInferenceService/ModelInfer "
            f"message (nested ones counted)") in info.value.details()
    # A large message of few fields passes the count: a 100 kB id (one string) is served, and
    # 67 kB of raw contents (one bytes entry) get the model's own answer.
    assert len(infer(client, boards(1), request_id="x" * 100_000).get_response().id) == 100_000
    with pytest.raises(InferenceServerException, match="batch 800 exceeds max_batch_size 64"):
        infer(client, boards(800))


def test_bad_input_through_tritonclient_raises_its_exception(served):
    client, *_ = served
    with pytest.raises(InferenceServerException) as info:
        infer(client, boards(1).astype(np.float32), datatype="FP32")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "dtype" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        infer(client, boards(1), parameters={"temperature": 0.5})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "temperature" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND" and "model_name" in info.value.message()


def test_expired_timeout_parameter_is_deadline_exceeded_and_not_run(served):
    client, service, *_ = served
    before = lane_submitted(service)
    with pytest.raises(InferenceServerException) as info:
        infer(client, boards(1), timeout=1)  # 1 µs: over before the request reaches its lane
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert lane_submitted(service) == before  # refused before it was queued


def test_parts_not_served_answer_unimplemented(served):
    *_, oip_stub = served
    with pytest.raises(grpc.RpcError) as info:
        oip_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_without_tritonclient_the_server_serves_reward_service_alone(monkeypatch, caplog):
    from reward_service import oip

    def missing():
        raise ImportError("No module named 'tritonclient'")

    monkeypatch.setattr(oip, "_load", missing)
    with caplog.at_level("WARNING", logger="reward_service.oip"):
        assert oip.registrar(object(), serving=lambda: True) is None
    assert "Open Inference Protocol not served" in caplog.text and "tandem[oip]" in caplog.text


def test_oip_is_listed_by_reflection_beside_reward_service(served):
    _, service, *_ = served
    assert "inference.GRPCInferenceService" in service.running.services
    assert "tandem.v1.RewardService" in service.running.services


def test_system_shared_memory_inputs_and_outputs(served):
    """Triton's own shared-memory helpers (POSIX shm) for an input and an
    output, registered, used, listed and unregistered over the protocol."""
    import tritonclient.utils.shared_memory as shm

    client, *_ = served
    b = boards(4, seed=9)
    want = infer(client, b).as_numpy("value")
    inp = shm.create_shared_memory_region("oip_in", "/tandem_oip_in", b.nbytes)
    out = shm.create_shared_memory_region("oip_out", "/tandem_oip_out", 4 * 4)
    try:
        shm.set_shared_memory_region(inp, [b])
        client.register_system_shared_memory("oip_in", "/tandem_oip_in", b.nbytes)
        client.register_system_shared_memory("oip_out", "/tandem_oip_out", 16)
        regions = client.get_system_shared_memory_status().regions
        assert {name: (r.key, r.byte_size) for name, r in regions.items()} == {
            "oip_in": ("/tandem_oip_in", b.nbytes), "oip_out": ("/tandem_oip_out", 16)}
        x = grpcclient.InferInput("board", list(b.shape), "UINT8")
        x.set_shared_memory("oip_in", b.nbytes)
        value = grpcclient.InferRequestedOutput("value")
        value.set_shared_memory("oip_out", 16)
        result = client.infer(MODEL, [x], outputs=[value], client_timeout=30)
        output = result.get_output("value")
        assert output.parameters["shared_memory_region"].string_param == "oip_out"
        assert output.parameters["shared_memory_byte_size"].int64_param == 16
        got = shm.get_contents_as_numpy(out, np.float32, [4, 1])
        np.testing.assert_allclose(got, want, atol=1e-5)
        with pytest.raises(InferenceServerException) as info:  # the name is taken
            client.register_system_shared_memory("oip_in", "/tandem_oip_in", b.nbytes)
        assert info.value.status() == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException) as info:  # a system region is no CUDA one
            client.get_cuda_shared_memory_status("oip_in")
        assert info.value.status() == "StatusCode.NOT_FOUND" and "no cuda shared-memory region" in info.value.message()
        client.unregister_system_shared_memory("oip_in")
        assert list(client.get_system_shared_memory_status().regions) == ["oip_out"]
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status().regions
    finally:
        for handle in (inp, out):
            shm.destroy_shared_memory_region(handle)


def test_system_shared_memory_register_errors(served):
    client, *_ = served
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("ghost", "/tandem_no_such_object", 64)
    assert info.value.status() == "StatusCode.NOT_FOUND" and "tandem_no_such_object" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.unregister_system_shared_memory("ghost")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_cuda_shared_memory_without_a_gpu_is_a_failed_precondition(served):
    from tandem.gpu import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("this host has a GPU: the CUDA path is tested in test_shared_memory_gpu.py")
    client, *_ = served
    with pytest.raises(InferenceServerException) as info:
        client.register_cuda_shared_memory("gpu_in", base64.b64encode(bytes(64)), 0, 1024)  # tritonclient decodes it
    assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert not client.get_cuda_shared_memory_status().regions


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_refused_large_request_frees_its_memory_at_once(served):
    """24 refused 8 MiB ModelInfers (the shape disagrees with the bytes, 192 MiB
    in all), the garbage collector off: the process's RSS (the server is in
    it) grows by less than half of that from where three earlier ones left it
    (they warm gRPC's and the allocator's buffers; gRPC's threads' malloc
    arenas still add 10-50 MiB, more on a loaded host, so a bound near one
    request's size would measure the host). A refusal used to keep several times its size
    alive until a collection: cycles through the guard's frame
    (tandem/guard.py, _passes) and through the refusal kept in
    RewardServicer.Evaluate's frame (reward_service/server.py, clear_chain)."""
    import gc

    _, _, _, oip_stub = served
    size = 8 << 20
    request = _raw(tensor={"shape": [1, 2, 6, 7]}, raw_input_contents=[bytes(size)])

    def refuse(times: int) -> None:
        for _ in range(times):
            with pytest.raises(grpc.RpcError) as info:
                oip_stub.ModelInfer(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    gc.collect()
    gc.disable()
    try:
        refuse(3)
        before = _rss_bytes()
        refuse(24)
        grown = _rss_bytes() - before
    finally:
        gc.enable()
    assert grown < 24 * size // 2, f"RSS grew {grown / 2**20:.0f} MiB"


@pytest.mark.skipif(heap.HEAP_TRIMMER._trim is None, reason="the C library has no malloc_trim")
def test_a_refused_large_request_has_the_heaps_trimmed(served):
    """A refusal after a request message of 1 MiB or more has the heaps
    trimmed once the call has ended (tandem/heap.py, HeapTrimmer)."""
    _, _, _, oip_stub = served
    trims = heap.HEAP_TRIMMER.trims
    with pytest.raises(grpc.RpcError) as info:
        oip_stub.ModelInfer(_raw(raw_input_contents=[bytes(heap.TRIM_AFTER_BYTES)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: heap.HEAP_TRIMMER.trims > trims)


def test_refused_large_requests_leave_no_memory_in_the_heap():
    """Eight refused 16 MiB ModelInfers, two alone and two rounds of three at
    once, to a reward service in a process of its own: its RSS ends within
    50 MiB of where four earlier ones (one alone, three at once: gRPC's
    threads and their buffers) left it. glibc used to raise its mmap threshold
    to each large block freed, so the next requests' copies came from the
    heap, which kept them; build_server fixes the threshold at 1 MiB
    (tandem/heap.py, fix_mmap_threshold). gRPC's receive buffers, under
    1 MiB, still left free space in the heaps of its threads (up to +67 MiB
    here); a large refusal now has the heaps trimmed (tandem/heap.py,
    HeapTrimmer). Three at once may be shed RESOURCE_EXHAUSTED
    (server.queue_wait_target_ms), a refusal too."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ThreadPoolExecutor

    from conftest import serve_reward

    cfg = loopback_config(reward={"models": [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx",
                                              "max_batch_size": 64}]})
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    child = spawn.Process(target=serve_reward, args=(cfg, ready, stop), daemon=True)
    child.start()
    ch = channel(cfg.reward.address)
    try:
        assert ready.wait(120), "the reward service did not start"
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        request = _raw(raw_input_contents=[bytes(16 << 20)])  # the shape says 84 bytes

        def refuse(_=None) -> None:
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=30)
            assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)

        def at_once(n: int) -> None:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(refuse, range(n)))

        refuse()
        at_once(3)
        time.sleep(0.5)  # the server lets go of a request after its answer has gone
        before = _rss_bytes(child.pid)
        for _ in range(2):
            refuse()
            at_once(3)
        time.sleep(0.5)
        grown = _rss_bytes(child.pid) - before
    finally:
        ch.close()
        stop.set()
        child.join(30)
    assert grown < 50 << 20, f"the reward service's RSS grew {grown / 2**20:.0f} MiB"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_one_users_unregister_all_leaves_another_users_regions(served):
    """OIP carries no client id: a region belongs to the caller's connection
    (and uid). A client running as uid 65534 sees, and unregisters, its own
    regions only, cannot register root's object, and root's unregister-all
    leaves its region."""
    import tritonclient.utils.shared_memory as shm
    from test_shared_memory import NOBODY, run_client

    client, service, *_ = served
    mine = shm.create_shared_memory_region("root_in", "/tandem_oip_root", 64)
    key = f"tandem_oip_nobody_{os.getpid()}"
    try:
        client.register_system_shared_memory("root_in", "/tandem_oip_root", 64)
        out = run_client(f"127.0.0.1:{service.port}", f"""
            make_object({key!r})
            def register(name, key):
                return code(lambda: oip.SystemSharedMemoryRegister(service_pb2.SystemSharedMemoryRegisterRequest(
                    name=name, key=key, byte_size=64), timeout=10))
            def status():
                return sorted(oip.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(),
                                                           timeout=10).regions)
            out["root's"] = register("stolen", "/tandem_oip_root")
            out["own"] = register("nobody_in", {key!r})
            out["status"] = status()
            out["unregister all"] = code(lambda: oip.SystemSharedMemoryUnregister(
                service_pb2.SystemSharedMemoryUnregisterRequest(), timeout=10))
            out["after"] = status()
            out["kept"] = register("nobody_kept", {key!r})
            unlink({key!r})
            """, uid=NOBODY)
        assert out["root's"][0] == "PERMISSION_DENIED" and "belongs to uid 0" in out["root's"][1]
        assert out["own"] == out["unregister all"] == out["kept"] == ["OK", ""]
        assert out["status"] == ["nobody_in"] and out["after"] == []
        assert list(client.get_system_shared_memory_status().regions) == ["root_in"]  # left by 65534's unregister-all
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status().regions
        assert [r.name for r in _regions_of(service, NOBODY)] == ["nobody_kept"]
    finally:
        for r in _regions_of(service, NOBODY):
            service.servicer.regions.unregister(r.client_id, r.name, uid=NOBODY)
        shm.destroy_shared_memory_region(mine)


def _regions_of(service, uid: int) -> list:
    """The regions the reward service's table holds for ``uid`` (any client)."""
    return [r for r in list(service.servicer.regions._regions.values()) if r.uid == uid]


def _status(stub) -> list[str]:
    return sorted(stub.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(), timeout=10).regions)


def test_a_connection_neither_sees_nor_unregisters_another_connection_s_regions(served):
    """Issue 41 part 3: OIP regions belong to the connection that registered
    them. Client B of the same user, on a connection of its own, does not list
    A's region, cannot name it (FAILED_PRECONDITION) nor reach it through
    RewardService by A's connection's client id (PERMISSION_DENIED), and its
    unregister-all leaves it; A still infers from it and unregisters it."""
    import tritonclient.utils.shared_memory as shm

    _, service, *_ = served
    address = f"127.0.0.1:{service.port}"
    handle = shm.create_shared_memory_region("conn_a", "/tandem_oip_conn_a", 84)
    a_ch, b_ch = own_connection(address), own_connection(address)
    a, b = service_pb2_grpc.GRPCInferenceServiceStub(a_ch), service_pb2_grpc.GRPCInferenceServiceStub(b_ch)
    try:
        shm.set_shared_memory_region(handle, [boards(1, seed=3)])
        a.SystemSharedMemoryRegister(service_pb2.SystemSharedMemoryRegisterRequest(
            name="conn_a", key="/tandem_oip_conn_a", byte_size=84), timeout=10)
        assert _status(a) == ["conn_a"] and _status(b) == []
        with pytest.raises(grpc.RpcError) as info:
            b.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(name="conn_a"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "another client" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            b.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest(name="conn_a"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        b.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest(), timeout=10)  # all of B's
        (a_peer,) = {r.client_id for r in service.servicer.regions._regions.values() if r.name == "conn_a"}
        assert a_peer.startswith("open-inference-protocol@ipv4:127.0.0.1:")
        with pytest.raises(grpc.RpcError) as info:  # A's connection's id, named over RewardService by B
            reward_pb2_grpc.RewardServiceStub(b_ch).UnregisterSharedMemory(
                reward_pb2.UnregisterSharedMemoryRequest(client_id=a_peer), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another connection" in info.value.details()
        infer_request = _shm_infer("conn_a")
        with pytest.raises(grpc.RpcError) as info:
            b.ModelInfer(infer_request, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert a.ModelInfer(infer_request, timeout=30).outputs[0].name == "value"
        assert _status(a) == ["conn_a"]
        a.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest(), timeout=10)
        assert _status(a) == []
    finally:
        a_ch.close()
        b_ch.close()
        shm.destroy_shared_memory_region(handle)


def _shm_infer(region: str) -> service_pb2.ModelInferRequest:
    """A ModelInfer of one board read from ``region`` (84 bytes at its start)."""
    return _raw(tensor={"parameters": {"shared_memory_region": P(string_param=region),
                                       "shared_memory_byte_size": P(int64_param=84)}}, raw_input_contents=[])


def test_a_client_that_reconnects_keeps_its_regions(served):
    """Once the registering connection is closed, the next connection of the
    same user that names the region adopts it: it infers from it, lists it and
    unregisters it (Triton's regions outlive a connection)."""
    import tritonclient.utils.shared_memory as shm

    _, service, *_ = served
    address = f"127.0.0.1:{service.port}"
    handle = shm.create_shared_memory_region("moved", "/tandem_oip_moved", 84)
    try:
        shm.set_shared_memory_region(handle, [boards(1, seed=4)])
        with own_connection(address) as first:
            service_pb2_grpc.GRPCInferenceServiceStub(first).SystemSharedMemoryRegister(
                service_pb2.SystemSharedMemoryRegisterRequest(name="moved", key="/tandem_oip_moved", byte_size=84),
                timeout=10)
        (owner,) = {r.client_id for r in service.servicer.regions._regions.values() if r.name == "moved"}
        assert closed(owner.split("@", 1)[1], service.port)
        with own_connection(address) as again:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(again)
            assert stub.ModelInfer(_shm_infer("moved"), timeout=30).outputs[0].name == "value"
            assert _status(stub) == ["moved"]
            stub.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest(), timeout=10)
            assert _status(stub) == []
    finally:
        shm.destroy_shared_memory_region(handle)
