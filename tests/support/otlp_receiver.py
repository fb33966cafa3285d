"""A real OTLP trace receiver on 127.0.0.1:0, the collector's protocol: `opentelemetry.proto`'s generated
`TraceService` over gRPC, and `POST /v1/traces` (protobuf bodies) over HTTP. It keeps every span it is sent,
flattened (`Span`), for the tracing tests; `python -m tests.support.otlp_receiver` runs one that only counts
them, for bench.ab's tracing-on side (it prints its gRPC port, then the count when stdin closes)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR
KIND_SERVER = trace_pb2.Span.SPAN_KIND_SERVER


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


@dataclass(frozen=True)
class Span:
    """One exported span: ids as hex (parent "" for a root), its attributes and its resource's, its status
    code and message, and its links as (trace id, span id)."""

    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    message: str
    links: tuple[tuple[str, str], ...] = field(default=())

    @property
    def process(self) -> str:
        return str(self.resource.get("attention.process", ""))


def flatten(request: otlp.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind, s.start_time_unix_nano,
                    s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes}, resource, s.status.code,
                    s.status.message, tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links)))
    return spans


class Receiver(otlp_grpc.TraceServiceServicer):  # type: ignore[misc]  # generated, untyped
    """Both transports; `endpoint` (gRPC) and `http_endpoint` name them. `keep=False` only counts."""

    def __init__(self, keep: bool = True) -> None:
        self._keep = keep
        self._lock = threading.Condition()
        self._spans: list[Span] = []
        self.count = 0
        self.requests = 0
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        otlp_grpc.add_TraceServiceServicer_to_server(self, self._grpc)
        self.port = self._grpc.add_insecure_port("127.0.0.1:0")
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(otlp.ExportTraceServiceRequest.FromString(body))
                answer = otlp.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> Receiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(None)
        self._http.shutdown()
        self._http.server_close()

    def Export(self, request: otlp.ExportTraceServiceRequest, context: grpc.ServicerContext  # noqa: N802 - OTLP's
               ) -> otlp.ExportTraceServiceResponse:
        self._add(request)
        return otlp.ExportTraceServiceResponse()

    def _add(self, request: otlp.ExportTraceServiceRequest) -> None:
        spans = flatten(request) if self._keep else []
        with self._lock:
            self.requests += 1
            self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            self._spans.extend(spans)
            self._lock.notify_all()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait(self, enough: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """The spans received, once `enough(spans)` holds (AssertionError with what came after `timeout`)."""
        end = time.monotonic() + timeout
        with self._lock:
            while not enough(self._spans):
                left = end - time.monotonic()
                if left <= 0:
                    names = sorted({(s.process, s.name) for s in self._spans})
                    raise AssertionError(f"{len(self._spans)} spans received within {timeout:.0f} s: {names}")
                self._lock.wait(left)
            return list(self._spans)


def main() -> int:
    receiver = Receiver(keep=False).start()
    print(receiver.port, flush=True)
    sys.stdin.read()  # until the caller closes it
    receiver.stop()
    print(f"spans {receiver.count} in {receiver.requests} exports", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
