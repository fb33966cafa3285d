"""What every gRPC door shares: a request message from its bytes, a call's time budget, a unary call's
answer, a bidirectional stream's loop and one request's outcome in it, and a `ServiceError` as a rich
grpc status.

`Rpc.answer` runs a unary handler's work and turns whatever it raised into the caller's status (never
UNKNOWN); `Rpc.stream` is a bidirectional stream's loop and `Rpc.answer_in_stream` one request's outcome in
it. Every exception is mapped by the shared call layer (service/doors/calls.py `Calls.failure`). Our own
`CancelledError`s never escape a handler (a caller would hang until its deadline, grpc/grpc#29248). The
final status code of an RPC is counted in one place, service/doors/grpc_metrics.py, which reads it from
the call's context. With tracing on (service/tracing.py), `answer` and `answer_in_stream` also start each
call's span, its parent the trace context the caller's metadata carries, and end it with the call's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.batching.types import DEADLINE_SLACK_S
from service.config import ServiceConfig
from service.doors.calls import CALL_MODEL, CALL_TRACE, Calls, being_cancelled
from service.errors import InvalidInput, Overloaded, ServiceError, status_of
from service.tracing import CallTrace

MAX_MESSAGE = 256  # a status message echoes parts of the request (a shape, ...): keep it bounded
T = TypeVar("T")


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller's deadline has passed (the one deadline predicate of the service), within
    DEADLINE_SLACK_S: a cancellation that close to it is the caller's own deadline timer."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def cancel_code(context: grpc.aio.ServicerContext) -> str:
    """The code of a call that grpcio ended under us: the status our handler had already sent (a stopping
    server cancels every handler still running, one that has just answered "shutting down" too), else
    its deadline passed, or its caller left."""
    sent = sent_code(context)
    if sent != "OK":
        return sent
    return "DEADLINE_EXCEEDED" if deadline_passed(context) else "CANCELLED"


def sent_code(context: grpc.aio.ServicerContext) -> str:
    """The code name of the status a handler has sent (aborted with), "OK" when none."""
    code = context.code()
    if code is None:
        return "OK"
    name: str = (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code)).name
    return name


def remaining(context: grpc.aio.ServicerContext, config: ServiceConfig) -> float:
    """Seconds this call may take: the caller's deadline, or `default_timeout_s` when it set none
    (`time_remaining()` is None then: never taken as 0). A caller's longer deadline is honoured."""
    left = context.time_remaining()
    return config.default_timeout_s if left is None else left


