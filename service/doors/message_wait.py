"""The wait for a unary call's request message, bounded (issue 27, item 11).

grpcio reads a unary call's message before the handler runs, so a call whose message never completes
and that carries no deadline would be ended only by the connection's age limit (about 31 minutes at
the defaults). This interceptor serves each unary method as a client-streaming one that reads the one
message itself, within the caller's deadline or, when the caller set none, `default_timeout_s`; past
it the call ends DEADLINE_EXCEEDED (a caller with a deadline is ended by grpc core at that deadline).
A caller that closes its side before its message is complete gets INVALID_ARGUMENT at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.errors import DeadlineExceeded, InvalidInput, ServiceError, status_of

_READS_ONE = "_reads_one_message"  # marks our behaviours: the method is unary to its callers


def request_streaming(handler: grpc.RpcMethodHandler) -> bool:
    """Whether the method takes a stream of requests, as its callers see it (not as served here)."""
    return bool(handler.request_streaming) and not getattr(handler.stream_unary, _READS_ONE, False)


class MessageWaitInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Innermost interceptor: the metrics interceptor outside it counts what it ends."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._late = DeadlineExceeded(f"the request message did not arrive within {seconds:g} s "
                                      "(default_timeout_s; set a deadline to wait longer)")
        # method -> (the handler grpcio found, ours around it); built once per method.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler  # streams read their own messages (and may rightly wait for the next one)
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler.unary_unary
        seconds, late = self._seconds, self._late
        # Decoded here, not by grpcio, so that a message that does not parse is INVALID_ARGUMENT
        # (grpcio answers UNKNOWN; the front doors take bytes and decode them themselves).
        decode = handler.request_deserializer

        async def read_then_answer(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            # `context.read()`, not the request iterator: the iterator is an async generator left suspended
            # after its one message, and the loop finalises each such generator by scheduling its aclose()
            # from the garbage collector's hook (a task and a wake-up of the loop per call).
            try:
                if context.time_remaining() is not None:  # grpc core ends the call at it, message or not
                    request = await context.read()
                else:  # no deadline: ours
                    async with asyncio.timeout(seconds):
                        request = await context.read()
            except TimeoutError:
                await _refuse(context, late)
            if request is grpc.aio.EOF:  # half-closed without a (complete) message: none can come now
                missing = InvalidInput("request", "the call ended without a complete request message")
                await _refuse(context, missing)
            if decode is not None:
                try:
                    request = decode(request)
                except Exception:  # noqa: BLE001  (any parse failure of the caller's bytes)
                    bad = InvalidInput("request", "not a valid message of this method")
                    await _refuse(context, bad)
            return await behavior(request, context)

        setattr(read_then_answer, _READS_ONE, True)
        return grpc.stream_unary_rpc_method_handler(read_then_answer,
                                                    response_serializer=handler.response_serializer)


async def _refuse(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """End the call with `error`'s status; when grpcio has already ended it (a message over the receive
    limit: the caller has RESOURCE_EXHAUSTED from grpcio; or the caller left), as a cancellation."""
    try:
        await context.abort(grpc.StatusCode[status_of(error)], error.message)
    except grpc.aio.AbortError:
        raise
    except Exception:  # noqa: BLE001  (grpcio's ExecuteBatchError: no status can be sent any more)
        raise asyncio.CancelledError from None
