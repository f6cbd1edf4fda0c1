"""The Open Inference Protocol (KServe v2 ``inference.GRPCInferenceService``)
beside RewardService, over the same servicer, batchers and request classes.

The service definitions are the ones ``tritonclient[grpc]`` ships (its
``service_pb2`` / ``service_pb2_grpc`` / ``model_config_pb2``), so this needs
the ``oip`` extra; without it the reward server serves RewardService alone
and logs why (:func:`registrar`).

Served: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata,
ModelInfer, Triton's ModelConfig and ModelStatistics (what perf_analyzer and
Model Analyzer read), and Triton's system and CUDA shared-memory calls
(Register / Status / Unregister), mapped onto RewardService's region table
(reward_service/shared_memory.py). Everything else (streaming, the model
repository, trace and log settings) answers UNIMPLEMENTED.

ModelInfer is translated into an EvaluateRequest and answered by
:meth:`RewardServicer.Evaluate`, so validation, batching, deadlines, status
codes and the per-model metrics are RewardService's own:

* tensors travel as ``raw_input_contents`` (one entry per input, in order);
  typed ``contents`` are refused;
* datatypes BOOL, UINT8, INT8, INT32, INT64, FP16, FP32, FP64;
* request parameters: ``priority`` (Triton's: 0 default = 2; 1 is the
  critical lane, 2 the bulk lane; ModelConfig says ``priority_levels: 2``)
  and ``timeout`` (µs, a server-side deadline; the call's gRPC deadline
  applies too); any other parameter is INVALID_ARGUMENT, named;
* ``model_version``: empty, or the model's version (the sha256 prefix of its
  file, as RewardService's ModelMetadata reports); another is NOT_FOUND;
* shared memory: an input or requested output may name a region with the
  parameters ``shared_memory_region``, ``shared_memory_byte_size`` and
  ``shared_memory_offset`` (Triton's); such an input has no
  ``raw_input_contents`` entry, such an output an empty one. The protocol
  carries no client id, so a region belongs to the connection that
  registered it (of the caller's uid, its loopback peer's, tandem/peer.py, as
  every registration's): the region table's client
  ``open-inference-protocol@<peer>``
  (reward_service/shared_memory.py, ``connection_client``). Status and
  unregister-all see and remove that connection's regions only; another
  connection naming one in ModelInfer, Status or Unregister is refused as
  another client (FAILED_PRECONDITION), until the registering connection is
  closed: then the first connection of the same user that names the region
  (or lists or unregisters all of its own) adopts it, so a client that
  reconnects keeps its regions. A RewardService call may name only its own
  connection's id (PERMISSION_DENIED otherwise). Region names are unique on
  the server, as Triton's. Regions are leased like RewardService's: every use
  or status call renews a region, one left unused for
  ``reward.shared_memory.lease_ttl_ms`` is unregistered (a closed
  connection's too, unless adopted first).
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc
from tandem.v1 import reward_pb2

from reward_service.batcher import LANES
from reward_service.shared_memory import CONNECTION_CLIENT_PREFIX, connection_client
from tandem import contract, peer

log = logging.getLogger(__name__)

# OIP datatype names <-> tandem.v1.DataType (those both know).
DATATYPES = {
    "BOOL": reward_pb2.DATA_TYPE_BOOL,
    "UINT8": reward_pb2.DATA_TYPE_UINT8,
    "INT8": reward_pb2.DATA_TYPE_INT8,
    "INT32": reward_pb2.DATA_TYPE_INT32,
    "INT64": reward_pb2.DATA_TYPE_INT64,
    "FP16": reward_pb2.DATA_TYPE_FLOAT16,
    "FP32": reward_pb2.DATA_TYPE_FLOAT32,
    "FP64": reward_pb2.DATA_TYPE_FLOAT64,
}
_NAMES = {code: name for name, code in DATATYPES.items()}
#: Triton priority level -> request class (0: the default level, 2).
PRIORITY_LEVELS = {1: reward_pb2.REQUEST_CLASS_CRITICAL, 2: reward_pb2.REQUEST_CLASS_BULK}
DEFAULT_PRIORITY_LEVEL = 2
REQUEST_PARAMETERS = ("priority", "timeout")
EXTENSIONS = ("model_configuration", "statistics", "schedule_policy", "parameters", "system_shared_memory",
              "cuda_shared_memory")
SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
PLATFORM = "onnxruntime_onnx"


def _load():
    """tritonclient's generated modules; raises ImportError (or what their
    protobuf runtime check raises) where they cannot be imported."""
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

    return model_config_pb2, service_pb2, service_pb2_grpc


def registrar(reward, serving: Callable[[], bool]) -> Callable[[grpc.Server], str] | None:
    """A ``register`` function for tandem.server.build_server that adds the
    OIP servicer over ``reward`` (a RewardServicer), or None (logged) where
    tritonclient's service definitions cannot be imported.

    ``serving()`` says whether the server takes requests (ServerReady)."""
    try:
        model_config_pb2, service_pb2, service_pb2_grpc = _load()
    except Exception as exc:  # ImportError; a protobuf runtime too new or old for its modules
        log.warning("Open Inference Protocol not served: tritonclient[grpc] is not importable (%s); "
                    "install the oip extra: pip install 'tandem[oip]'", exc)
        return None
    servicer = make_servicer(reward, serving, model_config_pb2, service_pb2, service_pb2_grpc)

    def register(server: grpc.Server) -> str:
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        log.info("serving the Open Inference Protocol (inference.GRPCInferenceService)")
        return service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

    return register


def make_servicer(reward, serving, model_config_pb2, service_pb2, service_pb2_grpc):
    """The GRPCInferenceService servicer over ``reward`` (see the module)."""
    pb, mc = service_pb2, model_config_pb2

    class OpenInferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=serving())

        def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="tandem", version=contract.server_version(),
                                             extensions=list(EXTENSIONS))

        def ModelReady(self, request, context):
            # As Triton: an unknown model or version is not ready (no error).
            session = reward.sessions.get(request.name)
            ready = session is not None and request.version in ("", session.version) and serving()
            return pb.ModelReadyResponse(ready=ready)

        def ModelMetadata(self, request, context):
            s = _session(reward, request.name, request.version, context)
            return pb.ModelMetadataResponse(
                name=s.name, versions=[s.version], platform=PLATFORM,
                inputs=[pb.ModelMetadataResponse.TensorMetadata(name=x.name, datatype=_NAMES[x.dtype], shape=x.shape)
                        for x in s.inputs],
                outputs=[pb.ModelMetadataResponse.TensorMetadata(name=x.name, datatype=_NAMES[x.dtype], shape=x.shape)
                         for x in s.outputs])

        def ModelConfig(self, request, context):
            s = _session(reward, request.name, request.version, context)
            batched = s.mergeable and s.max_batch_size > 0  # the first dimension is the batch

            def dims(shape):
                return list(shape[1:] if batched else shape)

            def type_of(code):
                return mc.DataType.Value(f"TYPE_{_NAMES[code]}")

            gpu = s.execution_provider.startswith("CUDA")
            config = mc.ModelConfig(
                name=s.name, platform=PLATFORM, backend="onnxruntime",
                max_batch_size=s.max_batch_size if batched else 0,
                input=[mc.ModelInput(name=x.name, data_type=type_of(x.dtype), dims=dims(x.shape)) for x in s.inputs],
                output=[mc.ModelOutput(name=x.name, data_type=type_of(x.dtype), dims=dims(x.shape)) for x in s.outputs],
                dynamic_batching=mc.ModelDynamicBatching(
                    preferred_batch_size=list(s.buckets),
                    max_queue_delay_microseconds=int(reward.batchers[s.name].max_queue_delay_s * 1e6),
                    priority_levels=len(PRIORITY_LEVELS), default_priority_level=DEFAULT_PRIORITY_LEVEL),
                instance_group=[mc.ModelInstanceGroup(
                    name=f"{s.name}_{lane}", count=1,
                    kind=mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU)
                    for request_class, lane in LANES.items() if s.lane_runners(request_class)],  # the bulk server: bulk
                parameters={k: mc.ModelParameter(string_value=v)
                            for k, v in {**s.runtime, "execution_provider": s.execution_provider}.items()},
            )
            return pb.ModelConfigResponse(config=config)

        def ModelStatistics(self, request, context):
            names = ([_session(reward, request.name, request.version, context).name] if request.name
                     else sorted(reward.sessions))
            return pb.ModelStatisticsResponse(model_stats=[_statistics(pb, reward, n) for n in names])

        def ModelInfer(self, request, context):
            s = _session(reward, request.model_name, request.model_version, context)
            evaluate, timeout_s = _evaluate_request(s, request, context, connection_client(context.peer()))
            if evaluate.client_id:
                _client(reward, context, {t.shared_memory.region for t in evaluate.inputs
                                          if t.WhichOneof("contents") == "shared_memory"}
                        | {ref.region for ref in evaluate.output_shared_memory.values()})
            reply = reward.Evaluate(evaluate, _DeadlineContext(context, timeout_s))
            return pb.ModelInferResponse(
                model_name=s.name, model_version=s.version, id=request.id,
                outputs=[pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=_NAMES[t.dtype], shape=t.shape,
                                                                 parameters=_output_parameters(pb, t))
                         for t in reply.outputs],
                # One entry per output (clients index them so): empty for one written to shared memory.
                raw_output_contents=[t.data for t in reply.outputs],
                parameters={"queue_ms": pb.InferParameter(double_param=reply.queue_ms),
                            "compute_ms": pb.InferParameter(double_param=reply.compute_ms),
                            "batch_size": pb.InferParameter(int64_param=reply.batch_size)},
            )

        # -- shared memory: Triton's calls over RewardService's (validation, leases, limits)

        def SystemSharedMemoryRegister(self, request, context):
            reward.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
                client_id=connection_client(context.peer()), name=request.name, byte_size=request.byte_size,
                system=reward_pb2.SystemSharedMemory(key=request.key, offset=request.offset)), context)
            return pb.SystemSharedMemoryRegisterResponse()

        def SystemSharedMemoryStatus(self, request, context):
            Status = pb.SystemSharedMemoryStatusResponse.RegionStatus
            return pb.SystemSharedMemoryStatusResponse(regions={
                r.name: Status(name=r.name, key=r.system.key, offset=r.system.offset, byte_size=r.byte_size)
                for r in _regions(reward, "system", request.name, context)})

        def SystemSharedMemoryUnregister(self, request, context):
            _unregister(reward, "system", request.name, context)
            return pb.SystemSharedMemoryUnregisterResponse()

        def CudaSharedMemoryRegister(self, request, context):
            reward.RegisterSharedMemory(reward_pb2.RegisterSharedMemoryRequest(
                client_id=connection_client(context.peer()), name=request.name, byte_size=request.byte_size,
                cuda=reward_pb2.CudaSharedMemory(raw_handle=request.raw_handle, device_id=request.device_id)), context)
            return pb.CudaSharedMemoryRegisterResponse()

        def CudaSharedMemoryStatus(self, request, context):
            Status = pb.CudaSharedMemoryStatusResponse.RegionStatus
            return pb.CudaSharedMemoryStatusResponse(regions={
                r.name: Status(name=r.name, device_id=r.cuda.device_id, byte_size=r.byte_size)
                for r in _regions(reward, "cuda", request.name, context)})

        def CudaSharedMemoryUnregister(self, request, context):
            _unregister(reward, "cuda", request.name, context)
            return pb.CudaSharedMemoryUnregisterResponse()

    return OpenInferenceServicer()


def _client(reward, context, names=None) -> str:
    """This call's connection's client id in the region table, once it has
    adopted the regions ``names`` (None: all) that connections of the same
    user now closed held (reward_service/shared_memory.py, ``RegionTable.adopt``)."""
    def gone(other: str) -> bool:
        return (other.startswith(CONNECTION_CLIENT_PREFIX) and peer.connection_open(
            other[len(CONNECTION_CLIENT_PREFIX):], reward.local_port) is False)

    client = connection_client(context.peer())
    reward.regions.adopt(client, names, lambda: reward.peer_uid(context), gone)
    return client


def _regions(reward, kind: str, name: str, context) -> list:
    """This connection's OIP regions of ``kind`` ("system" or "cuda"), or the
    one named ``name`` (NOT_FOUND when it is of the other kind: Triton keeps
    the two apart)."""
    client = _client(reward, context, [name] if name else None)
    regions = reward.SharedMemoryStatus(reward_pb2.SharedMemoryStatusRequest(client_id=client, name=name),
                                        context).regions
    mine = [r for r in regions if r.WhichOneof("memory") == kind]
    if name and not mine:
        context.abort(grpc.StatusCode.NOT_FOUND, f"name: no {kind} shared-memory region named {name[:80]!r}")
    return mine


def _unregister(reward, kind: str, name: str, context) -> None:
    """Unregisters the OIP region ``name`` of ``kind`` (empty: every one of that kind)."""
    client = connection_client(context.peer())
    for r in _regions(reward, kind, name, context):
        reward.UnregisterSharedMemory(reward_pb2.UnregisterSharedMemoryRequest(client_id=client, name=r.name),
                                      context)


def _output_parameters(pb, tensor) -> dict:
    """An output written to shared memory names its region and the bytes written (Triton's parameters)."""
    if tensor.WhichOneof("contents") != "shared_memory":
        return {}
    ref = tensor.shared_memory
    return {"shared_memory_region": pb.InferParameter(string_param=ref.region),
            "shared_memory_byte_size": pb.InferParameter(int64_param=ref.byte_size),
            "shared_memory_offset": pb.InferParameter(int64_param=ref.offset)}


def _shared_memory_ref(field: str, parameters, refuse) -> reward_pb2.SharedMemoryRef | None:
    """The region a tensor's parameters name (None: none), refusing unknown
    parameters and values of the wrong type, naming them."""
    values = {}
    for key, p in parameters.items():
        if key not in SHM_PARAMETERS:
            refuse(f"{field}.parameters: unknown parameter {key[:80]!r} (known: {list(SHM_PARAMETERS)})")
        values[key] = _parameter_value(p)
    if not values:
        return None
    region, size, offset = (values.get(k) for k in SHM_PARAMETERS)
    if not isinstance(region, str) or not region:
        refuse(f"{field}.parameters['shared_memory_region']: a region name is needed with {sorted(values)}")
    for key, v in (("shared_memory_byte_size", size), ("shared_memory_offset", offset or 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            refuse(f"{field}.parameters[{key!r}]: {v!r} is not a byte count (an integer >= 0)")
    return reward_pb2.SharedMemoryRef(region=region, offset=offset or 0, byte_size=size)


def _session(reward, name: str, version: str, context):
    """The model named ``name`` at ``version`` ("" : the one served);
    NOT_FOUND, naming the field, for another."""
    session = reward.sessions.get(name)
    if session is None:
        context.abort(grpc.StatusCode.NOT_FOUND, f"model_name: no model named {name[:80]!r} "
                                                 f"(models: {sorted(reward.sessions)})")
    if version not in ("", session.version):
        context.abort(grpc.StatusCode.NOT_FOUND, f"model_version: model {name!r} has version {session.version!r}, "
                                                 f"not {version[:80]!r}")
    return session


def _parameter_value(p):
    """An InferParameter's value, whichever field is set (None: none)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _evaluate_request(session, request, context, client_id: str) -> tuple[reward_pb2.EvaluateRequest, float | None]:
    """The EvaluateRequest for a ModelInferRequest (``client_id``: its regions'
    owner, where it names any), and the ``timeout`` parameter in seconds (None: none). Refuses (INVALID_ARGUMENT, naming the
    field) what has no EvaluateRequest equivalent; everything else is checked
    by RewardServicer.Evaluate."""
    def refuse(message: str):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    # Counts first, before any work per entry: a message of millions of entries is refused at once.
    for field, count, most in (("inputs", len(request.inputs), len(session.inputs)),
                               ("outputs", len(request.outputs), len(session.outputs)),
                               ("raw_input_contents", len(request.raw_input_contents), len(session.inputs)),
                               ("parameters", len(request.parameters), len(REQUEST_PARAMETERS))):
        if count > most:
            refuse(f"{field}: {count} entries; model {session.name!r} takes at most {most}")
    request_class, timeout_s = PRIORITY_LEVELS[DEFAULT_PRIORITY_LEVEL], None
    for key, p in request.parameters.items():
        value = _parameter_value(p)
        if key == "priority":
            level = value if isinstance(value, int) and not isinstance(value, bool) else None
            if level is None or not (level == 0 or level in PRIORITY_LEVELS):
                refuse(f"parameters['priority']: {value!r} is not a priority level (0: default; "
                       f"1: critical lane; 2: bulk lane)")
            request_class = PRIORITY_LEVELS[level or DEFAULT_PRIORITY_LEVEL]
        elif key == "timeout":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                refuse(f"parameters['timeout']: {value!r} is not a timeout in microseconds (an integer >= 0)")
            timeout_s = value / 1e6 if value else None  # Triton: 0 is no timeout
        else:
            refuse(f"parameters[{key[:80]!r}]: unknown parameter (known: {list(REQUEST_PARAMETERS)})")
    refs = [_shared_memory_ref(f"inputs[{i}] ({t.name[:80]!r})", t.parameters, refuse)
            for i, t in enumerate(request.inputs)]
    raw_inputs = [t for t, ref in zip(request.inputs, refs) if ref is None]
    if len(request.raw_input_contents) != len(raw_inputs):
        refuse(f"raw_input_contents: {len(request.raw_input_contents)} entries for {len(raw_inputs)} inputs "
               f"not in shared memory (send their bytes there, in the order of inputs)")
    raw = iter(request.raw_input_contents)
    inputs = []
    for i, (t, ref) in enumerate(zip(request.inputs, refs)):
        field = f"inputs[{i}] ({t.name[:80]!r})"
        if t.HasField("contents"):
            refuse(f"{field}.contents: typed contents are not served; send raw_input_contents")
        if t.datatype not in DATATYPES:
            refuse(f"{field}.datatype: {t.datatype[:20]!r} is not served (datatypes: {list(DATATYPES)})")
        where = {"shared_memory": ref} if ref is not None else {"data": next(raw)}
        inputs.append(reward_pb2.Tensor(name=t.name, dtype=DATATYPES[t.datatype], shape=t.shape, **where))
    output_refs = {}
    for i, o in enumerate(request.outputs):
        ref = _shared_memory_ref(f"outputs[{i}] ({o.name[:80]!r})", o.parameters, refuse)
        if ref is not None:
            output_refs[o.name] = ref
    shared = output_refs or any(ref is not None for ref in refs)
    evaluate = reward_pb2.EvaluateRequest(model=session.name, inputs=inputs, request_class=request_class,
                                          output_names=[o.name for o in request.outputs],
                                          output_shared_memory=output_refs, client_id=client_id if shared else "")
    return evaluate, timeout_s


class _DeadlineContext:
    """The call's context, its remaining time cut to the request's ``timeout``
    parameter where that is sooner (RewardServicer.Evaluate reads
    ``time_remaining``)."""

    def __init__(self, context, timeout_s: float | None):
        self._context, self._timeout_s = context, timeout_s

    def time_remaining(self):
        remaining = self._context.time_remaining()
        if self._timeout_s is None:
            return remaining
        return self._timeout_s if remaining is None else min(remaining, self._timeout_s)

    def __getattr__(self, name):
        return getattr(self._context, name)


def _statistics(pb, reward, name: str):
    """Triton's ModelStatistics for one model, from the per-model totals
    (reward_service/model_metrics.py). Compute time is the model run's, all
    of it as ``compute_infer`` (input and output copies are inside the run)."""
    t = reward.metrics.totals(name)

    def duration(d):
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    return pb.ModelStatistics(
        name=name, version=reward.sessions[name].version, last_inference=t.last_inference_ms,
        inference_count=t.inference_count, execution_count=t.execution_count,
        inference_stats=pb.InferStatistics(success=duration(t.success), fail=duration(t.fail),
                                           queue=duration(t.queue), compute_infer=duration(t.compute),
                                           compute_input=pb.StatisticDuration(count=t.compute.count),
                                           compute_output=pb.StatisticDuration(count=t.compute.count)),
        batch_stats=[pb.InferBatchStatistics(batch_size=rows, compute_infer=duration(d),
                                             compute_input=pb.StatisticDuration(count=d.count),
                                             compute_output=pb.StatisticDuration(count=d.count))
                     for rows, d in sorted(t.batches.items())],
    )

