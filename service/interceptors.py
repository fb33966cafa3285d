"""Server interceptors: the conventional `grpc_server_*` metrics for every RPC (health included)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.metrics import Metrics


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if code is None:
        return "OK"
    name: str = code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name
    return name


def _cancel_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0.001 else "CANCELLED"


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

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

        def finish(code: str, started: float) -> None:
            m.grpc_handled.labels(*labels, code).inc()
            m.grpc_handling.labels(*labels).observe(time.perf_counter() - started)

        if not handler.response_streaming:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                m.grpc_started.labels(*labels).inc()
                started = time.perf_counter()
                code = "UNKNOWN"
                try:
                    response = await behavior(request, context)
                    code = _code_name(context)
                    return response
                except grpc.aio.AbortError:
                    code = _code_name(context)
                    raise
                except asyncio.CancelledError:
                    code = _cancel_code(context)
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
                m.grpc_started.labels(*labels).inc()
                started = time.perf_counter()
                code = "UNKNOWN"
                try:
                    await stream_behavior(request, context)
                    code = _code_name(context)
                except grpc.aio.AbortError:
                    code = _code_name(context)
                    raise
                except asyncio.CancelledError:
                    code = _cancel_code(context)
                    raise
                finally:
                    finish(code, started)

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
                code = _cancel_code(context)
                raise
            finally:
                finish(code, started)

        return factory(stream, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
