"""What every HTTP dialect shares: reading a bounded body, JSON in and out, and an error's HTTP status
and body from the one error table (service/errors.py `status_of`).

The status of an error is its gRPC code's (`HTTP_STATUS`), with each dialect's own choices where it
has them (TEI: 422 for invalid input, 424 for a model failure). A body over `max_message_bytes` is 413
before anything of it is parsed (its Content-Length is looked at first; a chunked body is cut at the
limit); a body that is not what its Content-Encoding says is 400. RESOURCE_EXHAUSTED and UNAVAILABLE
carry Retry-After. Nothing ever answers a traceback: an unexpected error is INTERNAL with a reference id
(service/doors/calls.py `Calls.failure`).

JSON work is bounded before it is done and kept off the event loop when it is big: a body's JSON values are
counted (an upper bound, from its commas and brackets, in one pass of C) against the route's own bound
before it is parsed, a body over `INLINE_BYTES` is read and parsed in a worker thread, and an answer of
more than `INLINE_VALUES` numbers is written in one (orjson writes numpy arrays without Python floats).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from service.config import ServiceConfig
from service.errors import (
    EmptyInput,
    InvalidInput,
    NotAcceptable,
    NotReady,
    Overloaded,
    ReadTimeout,
    ServiceError,
    ShuttingDown,
    TooLarge,
    status_of,
)

JSON = "application/json"
INLINE_BYTES = 64 << 10  # a bigger body is parsed in a worker thread (orjson: about 1 ms per 100 kB of small values)
INLINE_VALUES = 1 << 16  # an answer with more numbers than this is written in a worker thread
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
HTTP_STATUS: Mapping[str, int] = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
    "DEADLINE_EXCEEDED": 504, "UNAVAILABLE": 503, "UNAUTHENTICATED": 401, "INTERNAL": 500, "CANCELLED": 499,
}


def http_status(error: ServiceError, invalid: int = 400, internal: int = 500) -> int:
    if isinstance(error, NotAcceptable):
        return error.status
    if isinstance(error, TooLarge):
        return 413
    if isinstance(error, EmptyInput):
        return 400
    if isinstance(error, ReadTimeout):
        return 408
    code = status_of(error)
    if code == "INVALID_ARGUMENT":
        return invalid
    if code == "INTERNAL":
        return internal
    return HTTP_STATUS[code]


@dataclass(frozen=True)
class Dialect:
    """How one API family answers an error: its statuses for invalid input and model failures, and its body."""

    name: str
    body: Callable[[ServiceError, int], Any]
    invalid: int = 400
    internal: int = 500

    def error(self, error: ServiceError) -> web.Response:
        status = http_status(error, self.invalid, self.internal)
        headers = {}
        if isinstance(error, Overloaded):
            headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
        elif isinstance(error, NotReady | ShuttingDown):  # loading, or draining: this replica or another, soon
            headers["Retry-After"] = "1"
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return json_response(self.body(error, status), status, headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    """One route of a dialect: `<verb> <path>` (an aiohttp pattern) is also its `method` label in
    attention_requests_total. A health route asks for no token and is not counted."""

    verb: str
    path: str
    handle: Handler
    health: bool = False


@dataclass(frozen=True)
class Routes:
    """A dialect's routes, and the path prefix it answers errors for (a path no route has, a wrong verb)."""

    dialect: Dialect
    prefix: str
    routes: Sequence[Route]


def field_of(error: ServiceError) -> str | None:
    return error.field if isinstance(error, InvalidInput) and error.field != "request" else None


