"""attention.v1.AttentionService: proto <-> domain, admission, and error mapping. Nothing else.

Handlers take raw request bytes and parse them here, so that a malformed message is answered
INVALID_ARGUMENT instead of grpcio's UNKNOWN. Every exception is mapped: `ServiceError`s by
`errors.STATUS_OF`, anything else to INTERNAL with a reference id (the traceback is logged, never
sent). Our own `CancelledError`s never escape a handler (a caller would hang until its deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from client.tensors import fill_tensor
from proto.attention.v1 import attention_pb2 as pb
from service.batcher import Batcher, Done, Request
from service.config import ServiceConfig
from service.errors import (
    REASON_OF,
    STATUS_OF,
    DeadlineExceeded,
    DeadlineUnmeetable,
    InvalidInput,
    ModelFailure,
    NonFiniteInput,
    NotReady,
    Overloaded,
    ServiceError,
    ShuttingDown,
)
from service.jobs import Job, ModelSpec, Output
from service.metrics import Metrics
from service.validation import Plan, validate

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name


@dataclass
class ServingState:
    """Readiness, shared by the server (which sets it) and the servicer (which admits by it)."""

    spec: ModelSpec | None = None  # set once the model is warm
    draining: bool = False

    def require_ready(self) -> ModelSpec:
        if self.draining:
            raise ShuttingDown("server shutting down; retry on another replica")
        if self.spec is None:
            raise NotReady("model loading or warming up; retry shortly")
        return self.spec


class AttentionServicer:
    def __init__(self, config: ServiceConfig, batcher: Batcher[Job], state: ServingState, metrics: Metrics) -> None:
        self._config = config
        self._batcher = batcher
        self._state = state
        self._metrics = metrics

    # -- handlers (raw bytes in, raw bytes out) --------------------------------------------------

    async def encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = _parse(pb.EncodeRequest, raw)
            response = await self._encode(request, _remaining(context, self._config))
            data: bytes = response.SerializeToString()
            return data

        return await self._answer("Encode", context, work)

    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            _parse(pb.GetModelInfoRequest, raw)
            data: bytes = self._model_info().SerializeToString()
            return data

        return await self._answer("GetModelInfo", context, work)

    async def encode_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """One response per request, in completion order; a failed request answers with `error` set."""
        async def one(raw: bytes) -> bytes:
            request_id = ""

            async def work() -> bytes:
                nonlocal request_id
                request = _parse(pb.EncodeRequest, raw)
                request_id = request.request_id
                data: bytes = (await self._encode(request, _remaining(context, self._config))).SerializeToString()
                return data

            return await self.answer_in_stream(
                "EncodeStream", work, lambda error: _stream_error(request_id, error).SerializeToString())

        async with contextlib.aclosing(self.stream(requests, one)) as responses:
            async for response in responses:
                yield response

    # stream() and answer_in_stream() are the streaming path every front door shares (service/kserve.py).

    async def stream(self, requests: AsyncIterator[bytes],
                     one: Callable[[bytes], Awaitable[bytes]]) -> AsyncGenerator[bytes, None]:
        """A bidirectional stream: each request answered by `one` (which answers its own failures), in
        completion order, at most `max_stream_inflight` at a time."""
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self._config.max_stream_inflight)
        tasks: set[asyncio.Task[None]] = set()

        async def run(raw: bytes) -> None:
            try:
                response = await one(raw)
            finally:
                slots.release()
            await out.put(response)

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
        """One request of a stream: `work()`, or `failed(error)` with the error a caller sees; counted.
        The stream goes on either way (unless the call itself is being cancelled)."""
        started = time.perf_counter()
        try:
            response, code = await work(), "OK"
        except Exception as exc:  # every request of the stream gets an answer, whatever failed
            error = self._as_service_error(exc, method)
            response, code = failed(error), STATUS_OF[type(error)]
        except asyncio.CancelledError as exc:
            if _being_cancelled():
                raise
            error = self._as_service_error(exc, method)
            response, code = failed(error), STATUS_OF[type(error)]
        self._observe(method, code, started)
        return response

    # -- the call ---------------------------------------------------------------------------------

    async def _encode(self, request: pb.EncodeRequest, remaining: float) -> pb.EncodeResponse:
        spec = self.admit(remaining)
        try:
            plan = validate(request, spec, self._config)
        except NonFiniteInput:
            self._metrics.nonfinite_inputs.inc()
            raise
        done = await self.compute(plan.jobs, remaining)
        return _response(plan, done, spec)

    # admit() and compute() are the path every front door shares (service/kserve.py calls them too).

    def admit(self, remaining: float) -> ModelSpec:
        """The model, when this call may go ahead: ready, not draining, and time enough left."""
        spec = self._state.require_ready()
        floor_ms = self._config.min_deadline_ms
        if remaining * 1e3 < floor_ms:  # refuse at the door what could not finish in time
            raise DeadlineUnmeetable(f"deadline too short: {max(remaining, 0) * 1e3:.1f} ms left; "
                                   f"this service needs at least {floor_ms:g} ms")
        return spec

    async def compute(self, jobs: Sequence[Job], remaining: float) -> list[Done]:
        """Queue a call's validated jobs (all or none) and await their results, in order."""
        items = self._batcher.submit(
            [Request(job, job.length, job.key) for job in jobs], time.monotonic() + remaining
        )
        try:
            async with asyncio.timeout(remaining):
                # One sequence (the common call) awaits its future directly: gather() would add a
                # callback and a loop iteration between the model thread's answer and this task.
                done = [await items[0].future] if len(items) == 1 else await asyncio.gather(
                    *(item.future for item in items))
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded") from None
        finally:
            # All of them: a cancelled gather() has already cancelled its futures, but their items
            # may still be queued. Items that ran or are running are left alone.
            self._batcher.cancel(items)
        self._metrics.sequences.inc(len(done))
        return done

    def _model_info(self) -> pb.ModelInfo:
        spec = self._state.require_ready()
        c = self._config
        return pb.ModelInfo(
            name=spec.name, version=spec.version, checksum=spec.checksum, d_model=spec.d_model,
            n_heads=spec.n_heads, n_layers=spec.n_layers, vocab_size=spec.vocab_size, max_length=spec.max_length,
            positional=spec.positional, precision=spec.precision, device=spec.device,
            limits=pb.Limits(
                max_sequences_per_call=c.max_sequences_per_call, max_tokens_per_call=c.max_tokens_per_call,
                max_message_bytes=c.max_message_bytes, max_attention_bytes=c.max_attention_bytes,
            ),
        )

    # -- error mapping and accounting -------------------------------------------------------------

    async def _answer(self, method: str, context: grpc.aio.ServicerContext,
                      work: Callable[[], Awaitable[bytes]]) -> bytes:
        started = time.perf_counter()
        code = "OK"
        try:
            try:
                return await work()
            except asyncio.CancelledError as exc:
                if _being_cancelled():
                    # The caller cancelled or its deadline passed (grpcio cancels the handler task).
                    code = "DEADLINE_EXCEEDED" if _deadline_passed(context) else "CANCELLED"
                    raise
                # Our own code cancelled something this call awaited: answer, or the caller hangs until
                # its deadline (grpc/grpc#29248).
                error = self._as_service_error(exc, method)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                error = self._as_service_error(exc, method)
            code = STATUS_OF[type(error)]
            try:
                await context.abort_with_status(_status(error))
            except grpc.aio.AbortError:
                raise
            except Exception:
                # The call ended (its deadline passed, or the caller left) just as we answered it, so
                # grpcio cannot send our status; the caller has its own. Not an UNKNOWN: a cancellation.
                code = "DEADLINE_EXCEEDED" if _deadline_passed(context) else "CANCELLED"
                raise asyncio.CancelledError from None
            raise AssertionError("abort returned. This is a bug.")
        finally:
            self._observe(method, code, started)

    answer = _answer  # one call's outcome, for every front door (service/kserve.py)

    def _as_service_error(self, exc: BaseException, method: str) -> ServiceError:
        """The error a caller sees for `exc`, counted once in attention_failures_total."""
        if isinstance(exc, ServiceError):
            self._metrics.failures.labels(REASON_OF[type(exc)]).inc()
            return exc
        if isinstance(exc, asyncio.CancelledError):
            aborted = ShuttingDown("request aborted: server shutting down; retry on another replica")
            if self._state.draining:
                self._metrics.failures.labels(REASON_OF[ShuttingDown]).inc()
                return aborted
            error = ModelFailure("request aborted")
            log.error("%s: a future this call awaited was cancelled (ref=%s). This is a bug.", method, error.ref)
        else:
            error = ModelFailure("internal error")
            log.error("%s failed (ref=%s)", method, error.ref, exc_info=exc)
        self._metrics.failures.labels("internal").inc()
        return error

    def _observe(self, method: str, code: str, started: float) -> None:
        self._metrics.requests.labels(method, code).inc()
        self._metrics.request_duration.labels(method, code).observe(time.perf_counter() - started)

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        serialize: Callable[[bytes], bytes] = bytes
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Encode": grpc.unary_unary_rpc_method_handler(self.encode, response_serializer=serialize),
            "EncodeStream": grpc.stream_stream_rpc_method_handler(self.encode_stream, response_serializer=serialize),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self.get_model_info, response_serializer=serialize),
        })


