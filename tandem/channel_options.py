"""gRPC channel options for a client of tandem's servers: tandem's own commands,
and a bot or engine tool that installs only the thin client (``tandem-client``)::

    channel = grpc.insecure_channel("127.0.0.1:50052", options=CHANNEL_OPTIONS + KEEPALIVE_OPTIONS)

Nothing here imports more than the standard library.
"""
from __future__ import annotations

# The servers' default receive and send limit per message (server.max_message_bytes
# in tandem/config.py): a frame batch of 64 224x224 RGB frames is 9.6 MB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

# For a connection held open between games: ping after 30 s idle, give up after 10 s
# without an answer. The servers take pings without calls no more often than every
# 10 s (server.keepalive_min_ping_interval_ms); a client pinging faster is cut off.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
