"""How client input appears in error messages (the status contract).

gRPC sends a status message as trailing metadata, which clients refuse beyond
their metadata limit (8 KiB by default: the call then fails RESOURCE_EXHAUSTED
"metadata exceeds limit" in place of its real status). So a message quotes
client text through :func:`quote`, and the servers' interceptor caps every
message at :data:`MAX_DETAILS_CHARS` whatever a handler wrote.
"""
from __future__ import annotations

#: Longest status message a tandem server sends (characters); longer ones are cut.
MAX_DETAILS_CHARS = 1024
#: Longest stretch of one client-supplied value quoted in a message (characters).
QUOTE_CHARS = 64


def quote(text: object, limit: int = QUOTE_CHARS) -> str:
    """``repr`` of client-supplied ``text`` (str or bytes; anything else via
    ``str``), cut to its first ``limit`` characters with ``...`` and the full
    length when longer: ``quote("m" * 20000)`` -> ``'mmm...m'... (20000 chars)``."""
    if not isinstance(text, (str, bytes)):
        text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} {'chars' if isinstance(text, str) else 'bytes'})"


def cap(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``details`` cut to ``limit`` characters (a status message the client can always read)."""
    if details is None or len(details) <= limit:
        return details
    suffix = f"... ({len(details)} chars)"
    return details[: limit - len(suffix)] + suffix
