"""The port a bind failure suggests instead: never a port the configuration already gives to the other front end
(a busy server.port=8000 must not suggest server.port=8001 when server.http_port=8001)."""

from __future__ import annotations

FALLBACK_PORT = 50052


def suggested_port(busy: int, taken_ports: tuple[int | None, ...] = ()) -> int:
    """The next port after `busy` that is not in `taken_ports` (wrapping to a high port at the top of the range)."""
    candidate = busy + 1 if 0 < busy < 65535 else FALLBACK_PORT
    while candidate in taken_ports or candidate == busy:
        candidate = candidate + 1 if candidate < 65535 else 1024
    return candidate
