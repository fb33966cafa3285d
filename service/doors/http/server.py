"""The HTTP door: an aiohttp application in the gRPC server's event loop, on its own port, serving the routes
its dialects register (OpenAI, TEI, KServe v2 REST, attention.v1 as JSON: each a `Routes`).

Bound when built (a port in use fails start-up as the gRPC port does; SO_REUSEPORT only for the edge
processes of one service), started with the gRPC server, stopped in its drain: the listener closes,
readiness routes answer 503 from the moment the drain starts, and accepted calls have the grace to
finish. TLS with the gRPC port's certificate and key (mutual TLS with `tls_client_ca`); bearer tokens
checked as on gRPC (service/doors/security.py), health routes exempt. Limits: the body by
`max_message_bytes` (413, its Content-Length checked before reading), `http_read_timeout_s` for it
to arrive (408), aiohttp's bounds on the request line and headers (8190 bytes each, 128 headers:
400), `http_keepalive_s` of idle keep-alive. A caller that disconnects cancels its handler, and
with it its queued work (handler_cancellation; service/doors/calls.py `Calls.compute` cancels its items).
The caller's deadline is its `grpc-timeout` header, else `default_timeout_s` (service/doors/http/deadline.py).

Every call of a route (health routes aside) is counted in attention_requests_total{method, code} with
the gRPC code name of its outcome (so the alerts on code="INTERNAL" see this door too), method being
"<VERB> <route>", e.g. "POST /v1/embeddings". Whatever a handler raises is answered in its dialect
(service/doors/http/wire.py `Dialect`), never a traceback. With tracing on (service/tracing.py), the same
calls are traced: the route wrapper starts each one's span, its parent the trace context of the request's
`traceparent`/`tracestate` headers, and ends it with the call's code and HTTP status.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from service.config import ServiceConfig
from service.doors.calls import CALL_MODEL, CALL_TRACE, Calls, Serving, being_cancelled
from service.doors.http import deadline
from service.doors.http.wire import Dialect, Handler, Route, Routes
from service.doors.ports import port_error
from service.doors.security import UNAUTHENTICATED, TokenChecker, load_tokens
from service.errors import NotAcceptable, TooLarge, status_of

log = logging.getLogger(__name__)

MAX_HEADERS = 128
MAX_LINE = 8190


class _PeerErrors(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's log of a request it refused itself (a malformed request line, headers over the bounds):
    one line at INFO without a traceback. The caller has its 400; anyone can send these, so they must
    not fill the log with ERROR tracebacks."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        kind = type(exc_info).__name__ if isinstance(exc_info, BaseException) else "error"
        self.logger.info("%s: %s", str(msg) % args, kind)


def ssl_context(config: ServiceConfig) -> ssl.SSLContext | None:
    """The gRPC port's TLS, for HTTP: same certificate and key; with tls_client_ca, client certificates required."""
    if not config.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        context.load_verify_locations(config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(port_error("HTTP", host, port, reason, "ATTN_HTTP_PORT / --http-port")) from None


class HttpDoor:
    def __init__(self, config: ServiceConfig, calls: Calls, dialects: Sequence[Routes], *,
                 reuse_port: bool = False) -> None:
        self._config = config
        self._calls = calls
        tokens = load_tokens(config)
        self._checker = TokenChecker(tokens) if tokens else None
        self._ssl = ssl_context(config)
        # For a path no route has: the dialect of the longest prefix it starts with.
        self._prefixes = sorted(((d.prefix, d.dialect) for d in dialects), key=lambda p: -len(p[0]))
        # (verb, path) of the health routes: GET / is health, POST / is not (TEI's root routes).
        self._health = frozenset((r.verb, r.path) for d in dialects for r in d.routes if r.health)
        self.app = web.Application(client_max_size=config.max_message_bytes, middlewares=[self._middleware])
        for d in dialects:
            for route in d.routes:
                self._add(route, d.dialect)
        self._socket = bind(config.host, config.http_port, reuse_port)
        self.port: int = self._socket.getsockname()[1]
        self._runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None, handler_cancellation=True,
            logger=_PeerErrors(logging.getLogger("service.doors.http.peer"), {}),
            keepalive_timeout=config.http_keepalive_s, max_line_size=MAX_LINE, max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS, shutdown_timeout=config.drain_grace_s)
        self._started = False

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        site = _LimitedSite(self._runner, self._socket, server, self._config.connection_limit, ssl_context=self._ssl)
        await site.start()
        self._started = True

    async def stop(self, grace: float) -> None:
        """Stop listening; accepted calls have `grace` seconds to finish (the drain's)."""
        if not self._started:
            self._socket.close()
            return
        self._started = False
        self._runner._shutdown_timeout = max(grace, 0.0)  # this drain's grace, not the build-time default
        await self._runner.cleanup()

    # -- plumbing ----------------------------------------------------------------------------------

    def _dialect(self, path: str) -> Dialect:
        for prefix, dialect in self._prefixes:
            if path.startswith(prefix):
                return dialect
        return self._prefixes[-1][1]

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        verb = "GET" if request.method == "HEAD" else request.method
        if self._checker is not None and (verb, request.path) not in self._health:
            reason = self._checker.refusal(request.headers.items())
            if reason is not None:
                self._calls.metrics.auth_failures.labels(reason).inc()
                return self._dialect(request.path).error(UNAUTHENTICATED)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # the router's 404 and 405
            dialect = self._dialect(request.path)
            if exc.status == 413:
                return dialect.error(TooLarge("body", f"over max_message_bytes {self._config.max_message_bytes}"))
            if exc.status < 400:
                raise
            return dialect.error(NotAcceptable(exc.status, f"{request.method} {_path(request)}: {exc.reason}"))

    def _add(self, route: Route, dialect: Dialect) -> None:
        """`route` with its deadline started, its failures answered in `dialect`, and its outcome counted."""
        method = f"{route.verb} {route.path}"
        work, counted, calls, metrics = route.handle, not route.health, self._calls, self._calls.metrics
        default_timeout_s = self._config.default_timeout_s
        tracing = calls.tracing if counted else None  # health routes, like probes, are not traced
        attributes = {"http.request.method": route.verb, "http.route": route.path, "attention.door": dialect.name,
                      "attention.transport": "http", "attention.method": method}

        async def handle(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            trace = tracing.call(method, request.headers, attributes) if tracing is not None else None
            token = CALL_TRACE.set(trace) if trace is not None else None
            code, status = "CANCELLED", 499  # the caller went away (aiohttp cancelled this handler)
            try:
                try:
                    deadline.start(request.headers.getall(deadline.HEADER, []), default_timeout_s)
                    response = await work(request)
                    code, status = "OK", response.status
                    return response
                except asyncio.CancelledError as exc:
                    if being_cancelled():
                        raise
                    error = calls.failure(exc, method)
                except Exception as exc:  # every failure answered in the dialect, never a traceback
                    error = calls.failure(exc, method)
                code = status_of(error)
                answer = dialect.error(error)
                status = answer.status
                return answer
            finally:
                if counted:
                    metrics.observe_request(method, code, time.perf_counter() - started, CALL_MODEL.get())
                if trace is not None and token is not None:
                    CALL_TRACE.reset(token)
                    trace.end(code, CALL_MODEL.get(), {"http.response.status_code": status})

        self.app.router.add_route(route.verb, route.path, handle)


class _Refused(asyncio.Protocol):
    """A connection over the port's limit: closed as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _LimitedSite(web.SockSite):
    """aiohttp's socket site, keeping at most `limit` connections open at once (`max_connections`): one more
    is closed as it is accepted, so a reconnect flood cannot take every descriptor of the process (the gRPC
    port's bound is grpc core's own, service/doors/grpc_server.py)."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, server: web.Server, limit: int, *,
                 ssl_context: ssl.SSLContext | None) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context, backlog=1024)
        self._web = server
        self._limit = limit
        self.refused = 0

    def _protocol(self) -> asyncio.BaseProtocol:
        if len(self._web.connections) >= self._limit:
            self.refused += 1
            return _Refused()
        return self._web()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registered with the runner, which stops it
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, sock=self._sock, ssl=self._ssl_context,
                                                backlog=self._backlog)


class HttpFront:
    """The drain's view of the HTTP door (service/process.py `Front`). Unlike the gRPC server (whose GOAWAY
    moves streaming callers elsewhere at once; HTTP calls are short), it keeps accepting through the grace,
    its handlers refusing new calls UNAVAILABLE "shutting down" (`Serving.draining`, which the gRPC front's
    `refuse` sets for both), and closes once the model has answered what it admitted; readiness routes
    answer 503 from the drain's start (attention_ready 0)."""

    def __init__(self, door: HttpDoor, serving: Serving) -> None:
        self._door = door
        self._serving = serving
        self._deadline = 0.0

    def announce(self, grace: float) -> None:
        pass

    def refuse(self) -> None:
        self._serving.draining = True

    def close(self, grace: float) -> None:
        self._deadline = time.monotonic() + grace

    async def closed(self, margin: float) -> None:
        await self._door.stop(max(margin, self._deadline - time.monotonic()))


def _path(request: web.Request) -> str:
    path = request.path
    return path if len(path) <= 64 and path.isprintable() else "(path not shown)"
