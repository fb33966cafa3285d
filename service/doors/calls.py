"""The edge every front door shares: readiness, a call's time budget, admission into the batcher, and
a call's outcome (error type -> status, cancellation, deadline).

One path for all of them: `Calls.compute` admits a call's jobs and waits for their results;
`Calls.answer` runs a unary handler's work and turns whatever it raised into the caller's status;
`Calls.failure` is what a failed request (unary, or one message of a stream) counts and reports;
`Calls.stream` is a bidirectional stream's loop and `Calls.answer_in_stream` one request's outcome in it.
Every exception is mapped: `ServiceError`s by `errors.status_of`, anything else to INTERNAL with a
reference id (the traceback is logged, never sent). Our own `CancelledError`s never escape a
handler (a caller would hang until its deadline, grpc/grpc#29248). The final status code of an RPC is
counted in one place, service/doors/grpc_metrics.py, which reads it from the call's context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.batching import Done, Item, Request
from service.batching.types import DEADLINE_SLACK_S
from service.config import ServiceConfig
from service.errors import (
    DeadlineExceeded,
    DeadlineUnmeetable,
    InvalidInput,
    ModelFailure,
    NotReady,
    Overloaded,
    ServiceError,
    ShuttingDown,
    reason_of,
    status_of,
)
from service.jobs import Job, ModelSpec
from service.metrics import Metrics

log = logging.getLogger(__name__)

MAX_MESSAGE = 256  # a status message echoes parts of the request (a shape, ...): keep it bounded


class Admission(Protocol):
    """What `Calls.compute` admits into: the batcher (service/batching/), or, in an edge process, the
    model process's batcher over its socket (service/multiproc/remote.py)."""

    def submit(self, requests: Sequence[Request[Job]], deadline: float) -> list[Item[Job]]: ...
    def cancel(self, items: Sequence[Item[Job]]) -> None: ...


@dataclass
class Serving:
    """Readiness, shared by the server (which sets it) and the front doors (which admit by it)."""

    spec: ModelSpec | None = None  # set once the model is warm, with the batcher that runs it
    batcher: Admission | None = field(default=None, repr=False)
    stopping: bool = False  # a shutdown has begun: not ready, though calls are served until `draining`
    draining: bool = False  # from the end of the drain delay: new calls are refused

    @property
    def ready(self) -> bool:
        """Readiness, as grpc.health.v1 reports it (and KServe's ServerReady/ModelReady, and the
        attention_ready gauge): the model is warm and no shutdown has begun."""
        return self.spec is not None and self.batcher is not None and not (self.stopping or self.draining)

    def require_ready(self) -> tuple[ModelSpec, Admission]:
        if self.draining:
            raise ShuttingDown("server shutting down; retry on another replica")
        if self.spec is None or self.batcher is None:
            raise NotReady("model loading or warming up; retry shortly")
        return self.spec, self.batcher


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller's deadline has passed (the one deadline predicate of the service), within
    DEADLINE_SLACK_S: a cancellation that close to it is the caller's own deadline timer."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def cancel_code(context: grpc.aio.ServicerContext) -> str:
    """The code of a call that grpcio ended under us: the status our handler had already sent (a stopping
    server cancels every handler still running, one that has just answered "shutting down" too), else
    its deadline passed, or its caller left."""
    sent = context.code()
    if sent is not None and sent != grpc.StatusCode.OK:
        name: str = (sent if isinstance(sent, grpc.StatusCode) else grpc.StatusCode(sent)).name
        return name
    return "DEADLINE_EXCEEDED" if deadline_passed(context) else "CANCELLED"


def remaining(context: grpc.aio.ServicerContext, config: ServiceConfig) -> float:
    """Seconds this call may take: the caller's deadline, or `default_timeout_s` when it set none
    (`time_remaining()` is None then: never taken as 0). A caller's longer deadline is honoured."""
    left = context.time_remaining()
    return config.default_timeout_s if left is None else left


