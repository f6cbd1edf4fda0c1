"""ContractService (protos/tandem/v1/contract.proto): every tandem server
answers Handshake with the API version and revision it speaks, its services
and capabilities, and the limits a client must respect.

The versioning policy (docs/engine_integration.md, "Versioning"): tandem.v1
changes only additively, each additive change raises :data:`API_REVISION`;
a breaking change is a new package, tandem.v2, served beside v1. CI holds the
policy with ``buf lint`` and ``buf breaking`` against the committed image of
the last release (protos/baseline/, tests/ground/test_contract.py).
"""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Iterable

from tandem.v1 import contract_pb2, contract_pb2_grpc

log = logging.getLogger(__name__)

API_VERSION = "tandem.v1"
#: 1: the first release, as committed in protos/baseline/tandem-v1.binpb;
#: 2: ContractService (this Handshake);
#: 3: SearchService.SearchBatch (an engine's agents in one call);
#: 4: GameInfo's evaluators, value_model, backend, backend_note and boards (the games of search.games).
API_REVISION = 4
SERVICE_NAME = contract_pb2.DESCRIPTOR.services_by_name["ContractService"].full_name


def server_version() -> str:
    """The installed tandem distribution's version ("unknown" when run from a bare checkout)."""
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ContractServicer(contract_pb2_grpc.ContractServiceServicer):
    """Answers Handshake from fixed facts (no shared mutable state).

    ``services``: the full names the server serves (its own included);
    ``capabilities``: what it offers beyond its services' base calls;
    ``max_message_bytes`` and ``keepalive_min_ping_interval_ms``: its limits;
    ``auth_required``: whether calls need a bearer token.
    """

    def __init__(self, services: Iterable[str], capabilities: Iterable[str], max_message_bytes: int,
                 keepalive_min_ping_interval_ms: int, auth_required: bool):
        self._response = contract_pb2.HandshakeResponse(
            api_version=API_VERSION, api_revision=API_REVISION, server_version=server_version(),
            services=sorted(set(services)), capabilities=sorted(set(capabilities)),
            max_message_bytes=max_message_bytes, keepalive_min_ping_interval_ms=keepalive_min_ping_interval_ms,
            auth_required=auth_required)

    def Handshake(self, request, context):
        if request.client:
            log.debug("handshake from %s (%s)", request.client[:120], context.peer())
        return self._response
