"""Tracing: OpenTelemetry spans of calls and of the batches' forwards, exported over OTLP (docs/tracing.md).

Off unless `otlp_endpoint` is configured: then `build_tracing` returns None, no span object is ever made and
no OpenTelemetry function is called per call (the doors, the call layer and the batcher each test for None
and go on). On:

- a call's span (`Tracing.call`), started by the gRPC doors' answers (service/doors/rpc.py) and the HTTP
  door's route wrapper as the handler starts, its parent the caller's W3C `traceparent`/`tracestate` (gRPC
  metadata or HTTP headers) when it sent one; ended with its outcome code (status ERROR on failure);
- its children, made from the times the shared call layer (service/doors/calls.py) notes: `decode` (the
  door's wire decode and the plan: validation, tokenization, limits), `queue` (admission until its last
  sequence's forward began, as the response metadata's queue time) and `encode` (the answer's wire encoding);
- one `forward` span per batch that serves a traced call, on its model thread (`Forwards`, the batcher's
  `BatchTracer`), linked to every traced call it served. An edge process sends its call's span context to the
  model process in the SUBMIT frame (`packed`/`unpacked`), so the model process's forwards link to the edges'
  calls.

Sampling is by trace id (`trace_sample_ratio`), a caller's sampled flag followed; a call not sampled gets
no children, and its sequences carry no trace, so a batch of such calls makes no forward span. Spans are
exported in batches by a background thread (`otlp_export_delay_ms`), and what is left is flushed at exit.
The provider is this process's own, never OpenTelemetry's global one, so servers built side by side in one
process (the tests) trace apart.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.config import ServiceConfig

if TYPE_CHECKING:
    from service.batching.types import Done

log = logging.getLogger(__name__)

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
EXPORT_TIMEOUT_S = 5.0  # one export's bound; the flush at exit waits at most about this long for a collector
SHUTDOWN_TIMEOUT_S = 6.0
DROP_LOG_S = 60.0  # the SDK's "queue full" warnings: one line a minute at most (`_DropsPerMinute`)
_PROPAGATOR = TraceContextTextMapPropagator()
_NONE = bytes(25)  # packed: no trace


class CallTrace:
    """One traced (sampled) call: its span, started as its handler started, and the times of its stages, which
    become its child spans. Used by the call's own task on the event loop only."""

    __slots__ = ("_tracer", "span", "context", "link", "_started", "_run", "_admitted", "_ran", "_error")

    def __init__(self, tracer: trace.Tracer, span: trace.Span, started: int) -> None:
        self._tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.link: SpanContext = span.get_span_context()  # what its sequences carry to the forwards (Request.trace)
        self._started = started
        self._run = self._admitted = self._ran = 0
        self._error = ""

    def _child(self, name: str, start: int, end: int, attributes: Mapping[str, Any] | None = None) -> None:
        self._tracer.start_span(name, self.context, attributes=attributes, start_time=start).end(end_time=end)

    def run(self) -> None:
        """The shared call layer has the door's request (`Calls.run` begins): the door's decoding ends here."""
        self._run = time.time_ns()

    def planned(self, sequences: int, tokens: int, task: str) -> None:
        """The call is planned (validated, tokenized): `decode` ends, the door's decoding and the plan in one span
        (one span less to make and export per call), the plan's share in `attention.plan_ms`."""
        now = time.time_ns()
        self._child("decode", self._started, now, {"attention.plan_ms": (now - (self._run or now)) / 1e6})
        self.span.set_attributes({"attention.sequences": sequences, "attention.tokens": tokens, "attention.task": task})

    def admitted(self) -> None:
        """Its sequences are handed to the batcher now."""
        self._admitted = time.time_ns()

    def computed(self, done: Sequence[Done]) -> None:
        """Every sequence is back: the `queue` span (until the last one's forward began, its queue time) and the
        call's batch figures, as its response's metadata gives them."""
        queue_s = max(d.queue_s for d in done)
        widest = max(done, key=lambda d: d.batch_size)
        self._child("queue", self._admitted, self._admitted + int(queue_s * 1e9))
        self._admitted = 0
        self.span.set_attributes({
            "attention.queue_ms": queue_s * 1e3, "attention.compute_ms": max(d.compute_s for d in done) * 1e3,
            "attention.batch_size": widest.batch_size, "attention.padded_length": widest.padded_length,
            "attention.fp32_retry": any(d.output.fp32_rerun for d in done)})

    def ran(self) -> None:
        """The call's outputs are ready (`Calls.run` returns): the door's encoding starts."""
        self._ran = time.time_ns()

    def failed(self, message: str) -> None:
        """What the caller is told of its failure (the span's status description)."""
        self._error = message

    def end(self, code: str, model: str, attributes: Mapping[str, Any]) -> None:
        """The call is answered with `code` (a gRPC code name; status ERROR unless OK), on `model` ("" none)."""
        now = time.time_ns()
        if self._admitted:  # admitted, never computed: it failed (or its caller left) queued or in its forward
            self._child("queue", self._admitted, now, {"attention.unfinished": True})
        if self._ran:
            self._child("encode", self._ran, now)
        span = self.span
        span.set_attributes({"attention.code": code, **attributes})
        if model:
            span.set_attribute("attention.model", model)
        if code != "OK":
            span.set_status(Status(StatusCode.ERROR, f"{code}: {self._error}" if self._error else code))
        span.end(end_time=now)


