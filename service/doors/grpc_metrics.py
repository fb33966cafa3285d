"""The metrics interceptor: the one place an RPC's final status code is counted.

Every RPC (health included) in the conventional `grpc_server_*` families; unary calls of the front
doors (`services`) also in `attention_requests_total` and its duration, in the same step, so the two
always agree, `method` being the RPC's name (or a door's own label for it, `labels`: tei.v1's RPCs, some of
whose names attention.v1's have too, are "tei.v1.Rerank/Rerank"). A stream's requests are counted one by one
by its servicer (service/doors/attention_v1.py, service/doors/tei_v1.py).

The wrapped handler of a method, and its metric children, are built once and reused: grpcio asks
the interceptor for every call, and building them (`labels()` looks up a child under a lock) cost
about a tenth of a trivial call's event-loop time (bench/RESULTS.md, issue 22).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from service.doors.calls import CALL_MODEL
from service.doors.message_wait import request_streaming
from service.doors.rpc import cancel_code, sent_code
from service.metrics import Metrics


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    def __init__(self, metrics: Metrics, services: Sequence[str], labels: Mapping[str, str] | None = None) -> None:
        self._metrics = metrics
        self._services = frozenset(services)
        self._labels = dict(labels or {})  # service -> its methods' label, "{method}" in it
        # method -> (the handler grpcio found, ours around it). Only methods that have a handler get
        # here, so it holds at most one entry per registered method.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, method = path.lstrip("/").rpartition("/")
        streaming_in = request_streaming(handler)  # a unary method stays unary behind message_wait.py
        kind = {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
                (True, True): "bidi_stream"}[(streaming_in, handler.response_streaming)]
        labels = (kind, service, method)
        m = self._metrics
        started_total = m.grpc_started.labels(*labels)
        handling = m.grpc_handling.labels(*labels)
        handled: dict[str, Any] = {}  # code -> its grpc_server_handled_total child

        per_call = not handler.response_streaming and not streaming_in and service in self._services
        label = self._labels.get(service, "{method}").format(method=method)

        def finish(code: str, started: float) -> None:
            seconds = time.perf_counter() - started
            child = handled.get(code)
            if child is None:
                child = handled[code] = m.grpc_handled.labels(*labels, code)
            child.inc()
            handling.observe(seconds)
            if per_call:
                m.observe_request(label, code, seconds, CALL_MODEL.get())

        async def observed(call: Awaitable[Any], context: grpc.aio.ServicerContext) -> Any:
            """Await a handler that is a coroutine (unary, or streaming by `context.write()`), counted."""
            started_total.inc()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                result = await call
                code = sent_code(context)
                return result
            except grpc.aio.AbortError:
                code = sent_code(context)
                raise
            except asyncio.CancelledError:
                code = cancel_code(context)
                raise
            finally:
                finish(code, started)

        if not handler.response_streaming:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                # `observed`, inlined: one coroutine less to create and resume on every call.
                started_total.inc()
                started = time.perf_counter()
                code = "UNKNOWN"
                try:
                    result = await behavior(request, context)
                    code = sent_code(context)
                    return result
                except grpc.aio.AbortError:
                    code = sent_code(context)
                    raise
                except asyncio.CancelledError:
                    code = cancel_code(context)
                    raise
                finally:
                    finish(code, started)

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
            return factory(unary, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)

        stream_behavior = handler.unary_stream or handler.stream_stream
        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)

        if not inspect.isasyncgenfunction(stream_behavior):
            # A streaming handler may also be a coroutine that writes with `context.write()` (the
            # standard health servicer's Watch): wrapped as a generator, it would fail with UNKNOWN.
            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                await observed(stream_behavior(request, context), context)

            return factory(writer, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started_total.inc()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                async for response in stream_behavior(request, context):
                    yield response
                code = sent_code(context)
            except grpc.aio.AbortError:
                code = sent_code(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                # GeneratorExit: grpcio closes a streaming handler this way when the caller cancels.
                code = cancel_code(context)
                raise
            finally:
                finish(code, started)

        return factory(stream, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
