"""What every HTTP dialect shares: reading a bounded body, JSON answers, and an error's HTTP status
and body from the one error table (service/errors.py `status_of`).

The status of an error is its gRPC code's (`HTTP_STATUS`), with each dialect's own choices where it
has them (TEI: 422 for invalid input, 424 for a model failure). A body over `max_message_bytes` is 413
before anything of it is parsed (its Content-Length is looked at first; a chunked body is cut at the
limit). RESOURCE_EXHAUSTED carries Retry-After. Nothing ever answers a traceback: an unexpected
error is INTERNAL with a reference id (service/doors/calls.py `Calls.failure`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from service.config import ServiceConfig
from service.errors import InvalidInput, NotAcceptable, Overloaded, ReadTimeout, ServiceError, TooLarge, status_of

JSON = "application/json"
HTTP_STATUS: Mapping[str, int] = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
    "DEADLINE_EXCEEDED": 504, "UNAVAILABLE": 503, "UNAUTHENTICATED": 401, "INTERNAL": 500, "CANCELLED": 499,
}


def http_status(error: ServiceError, invalid: int = 400, internal: int = 500) -> int:
    if isinstance(error, NotAcceptable):
        return error.status
    if isinstance(error, TooLarge):
        return 413
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
    return web.Response(body=json.dumps(value, separators=(",", ":"), allow_nan=False).encode(), status=status,
                        content_type=JSON, headers=headers)


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
    return bytes(data)


def parse_json(raw: bytes, field: str = "body") -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidInput(field, "is not valid JSON") from None


async def read_json(request: web.Request, config: ServiceConfig) -> Any:
    """The request's body as JSON, bounded as `read_body` bounds it."""
    return parse_json(await read_body(request, config.max_message_bytes, config.http_read_timeout_s))


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


def known_fields(body: Mapping[str, Any], known: frozenset[str], where: str = "") -> None:
    """Refuse a field the route does not know: a misspelt option is never silently ignored."""
    for name in body:
        if name not in known:
            shown = name if name.isidentifier() and len(name) <= 64 else "(not shown)"
            raise InvalidInput(f"{where}{shown}", f"unknown field; known: {', '.join(sorted(known))}")


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