def json_response(value: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """`value` (numpy arrays in it written as lists) as a JSON answer, on the calling thread."""
    return web.Response(body=orjson.dumps(value, option=_NUMPY), status=status, content_type=JSON, headers=headers)


async def json_answer(value: Any, numbers: int, headers: Mapping[str, str] | None = None) -> web.Response:
    """`json_response`, written in a worker thread when it holds more than INLINE_VALUES `numbers`."""
    if numbers > INLINE_VALUES:
        body = await asyncio.to_thread(orjson.dumps, value, option=_NUMPY)
        return web.Response(body=body, content_type=JSON, headers=headers)
    return json_response(value, headers=headers)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request's body, at most `limit` bytes (413 over it, checked before reading when the length
    is declared), within `timeout_s` (408)."""
    length = request.content_length
    if length is not None and length > limit:
        raise TooLarge("body", f"{length} bytes, over max_message_bytes {limit}")
    try:
        async with asyncio.timeout(timeout_s):
            data = bytearray()
            while chunk := await request.content.read(1 << 16):
                data += chunk
                if len(data) > limit:
                    raise TooLarge("body", f"over max_message_bytes {limit}")
    except TimeoutError:
        raise ReadTimeout("body", f"not received within {timeout_s:g} s") from None
    except (HttpProcessingError, web.RequestPayloadError):
        # aiohttp inflating a body that is not what its Content-Encoding says (gzip, deflate, br): the caller's.
        encoding = request.headers.get("Content-Encoding", "")
        shown = encoding if encoding.isidentifier() and len(encoding) <= 16 else "its"
        raise InvalidInput("body", f"is not valid {shown} data (Content-Encoding)") from None
    return bytes(data)


_SCAN = 1 << 20  # bytes of a body `json_values` looks at in one numpy step


def json_values(raw: bytes, stop: int | None = None) -> int:
    """An upper bound on the JSON values `raw` holds, counted without parsing it: one, and one for each comma
    and opening bracket outside a string (every value but a container's first follows a comma). Escaped
    characters are dropped first (a pair of backslashes, then a backslash and the quote it escapes), so the
    quotes left open and close strings. In numpy steps of _SCAN bytes; stops counting past `stop`."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    count, inside = 1, 0
    for start in range(0, len(raw), _SCAN):
        chunk = np.frombuffer(raw, np.uint8, count=min(_SCAN, len(raw) - start), offset=start)
        strings = np.bitwise_xor.accumulate((chunk == 0x22).view(np.uint8)) ^ inside  # 1 inside a string
        inside = int(strings[-1])
        count += int(np.count_nonzero(((chunk == 0x2C) | (chunk == 0x5B) | (chunk == 0x7B)) & (strings == 0)))
        if stop is not None and count > stop:
            break
    return count


def parse_json(raw: bytes, field: str = "body", max_values: int | None = None) -> Any:
    """`raw` as JSON; over `max_values` values (`json_values`) it is refused before it is parsed (413)."""
    if max_values is not None and json_values(raw, max_values) > max_values:
        raise TooLarge(field, f"holds more than {max_values} JSON values, the most this route takes")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # lone surrogates too: no text of them can be tokenized
        raise InvalidInput(field, f"is not valid JSON ({str(exc)[:80]})") from None


async def read_json(request: web.Request, config: ServiceConfig, max_values: int,
                    decode: Callable[[Any], Any] | None = None) -> Any:
    """The request's body as JSON (bounded as `read_body` bounds it, at most `max_values` values), then
    `decode(value)` when given: both in a worker thread when the body is over INLINE_BYTES."""
    raw = await read_body(request, config.max_message_bytes, config.http_read_timeout_s)

    def work() -> Any:
        value = parse_json(raw, max_values=max_values)
        return decode(value) if decode is not None else value

    return await asyncio.to_thread(work) if len(raw) > INLINE_BYTES else work()


def text_values(config: ServiceConfig) -> int:
    """The JSON values a route that takes texts or token ids may need: every id of a call, a few for each of
    its sequences (a pair's texts and their array), and its options."""
    return config.max_tokens_per_call + 4 * config.max_sequences_per_call + 4096


def json_object(value: Any, field: str = "body") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(field, f"must be a JSON object; got {kind(value)}")
    return value


def kind(value: Any) -> str:
    """A JSON value's type, for a message (the value itself is never echoed)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def optional(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any,
             what: str) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise InvalidInput(name, f"must be {what}; got {kind(value)}")
    return value


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def renamed(error: InvalidInput, rename: Callable[[str], str]) -> InvalidInput:
    """`error` with its field named as the door's wire names it (the same type, so the same status)."""
    field = rename(error.field)
    if field == error.field:
        return error
    try:
        copy = type(error)(field, error.description)
    except TypeError:
        return error
    return copy