class Forwards:
    """The forwards of one model's lane, as spans (the batcher's `BatchTracer`, service/batching/types.py): each
    linked to the calls whose sequences it computed (once per call), on the model thread that runs it."""

    def __init__(self, tracer: trace.Tracer, model: str) -> None:
        self._tracer = tracer
        self._model = model

    def start(self, traces: list[object], size: int, padded_length: int, real_tokens: int, wide: bool) -> object:
        calls = {id(t): t for t in traces}  # a call's sequences carry one context between them
        return self._tracer.start_span("forward", links=[Link(c) for c in calls.values() if isinstance(c, SpanContext)],
                                       attributes={"attention.model": self._model, "attention.batch.size": size,
                                                   "attention.batch.padded_length": padded_length,
                                                   "attention.batch.tokens": real_tokens,
                                                   "attention.batch.calls": len(calls), "attention.batch.wide": wide})

    def end(self, handle: object, failed: int) -> None:
        span: trace.Span = handle  # type: ignore[assignment]  # what `start` returned
        if failed:
            span.set_attribute("attention.batch.failed", failed)
            span.set_status(Status(StatusCode.ERROR, f"{failed} of its sequences failed"))
        span.end()


class Tracing:
    """One process's tracing: its tracer provider, exporting to the configured collector. `call` starts a
    call's span; `forwards(model)` is a lane's tracer; `shutdown` flushes at exit."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self.tracer = provider.get_tracer("attention-service")

    def call(self, name: str, headers: Mapping[str, str] | Sequence[tuple[str, Any]],
             attributes: Mapping[str, Any]) -> CallTrace | None:
        """A call's span named `name`, as its handler starts, continuing the trace its `headers` (HTTP headers,
        or gRPC metadata pairs) carry; None when it is not sampled (nothing more is recorded of it)."""
        started = time.time_ns()
        span = self.tracer.start_span(name, _parent(headers), kind=SpanKind.SERVER, attributes=attributes,
                                      start_time=started)
        if not span.is_recording():
            return None
        return CallTrace(self.tracer, span, started)

    def forwards(self, model: str) -> Forwards:
        return Forwards(self.tracer, model)

    def flush(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Export every span ended so far, waiting at most `timeout_s`; False when they are not all out."""
        return self._provider.force_flush(int(timeout_s * 1e3))

    def shutdown(self) -> None:
        """Export what is left and stop, within about SHUTDOWN_TIMEOUT_S whatever the collector does (the export
        thread is a daemon: an exit does not wait for it beyond that)."""
        stopper = threading.Thread(target=self._provider.shutdown, name="otlp-shutdown", daemon=True)
        stopper.start()
        stopper.join(SHUTDOWN_TIMEOUT_S)
        if stopper.is_alive():
            log.warning("traces not all exported at exit: the collector did not answer within %.0f s",
                        SHUTDOWN_TIMEOUT_S)