class Rpc:
    """The gRPC side of the shared call layer: how a door's handler answers (module docstring). `service` is the
    door's full gRPC service name and `door` its short name (the spans' `attention.door`)."""

    def __init__(self, calls: Calls, service: str, door: str) -> None:
        self.calls = calls
        self.config = calls.config
        self.service = service
        self.door = door
        self._attributes: dict[str, dict[str, str]] = {}  # method -> its spans' attributes (tracing on)

    def _trace(self, method: str, context: grpc.aio.ServicerContext) -> CallTrace | None:
        """The call's span, started (tracing on; None when off or not sampled)."""
        tracing = self.calls.tracing
        if tracing is None:
            return None
        attributes = self._attributes.get(method)
        if attributes is None:
            attributes = self._attributes[method] = {
                "rpc.system": "grpc", "rpc.service": self.service, "rpc.method": method, "attention.door": self.door,
                "attention.transport": "grpc", "attention.method": method}
        return tracing.call(f"{self.service}/{method}", context.invocation_metadata() or (), attributes)

    async def answer(self, method: str, context: grpc.aio.ServicerContext,
                     work: Callable[[], Awaitable[bytes]]) -> bytes:
        """Run a unary call's `work`; any failure becomes the caller's status (never UNKNOWN). Traced, when
        tracing is on (the module docstring)."""
        trace = self._trace(method, context) if self.calls.tracing is not None else None
        if trace is None:
            return await self._answer(method, context, work)
        token = CALL_TRACE.set(trace)
        code = "UNKNOWN"
        try:
            response = await self._answer(method, context, work)
            code = "OK"
            return response
        except grpc.aio.AbortError:
            code = sent_code(context)
            raise
        except asyncio.CancelledError:
            code = cancel_code(context)
            raise
        finally:
            CALL_TRACE.reset(token)
            trace.end(code, CALL_MODEL.get(), {"rpc.grpc.status_code": grpc.StatusCode[code].value[0]})

    async def _answer(self, method: str, context: grpc.aio.ServicerContext,
                      work: Callable[[], Awaitable[bytes]]) -> bytes:
        try:
            return await work()
        except asyncio.CancelledError as exc:
            if being_cancelled():
                raise  # the caller cancelled or its deadline passed (grpcio cancels the handler task)
            error = self.calls.failure(exc, method)  # our own code cancelled something this call awaited
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            error = self.calls.failure(exc, method)
        try:
            await context.abort_with_status(grpc_status(error))
        except grpc.aio.AbortError:
            raise
        except Exception:
            # The call ended (its deadline passed, or the caller left) just as we answered it, so
            # grpcio cannot send our status; the caller has its own. Not an UNKNOWN: a cancellation.
            raise asyncio.CancelledError from None
        raise AssertionError("abort returned. This is a bug.")

    async def stream(self, requests: AsyncIterator[bytes], one: Callable[[bytes], Awaitable[T]], *,
                     ordered: bool = False) -> AsyncGenerator[T, None]:
        """A bidirectional stream: each request answered by `one` (which answers its own failures, see
        `answer_in_stream`), in completion order, or with `ordered` in the order of the requests (tei.v1's
        messages carry no id, and TEI keeps the order). An answer is the response's bytes (or what the door
        makes of a failure: attention.v1 an EncodeResponse with `error` set, tei.v1 the error that ends the
        stream).

        At most `max_stream_inflight` requests of a stream are computed or waiting to be sent at once
        (`ordered`: or waiting for an earlier one, give or take the two being handed over): a request holds
        its slot until its answer is taken for sending, and the answers waiting are bounded too, so a caller
        that sends and never reads stops being read (HTTP/2 flow control then holds its sends) instead of
        growing the server's memory."""
        limit = self.config.max_stream_inflight
        if ordered:
            async with contextlib.aclosing(_in_order(requests, one, limit)) as answers:
                async for answer in answers:
                    yield answer
            return
        out: asyncio.Queue[T | None] = asyncio.Queue(maxsize=limit)
        slots = asyncio.Semaphore(limit)
        tasks: set[asyncio.Task[None]] = set()

        async def run(raw: bytes) -> None:
            try:
                await out.put(await one(raw))
            finally:
                slots.release()

        async def read() -> None:
            try:
                async for raw in requests:
                    await slots.acquire()
                    task = asyncio.create_task(run(raw))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.wait(set(tasks))
            finally:
                await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader  # surfaces a broken request stream
        finally:
            for task in (reader, *tasks):
                task.cancel()

    async def answer_in_stream(self, method: str, work: Callable[[], Awaitable[T]],
                               failed: Callable[[ServiceError], T], context: grpc.aio.ServicerContext) -> T:
        """One request of a stream: `work()`, or `failed(error)` with the error a caller sees; counted
        in attention_requests_total, and traced as a call of its own (its parent the trace context of the
        stream's metadata) when tracing is on. The stream goes on either way (unless the call is being
        cancelled)."""
        started = time.perf_counter()
        trace = self._trace(method, context) if self.calls.tracing is not None else None
        token = CALL_TRACE.set(trace) if trace is not None else None
        code = "CANCELLED"
        try:
            response, code = await self._outcome(method, work, failed)
        except asyncio.CancelledError:
            code = cancel_code(context)
            raise
        finally:
            if trace is not None and token is not None:
                CALL_TRACE.reset(token)
                trace.end(code, CALL_MODEL.get(), {"rpc.grpc.status_code": grpc.StatusCode[code].value[0]})
        self.calls.metrics.observe_request(method, code, time.perf_counter() - started, CALL_MODEL.get())
        return response

    async def _outcome(self, method: str, work: Callable[[], Awaitable[T]],
                       failed: Callable[[ServiceError], T]) -> tuple[T, str]:
        try:
            return await work(), "OK"
        except Exception as exc:  # every request of the stream gets an answer, whatever failed
            error = self.calls.failure(exc, method)
            return failed(error), status_of(error)
        except asyncio.CancelledError as exc:
            if being_cancelled():
                raise
            error = self.calls.failure(exc, method)
            return failed(error), status_of(error)


