from tandem.v1 import search_pb2 as _search_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_KIND_UNSPECIFIED: _ClassVar[ServiceKind]
    SERVICE_KIND_SEARCH: _ClassVar[ServiceKind]
    SERVICE_KIND_REWARD: _ClassVar[ServiceKind]
SERVICE_KIND_UNSPECIFIED: ServiceKind
SERVICE_KIND_SEARCH: ServiceKind
SERVICE_KIND_REWARD: ServiceKind

class RegisterRequest(_message.Message):
    __slots__ = ("kind", "instance", "address", "stream_priorities", "memory_bytes", "pid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    kind: ServiceKind
    instance: str
    address: str
    stream_priorities: _containers.RepeatedScalarFieldContainer[int]
    memory_bytes: int
    pid: int
    def __init__(self, kind: _Optional[_Union[ServiceKind, str]] = ..., instance: _Optional[str] = ..., address: _Optional[str] = ..., stream_priorities: _Optional[_Iterable[int]] = ..., memory_bytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[float] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("generation", "lease_id", "stream_priority", "memory_pool_bytes", "policy", "active_thread_percentage", "decided_unix_ms", "urgency", "bulk_share_percent", "frames_at_risk")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_THREAD_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    BULK_SHARE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_AT_RISK_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lease_id: str
    stream_priority: int
    memory_pool_bytes: int
    policy: str
    active_thread_percentage: int
    decided_unix_ms: float
    urgency: float
    bulk_share_percent: int
    frames_at_risk: bool
    def __init__(self, generation: _Optional[int] = ..., lease_id: _Optional[str] = ..., stream_priority: _Optional[int] = ..., memory_pool_bytes: _Optional[int] = ..., policy: _Optional[str] = ..., active_thread_percentage: _Optional[int] = ..., decided_unix_ms: _Optional[float] = ..., urgency: _Optional[float] = ..., bulk_share_percent: _Optional[int] = ..., frames_at_risk: bool = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease", "assignment")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    assignment: Assignment
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ...) -> None: ...

class WatchAssignmentsRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("lease_id", "phase", "search_depth", "deadline_slack_ms", "queue_age_ms", "queue_depth", "requests_per_s", "memory_used_bytes", "critical_latency_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SEARCH_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SLACK_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    phase: _search_pb2.GamePhase
    search_depth: int
    deadline_slack_ms: float
    queue_age_ms: float
    queue_depth: int
    requests_per_s: float
    memory_used_bytes: int
    critical_latency_ms: float
    def __init__(self, lease_id: _Optional[str] = ..., phase: _Optional[_Union[_search_pb2.GamePhase, str]] = ..., search_depth: _Optional[int] = ..., deadline_slack_ms: _Optional[float] = ..., queue_age_ms: _Optional[float] = ..., queue_depth: _Optional[int] = ..., requests_per_s: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., critical_latency_ms: _Optional[float] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("kind", "instance", "address", "lease", "assignment", "last_load", "lease_expires_in_ms", "urgency")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    kind: ServiceKind
    instance: str
    address: str
    lease: Lease
    assignment: Assignment
    last_load: LoadReport
    lease_expires_in_ms: float
    urgency: float
    def __init__(self, kind: _Optional[_Union[ServiceKind, str]] = ..., instance: _Optional[str] = ..., address: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., last_load: _Optional[_Union[LoadReport, _Mapping]] = ..., lease_expires_in_ms: _Optional[float] = ..., urgency: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("policy", "mps_active", "mps_message", "priorities_enforced", "services", "least_priority", "greatest_priority", "gpu", "decisions", "frames_at_risk", "bulk_share_changes")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MPS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MPS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_ENFORCED_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    LEAST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GREATEST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_AT_RISK_FIELD_NUMBER: _ClassVar[int]
    BULK_SHARE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    mps_active: bool
    mps_message: str
    priorities_enforced: bool
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    least_priority: int
    greatest_priority: int
    gpu: str
    decisions: int
    frames_at_risk: bool
    bulk_share_changes: int
    def __init__(self, policy: _Optional[str] = ..., mps_active: bool = ..., mps_message: _Optional[str] = ..., priorities_enforced: bool = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., least_priority: _Optional[int] = ..., greatest_priority: _Optional[int] = ..., gpu: _Optional[str] = ..., decisions: _Optional[int] = ..., frames_at_risk: bool = ..., bulk_share_changes: _Optional[int] = ...) -> None: ...