def _stream_error(request_id: str, error: ServiceError) -> pb.EncodeResponse:
    """A failed EncodeStream request's answer: the same code and message a unary call would get."""
    return pb.EncodeResponse(request_id=request_id, error=pb.StreamError(
        code=STATUS_OF[type(error)], message=_public(error.message), field=_public(getattr(error, "field", ""))))


def _parse(message_type: Any, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except (DecodeError, RuntimeError, ValueError):
        raise InvalidInput("request", f"not a valid {message_type.DESCRIPTOR.full_name} message") from None


def _remaining(context: grpc.aio.ServicerContext, config: ServiceConfig) -> float:
    remaining = context.time_remaining()  # None when the caller set no deadline (never treat as 0)
    return config.default_timeout_s if remaining is None else min(remaining, config.default_timeout_s)


def _being_cancelled() -> bool:
    """True when this task itself is being cancelled (by grpcio: caller gone or deadline passed),
    False when a CancelledError came from a future our own code cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0.001


MAX_MESSAGE = 256  # a status message echoes parts of the request (a shape, ...): keep it bounded


def _public(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 4] + " ..."


def _status(exc: ServiceError) -> grpc.Status:
    code = getattr(code_pb2, STATUS_OF[type(exc)])
    details = []
    if isinstance(exc, InvalidInput):
        details.append(error_details_pb2.BadRequest(field_violations=[error_details_pb2.BadRequest.FieldViolation(
            field=_public(exc.field), description=_public(exc.description))]))
    elif isinstance(exc, Overloaded):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
        details.append(retry)
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return rpc_status.to_status(status_pb2.Status(code=code, message=_public(exc.message), details=packed))


def _response(plan: Plan, done: Sequence[Done], spec: ModelSpec) -> pb.EncodeResponse:
    widest = max(done, key=lambda d: d.batch_size)
    response = pb.EncodeResponse(request_id=plan.request_id, metadata=pb.ResponseMetadata(
        queue_us=int(max(d.queue_s for d in done) * 1e6), compute_us=int(max(d.compute_s for d in done) * 1e6),
        batch_size=widest.batch_size, padded_length=widest.padded_length, precision=spec.precision,
        fp32_retry=any(d.output.nonfinite for d in done), device=spec.device, model_name=spec.name,
        model_version=spec.version,
    ))
    for result in done:
        out: Output = result.output
        # Filled in place: building submessages and then the response from them copies every tensor twice.
        seq = response.outputs.add(nonfinite=out.nonfinite)
        if out.hidden is not None:
            fill_tensor(seq.hidden, out.hidden, plan.output_dtype)
        if out.pooled is not None:
            fill_tensor(seq.pooled, out.pooled, plan.output_dtype)
        if out.attention is not None:
            fill_tensor(seq.attention, out.attention, plan.attention_dtype)
    return response