def _parent(headers: Mapping[str, str] | Sequence[tuple[str, Any]]) -> Context | None:
    """The caller's trace context, from W3C trace-context headers; None without a (valid) traceparent."""
    if isinstance(headers, Mapping):
        if TRACEPARENT not in headers:
            return None
        carrier = {TRACEPARENT: headers[TRACEPARENT], TRACESTATE: headers.get(TRACESTATE, "")}
    else:  # gRPC metadata: (key, value) pairs, keys in lower case
        carrier = {key: value for key, value in headers if key in (TRACEPARENT, TRACESTATE)}
        if TRACEPARENT not in carrier:
            return None
    return _PROPAGATOR.extract(carrier)


class _DropsPerMinute(logging.Filter):
    """The SDK logs a warning for every span it drops with its queue full (a collector down or too slow for the
    load): at most one line a minute, with how many were dropped since, rather than a log line per span."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -DROP_LOG_S
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        self._dropped += 1
        now = time.monotonic()
        if now - self._last < DROP_LOG_S:
            return False
        record.msg, record.args = "trace export queue full (collector down or too slow): %d span(s) dropped", (
            self._dropped,)
        self._last, self._dropped = now, 0
        return True


def build_tracing(config: ServiceConfig, process: str) -> Tracing | None:
    """The process's tracing (`process`: "server", "model" or "edge N", a resource attribute), or None when
    no `otlp_endpoint` is configured. The exporter (and the gRPC or HTTP client it uses) is imported only then."""
    if not config.otlp_endpoint:
        return None
    sdk_log = logging.getLogger("opentelemetry.sdk._shared_internal")
    if not any(isinstance(f, _DropsPerMinute) for f in sdk_log.filters):
        sdk_log.addFilter(_DropsPerMinute())
    resource = Resource({"service.name": config.otlp_service_name, "process.pid": os.getpid(),
                         "attention.process": process})
    provider = TracerProvider(sampler=_Sampler(config.trace_sample_ratio), resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(config), schedule_delay_millis=config.otlp_export_delay_ms,
                                                   export_timeout_millis=EXPORT_TIMEOUT_S * 1e3))
    log.info("tracing: OTLP over %s to %s, sampling %g of calls", config.otlp_protocol, config.otlp_endpoint,
             config.trace_sample_ratio)
    return Tracing(provider)


def _exporter(config: ServiceConfig) -> Any:
    endpoint = config.otlp_endpoint
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"), timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    scheme, _, rest = endpoint.partition("://")
    host, _, path = rest.partition("/")
    return HttpExporter(endpoint=f"{scheme}://{host}/{path or 'v1/traces'}", timeout=EXPORT_TIMEOUT_S)


class _Sampler(Sampler):
    """Calls sampled by trace id (`trace_sample_ratio`), a caller's own decision followed (ParentBased); a span
    with links (a forward: made only for a batch that serves a sampled call) always."""

    def __init__(self, ratio: float) -> None:
        self._calls = ParentBased(TraceIdRatioBased(ratio))

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
                      attributes: Any = None, links: Sequence[Link] | None = None,
                      trace_state: Any = None) -> SamplingResult:
        if links:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._calls.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        calls: str = self._calls.get_description()  # type: ignore[no-untyped-call]
        return f"AttentionSampler{{calls: {calls}, forwards: always}}"


# -- a call's span context over an edge process's frames (service/multiproc/frames.py SUBMIT) ---------------

def packed(link: object) -> bytes:
    """A call's span context (`CallTrace.link`) as SUBMIT carries it: trace id (16 bytes), span id (8), flags (1),
    big-endian; zeros for none."""
    if not isinstance(link, SpanContext):
        return _NONE
    return link.trace_id.to_bytes(16, "big") + link.span_id.to_bytes(8, "big") + bytes([int(link.trace_flags)])


def unpacked(data: bytes) -> SpanContext | None:
    """`packed`'s span context back (a remote one), or None for zeros."""
    if len(data) != len(_NONE) or data == _NONE:
        return None
    return SpanContext(int.from_bytes(data[:16], "big"), int.from_bytes(data[16:24], "big"), is_remote=True,
                       trace_flags=TraceFlags(data[24]))