def being_cancelled() -> bool:
    """True when this task itself is being cancelled (by grpcio: caller gone or deadline passed),
    False when a CancelledError came from a future our own code cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Calls:
    def __init__(self, config: ServiceConfig, serving: Serving, metrics: Metrics) -> None:
        self.config = config
        self.serving = serving
        self._metrics = metrics

    async def compute(self, jobs: Sequence[Job], seconds: float) -> list[Done]:
        """Admit one call's jobs (all or none) and wait up to `seconds` for their results, in order."""
        _, batcher = self.serving.require_ready()
        floor_ms = self.config.min_deadline_ms
        if seconds * 1e3 < floor_ms:  # refuse at the door what could not finish in time
            raise DeadlineUnmeetable(f"deadline too short: {max(seconds, 0) * 1e3:.1f} ms left; "
                                     f"this service needs at least {floor_ms:g} ms")
        items = batcher.submit([Request(job, job.length, job.key) for job in jobs], time.monotonic() + seconds)
        try:
            async with asyncio.timeout(seconds):
                # One sequence (the common call) awaits its future directly: gather() would add a
                # callback and a loop iteration between the model thread's answer and this task.
                done = [await items[0].future] if len(items) == 1 else await asyncio.gather(
                    *(item.future for item in items))
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded") from None
        finally:
            # All of them: a cancelled gather() has already cancelled its futures, but their items
            # may still be queued. Items that ran or are running are left alone.
            batcher.cancel(items)
        self._metrics.on_sequences(len(done))
        return done

    async def answer(self, method: str, context: grpc.aio.ServicerContext,
                     work: Callable[[], Awaitable[bytes]]) -> bytes:
        """Run a unary call's `work`; any failure becomes the caller's status (never UNKNOWN)."""
        try:
            return await work()
        except asyncio.CancelledError as exc:
            if being_cancelled():
                raise  # the caller cancelled or its deadline passed (grpcio cancels the handler task)
            error = self.failure(exc, method)  # our own code cancelled something this call awaited
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            error = self.failure(exc, method)
        try:
            await context.abort_with_status(grpc_status(error))
        except grpc.aio.AbortError:
            raise
        except Exception:
            # The call ended (its deadline passed, or the caller left) just as we answered it, so
            # grpcio cannot send our status; the caller has its own. Not an UNKNOWN: a cancellation.
            raise asyncio.CancelledError from None
        raise AssertionError("abort returned. This is a bug.")

    async def stream(self, requests: AsyncIterator[bytes],
                     one: Callable[[bytes], Awaitable[bytes]]) -> AsyncGenerator[bytes, None]:
        """A bidirectional stream: each request answered by `one` (which answers its own failures, see
        `answer_in_stream`), in completion order.

        At most `max_stream_inflight` requests of a stream are computed or waiting to be sent at once:
        a request holds its slot until its answer is taken for sending, and the answers waiting are
        bounded too, so a caller that sends and never reads stops being read (HTTP/2 flow control
        then holds its sends) instead of growing the server's memory."""
        limit = self.config.max_stream_inflight
        out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=limit)
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

    async def answer_in_stream(self, method: str, work: Callable[[], Awaitable[bytes]],
                               failed: Callable[[ServiceError], bytes]) -> bytes:
        """One request of a stream: `work()`, or `failed(error)` with the error a caller sees; counted
        in attention_requests_total. The stream goes on either way (unless the call is being cancelled)."""
        started = time.perf_counter()
        try:
            response, code = await work(), "OK"
        except Exception as exc:  # every request of the stream gets an answer, whatever failed
            error = self.failure(exc, method)
            response, code = failed(error), status_of(error)
        except asyncio.CancelledError as exc:
            if being_cancelled():
                raise
            error = self.failure(exc, method)
            response, code = failed(error), status_of(error)
        self._metrics.observe_request(method, code, time.perf_counter() - started)
        return response

    def failure(self, exc: BaseException, method: str) -> ServiceError:
        """The error a caller sees for `exc`, counted once in attention_failures_total. `exc` loses its
        traceback: the caller keeps the error past its except block, and the traceback's frames (holding
        the request, up to a message's worth of bytes) would otherwise live on in a reference cycle
        until the garbage collector next runs."""
        try:
            return self._failure(exc, method)
        finally:
            exc.__traceback__ = None

    def _failure(self, exc: BaseException, method: str) -> ServiceError:
        if isinstance(exc, ServiceError):
            self._metrics.failures.labels(reason_of(exc)).inc()
            return exc
        if isinstance(exc, asyncio.CancelledError) and self.serving.draining:
            error: ServiceError = ShuttingDown("request aborted: server shutting down; retry on another replica")
            self._metrics.failures.labels(reason_of(error)).inc()
            return error
        if isinstance(exc, asyncio.CancelledError):
            error = ModelFailure("request aborted")
            log.error("%s: a future this call awaited was cancelled (ref=%s). This is a bug.", method, error.ref)
        else:
            error = ModelFailure("internal error")
            log.error("%s failed (ref=%s)", method, error.ref, exc_info=exc)
        self._metrics.failures.labels("internal").inc()
        return error


def parse(message_type: Any, raw: bytes) -> Any:
    """A request message from its bytes; malformed bytes are INVALID_ARGUMENT (grpcio would say UNKNOWN)."""
    try:
        return message_type.FromString(raw)
    except (DecodeError, RuntimeError, ValueError):
        raise InvalidInput("request", f"not a valid {message_type.DESCRIPTOR.full_name} message") from None


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