async def _in_order(requests: AsyncIterator[bytes], one: Callable[[bytes], Awaitable[T]],
                    limit: int) -> AsyncGenerator[T, None]:
    """`Rpc.stream`'s ordered loop: each request's task queued in order (at most `limit` waiting), each
    answer yielded once it and every earlier one are done."""
    pending: asyncio.Queue[asyncio.Future[T] | None] = asyncio.Queue(maxsize=limit)
    tasks: set[asyncio.Future[T]] = set()

    async def read() -> None:
        try:
            async for raw in requests:
                task = asyncio.ensure_future(one(raw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await pending.put(task)
        finally:
            await pending.put(None)

    reader = asyncio.create_task(read())
    try:
        while (task := await pending.get()) is not None:
            yield await task
        await reader  # surfaces a broken request stream
    finally:
        reader.cancel()
        for waiting in list(tasks):
            waiting.cancel()


INLINE_BYTES = 64 << 10  # a bigger request message has its fields counted, then is parsed in a worker thread
# A bigger answer is serialized in a worker thread. Serializing our own message copies at memory speed and holds
# the GIL (upb): up to this size it costs less inline (2 MiB: 70-90 us) than the hand-off to a thread and back
# (60-80 us of latency at 128 KiB, 160 at 2 MiB; bench/RESULTS.md, issue 42). Bigger ones approach the GIL's
# switch interval (8 MiB: 0.4-0.7 ms), at which the thread lets the loop take its turns.
SERIALIZE_INLINE_BYTES = 2 << 20


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(raw):
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return value, at


def top_level_fields(raw: bytes, stop: int) -> int:
    """A protobuf message's top-level fields, counted from its wire format without parsing it (a repeated
    field counts each entry); stops counting past `stop`. Validity is the parser's to judge."""
    at = count = 0
    while at < len(raw) and count <= stop:
        tag, at = _varint(raw, at)
        wire = tag & 7
        if wire == 0:
            _, at = _varint(raw, at)
        elif wire == 2:
            length, at = _varint(raw, at)
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            break  # a group or no field at all: the parser refuses it
        count += 1
    return count


def _parse(message_type: Any, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except (DecodeError, RuntimeError, ValueError):
        raise InvalidInput("request", f"not a valid {message_type.DESCRIPTOR.full_name} message") from None


async def parse(message_type: Any, raw: bytes, config: ServiceConfig) -> Any:
    """A request message from its bytes; malformed bytes are INVALID_ARGUMENT (grpcio would say UNKNOWN). A
    message over INLINE_BYTES has its top-level fields counted first (a request's repeated entries are its
    sequences, inputs or parameters: a message of millions of them is refused before the parser builds
    them) and is parsed in a worker thread."""
    if len(raw) <= INLINE_BYTES:
        return _parse(message_type, raw)
    limit = config.max_sequences_per_call + 256
    if top_level_fields(raw, limit) > limit:
        raise InvalidInput("request", f"holds more than {limit} top-level fields; a call takes at most "
                                      f"{config.max_sequences_per_call} sequences")
    return await asyncio.to_thread(_parse, message_type, raw)


async def serialize(message: Any) -> bytes:
    """A response message's bytes, serialized in a worker thread when it is over SERIALIZE_INLINE_BYTES."""
    if message.ByteSize() > SERIALIZE_INLINE_BYTES:
        data: bytes = await asyncio.to_thread(message.SerializeToString)
    else:
        data = message.SerializeToString()
    return data


def public(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 4] + " ..."


def grpc_status(exc: ServiceError) -> grpc.Status:
    """The rich status for `exc`: its code and public message, with a BadRequest or RetryInfo detail."""
    code = getattr(code_pb2, status_of(exc))
    details = []
    if isinstance(exc, InvalidInput):
        details.append(error_details_pb2.BadRequest(field_violations=[error_details_pb2.BadRequest.FieldViolation(
            field=public(exc.field), description=public(exc.description))]))
    elif isinstance(exc, Overloaded):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
        details.append(retry)
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return rpc_status.to_status(status_pb2.Status(code=code, message=public(exc.message), details=packed))
