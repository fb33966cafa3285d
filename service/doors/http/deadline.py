"""The caller's deadline on HTTP: the `grpc-timeout` header, in gRPC's own format.

`grpc-timeout: <1 to 8 digits><unit>`, unit H (hours), M (minutes), S (seconds), m (milliseconds),
u (microseconds) or n (nanoseconds): the header a gRPC caller's deadline travels in, and the one
grpc-gateway reads from HTTP/JSON callers. It counts from the moment the door has the request's
headers and bounds the rest of the call (body, plan, queue and compute) exactly as a gRPC deadline
does: a longer one than `default_timeout_s` is honoured, one too short to be met is refused at the
door (`min_deadline_ms`), one that passes in the queue or the model ends the call DEADLINE_EXCEEDED
(504). Absent: `default_timeout_s`. Malformed (or sent twice): 400 naming the header. See docs/http.md.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from contextvars import ContextVar

from service.errors import NotAcceptable, shown

HEADER = "grpc-timeout"
UNITS: Mapping[str, float] = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_FORMAT = re.compile(r"([0-9]{1,8})([HMSmun])")
# The deadline (time.monotonic()) of the call this task handles: aiohttp runs each request's handler
# in its own task, so it is the request's own; set by `start`, before anything else of the call.
_DEADLINE: ContextVar[float] = ContextVar("http_deadline")


def start(values: list[str], default_s: float) -> None:
    """Begin the call's clock: its deadline from the header's values, counted from now."""
    _DEADLINE.set(time.monotonic() + timeout_s(values, default_s))


def remaining() -> float:
    """Seconds left to the call this task handles (negative once passed)."""
    return _DEADLINE.get() - time.monotonic()


def timeout_s(values: list[str], default_s: float) -> float:
    """Seconds the call may take, from the `grpc-timeout` header's values (none: `default_s`)."""
    if not values:
        return default_s
    if len(values) > 1:
        raise NotAcceptable(400, f"header {HEADER}: sent {len(values)} times; send it once")
    match = _FORMAT.fullmatch(values[0].strip())
    if match is None:
        raise NotAcceptable(400, f"header {HEADER}: {shown(values[0])} is not a gRPC timeout "
                                 "(1 to 8 digits and a unit H, M, S, m, u or n, e.g. 2S or 500m)")
    return int(match.group(1)) * UNITS[match.group(2)]
