from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("client",)
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    client: str
    def __init__(self, client: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("api_version", "api_revision", "server_version", "services", "capabilities", "max_message_bytes", "keepalive_min_ping_interval_ms", "auth_required")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_REVISION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_MIN_PING_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    api_version: str
    api_revision: int
    server_version: str
    services: _containers.RepeatedScalarFieldContainer[str]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    keepalive_min_ping_interval_ms: int
    auth_required: bool
    def __init__(self, api_version: _Optional[str] = ..., api_revision: _Optional[int] = ..., server_version: _Optional[str] = ..., services: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., keepalive_min_ping_interval_ms: _Optional[int] = ..., auth_required: bool = ...) -> None: ...
