"""The metrics interceptor: the one place an RPC's final status code is counted.

Every RPC (health included) in the conventional `grpc_server_*` families; unary calls of the front
doors (`services`) also in `attention_requests_total` and its duration, in the same step, so the two
always agree. A stream's requests are counted one by one by its servicer (service/servicer.py).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from service.edge import cancel_code
from service.metrics import Metrics


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if code is None:
        return "OK"
    name: str = code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name
    return name


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    def __init__(self, metrics: Metrics, services: Sequence[str]) -> None:
        self._metrics = metrics
        self._services = frozenset(services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        service, _, method = details.method.lstrip("/").rpartition("/")
        kind = {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
                (True, True): "bidi_stream"}[(handler.request_streaming, handler.response_streaming)]
        labels = (kind, service, method)
        m = self._metrics

        per_call = not handler.response_streaming and not handler.request_streaming and service in self._services

        def finish(code: str, started: float) -> None:
            seconds = time.perf_counter() - started
            m.grpc_handled.labels(*labels, code).inc()
            m.grpc_handling.labels(*labels).observe(seconds)
            if per_call:
                m.observe_request(method, code, seconds)

        async def observed(call: Awaitable[Any], context: grpc.aio.ServicerContext) -> Any:
            """Await a handler that is a coroutine (unary, or streaming by `context.write()`), counted."""
            m.grpc_started.labels(*labels).inc()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                result = await call
                code = _code_name(context)
                return result
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except asyncio.CancelledError:
                code = cancel_code(context)
                raise
            finally:
                finish(code, started)

        if not handler.response_streaming:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await observed(behavior(request, context), context)

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
            m.grpc_started.labels(*labels).inc()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                async for response in stream_behavior(request, context):
                    yield response
                code = _code_name(context)
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                # GeneratorExit: grpcio closes a streaming handler this way when the caller cancels.
                code = cancel_code(context)
                raise
            finally:
                finish(code, started)

        return factory(stream, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
