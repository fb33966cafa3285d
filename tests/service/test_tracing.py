"""Tracing (service/tracing.py, docs/tracing.md) end to end: a real OTLP receiver on 127.0.0.1:0
(tests/support/otlp_receiver.py) gets the spans of calls through attention.v1, KServe v2, OpenAI and TEI, in
one process and through edge processes: the caller's trace continued, each call's children inside it, the
attributes as documented, a failed call's error status, and the forward spans linked to the calls they served.
With no endpoint, not one span object is made."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import opentelemetry.sdk.trace as sdk_trace
import opentelemetry.trace as api_trace
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from service import tracing
from service.config import ServiceConfig
from tests.support.helpers import Running, ids_request
from tests.support.otlp_receiver import KIND_SERVER, STATUS_ERROR, Receiver, Span
from tests.support.server_process import ServerProcess

MODEL = "fault-model"  # model/faults.py's TINY model: ids < 100, RAISE=98 fails its forward
CHILDREN = ("decode", "queue", "encode")
ENCODE = "attention.v1.AttentionService/Encode"
INFER = "inference.GRPCInferenceService/ModelInfer"


class Caller:
    """A caller's own span, sent as W3C traceparent: the service's spans must continue its trace."""

    def __init__(self, sampled: bool = True) -> None:
        self.trace_id, self.span_id = os.urandom(16).hex(), os.urandom(8).hex()
        self.header = f"00-{self.trace_id}-{self.span_id}-{'01' if sampled else '00'}"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("traceparent", self.header), ("tracestate", "vendor=caller"))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def calls_of(spans: list[Span], caller: Caller) -> list[Span]:
    return [s for s in spans if s.trace_id == caller.trace_id and s.parent == caller.span_id]


def linked(spans: list[Span], call: Span) -> list[Span]:
    """The forward spans that link to `call`."""
    return [s for s in spans if s.name == "forward" and (call.trace_id, call.span_id) in s.links]


def traced(caller: Caller, calls: int = 1, children: tuple[str, ...] = CHILDREN):
    """A predicate: `calls` call spans of `caller`'s trace are in, each with its children and a forward linked."""
    def enough(spans: list[Span]) -> bool:
        found = calls_of(spans, caller)
        return len(found) >= calls and all(
            {c.name for c in spans if c.parent == call.span_id} >= set(children) and linked(spans, call)
            for call in found)

    return enough


async def received(receiver: Receiver, *callers: Caller, calls: int = 1) -> list[Span]:
    def enough(spans: list[Span]) -> bool:
        return all(traced(c, calls)(spans) for c in callers)

    return await asyncio.to_thread(receiver.wait, enough)


def check_call(spans: list[Span], caller: Caller, name: str, door: str, transport: str, tokens: int,
               sequences: int = 1) -> Span:
    """The call span of `caller`'s trace: its place in the trace, its attributes, its children inside it, and
    a forward span that served it."""
    [call] = [s for s in calls_of(spans, caller) if s.name == name]
    assert call.kind == KIND_SERVER and call.status != STATUS_ERROR
    attrs = call.attributes
    assert (attrs["attention.door"], attrs["attention.transport"], attrs["attention.model"], attrs["attention.code"]
            ) == (door, transport, MODEL, "OK"), attrs
    assert (attrs["attention.sequences"], attrs["attention.tokens"], attrs["attention.task"]) == (
        sequences, tokens, "embed"), attrs
    assert attrs["attention.queue_ms"] >= 0 and attrs["attention.compute_ms"] > 0 and attrs["attention.batch_size"] >= 1
    children = {s.name: s for s in spans if s.parent == call.span_id}
    assert set(children) == set(CHILDREN), sorted(children)
    for child in children.values():
        assert child.trace_id == call.trace_id
        assert call.start_ns <= child.start_ns <= child.end_ns <= call.end_ns, child.name
    assert 0 <= children["decode"].attributes["attention.plan_ms"] * 1e6 <= children["decode"].end_ns - call.start_ns
    stages = [children[n] for n in CHILDREN]
    assert all(a.end_ns <= b.start_ns for a, b in zip(stages, stages[1:], strict=False)), "stages out of order"
    forwards = linked(spans, call)
    assert forwards, f"no forward span links to {name}"
    for forward in forwards:
        f = forward.attributes
        assert f["attention.model"] == MODEL and f["attention.batch.size"] >= 1 and f["attention.batch.calls"] >= 1
        assert f["attention.batch.padded_length"] * f["attention.batch.size"] >= f["attention.batch.tokens"] >= 1
        assert forward.parent == "" and forward.trace_id != call.trace_id  # a batch's own trace, linked to calls
    return call


def kserve_inputs(ids: list[int]) -> list[Any]:
    tensor = triton.InferInput("input_ids", [1, len(ids)], "INT64")
    tensor.set_data_from_numpy(np.asarray([ids], np.int64))
    return [tensor]


@pytest.fixture
async def traced_server(start_server: Any, fault_bundle: Path, receiver: Receiver) -> Running:
    served: Running = await start_server(bundle=fault_bundle, http_port=0, openai_token_ids=True,
                                         otlp_endpoint=receiver.endpoint,
                                         otlp_export_delay_ms=20.0, otlp_service_name="traced-test")
    return served


@pytest.fixture
async def http(traced_server: Running) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{traced_server.server.http_port}") as client:
        yield client


async def test_every_door_continues_the_callers_trace_with_its_stages_and_forwards(
        traced_server: Running, http: httpx.AsyncClient, receiver: Receiver) -> None:
    v1, v2, openai, tei = Caller(), Caller(), Caller(), Caller()
    await traced_server.stub.Encode(ids_request([1, 2, 3], [4, 5, 6, 7]), metadata=v1.metadata, timeout=30)
    kserve = triton_aio.InferenceServerClient(traced_server.target)
    try:
        await kserve.infer(MODEL, kserve_inputs([5, 6, 7, 8, 9]), headers={"traceparent": v2.header})
    finally:
        await kserve.close()
    r = await http.post("/v1/embeddings", json={"model": MODEL, "input": [[1, 2]]},
                        headers={"traceparent": openai.header})
    assert r.status_code == 200, r.text
    r = await http.post("/embed", json={"inputs": [[3, 4, 5, 6, 7, 8]]}, headers={"traceparent": tei.header})
    assert r.status_code == 200, r.text

    spans = await received(receiver, v1, v2, openai, tei)
    call = check_call(spans, v1, ENCODE, "attention.v1", "grpc", tokens=7, sequences=2)
    assert (call.attributes["rpc.system"], call.attributes["rpc.method"], call.attributes["rpc.grpc.status_code"]) == (
        "grpc", "Encode", 0)
    check_call(spans, v2, INFER, "kserve", "grpc", tokens=5)
    call = check_call(spans, openai, "POST /v1/embeddings", "openai", "http", tokens=2)
    assert (call.attributes["http.route"], call.attributes["http.response.status_code"]) == ("/v1/embeddings", 200)
    check_call(spans, tei, "POST /embed", "tei", "http", tokens=6)
    assert {s.resource["service.name"] for s in spans} == {"traced-test"}
    assert {s.process for s in spans} == {"server"}


async def test_a_failed_call_has_an_error_status_and_a_failed_forward_says_so(
        traced_server: Running, http: httpx.AsyncClient, receiver: Receiver) -> None:
    invalid, internal, tei = Caller(), Caller(), Caller()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await traced_server.stub.Encode(ids_request([1, 150]), metadata=invalid.metadata, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await traced_server.stub.Encode(ids_request([1, faults.RAISE]), metadata=internal.metadata, timeout=30)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    r = await http.post("/embed", json={"inputs": [[1, 150]]}, headers={"traceparent": tei.header})
    assert r.status_code == 422

    def enough(spans: list[Span]) -> bool:
        return all(calls_of(spans, c) for c in (invalid, internal, tei)) and traced(
            internal, children=("decode", "queue"))(spans)

    spans = await asyncio.to_thread(receiver.wait, enough)
    [call] = calls_of(spans, invalid)
    assert call.status == STATUS_ERROR and call.message.startswith("INVALID_ARGUMENT: ")
    assert "sequences[0]" in call.message  # the field the caller was told of
    assert (call.attributes["attention.code"], call.attributes["rpc.grpc.status_code"]) == ("INVALID_ARGUMENT", 3)
    assert not {s.name for s in spans if s.parent == call.span_id} & {"queue", "encode"}  # refused before queueing
    [call] = calls_of(spans, internal)
    assert call.status == STATUS_ERROR and call.attributes["attention.code"] == "INTERNAL"
    assert "ref=" in call.message  # the reference id the log has the traceback under
    [forward] = linked(spans, call)
    assert forward.status == STATUS_ERROR and forward.attributes["attention.batch.failed"] == 1
    [queue] = [s for s in spans if s.parent == call.span_id and s.name == "queue"]  # until it failed
    assert queue.attributes["attention.unfinished"] is True and queue.end_ns <= call.end_ns
    [call] = calls_of(spans, tei)
    assert call.status == STATUS_ERROR and call.attributes["http.response.status_code"] == 422
    assert call.attributes["attention.code"] == "INVALID_ARGUMENT"


async def test_a_streams_requests_are_calls_of_the_streams_trace(traced_server: Running, receiver: Receiver) -> None:
    caller = Caller()

    async def requests() -> AsyncIterator[pb.EncodeRequest]:
        for i in range(3):
            yield ids_request([1, 2, 3 + i], request_id=f"r{i}")

    stream = traced_server.stub.EncodeStream(requests(), metadata=caller.metadata, timeout=30)
    answers = [response async for response in stream]
    assert sorted(a.request_id for a in answers) == ["r0", "r1", "r2"]
    spans = await received(receiver, caller, calls=3)
    calls = calls_of(spans, caller)
    assert len(calls) == 3 and {c.name for c in calls} == {"attention.v1.AttentionService/EncodeStream"}
    assert len({c.span_id for c in calls}) == 3


async def test_sampling_follows_the_ratio_and_the_callers_flag(start_server: Any, fault_bundle: Path,
                                                               receiver: Receiver) -> None:
    served: Running = await start_server(bundle=fault_bundle, otlp_endpoint=receiver.endpoint,
                                         otlp_export_delay_ms=20.0, trace_sample_ratio=0.0)
    unsampled, sampled = Caller(sampled=False), Caller(sampled=True)
    await served.stub.Encode(ids_request([1, 2, 3]), timeout=30)  # no traceparent: the ratio (0) decides
    await served.stub.Encode(ids_request([1, 2, 4]), metadata=unsampled.metadata, timeout=30)
    await served.stub.Encode(ids_request([1, 2, 5]), metadata=sampled.metadata, timeout=30)
    await served.server.stop(0)  # flushes: whatever was to be exported has been
    spans = receiver.spans
    assert traced(sampled)(spans)
    assert {s.trace_id for s in spans if s.name != "forward"} == {sampled.trace_id}
    forwards = [s for s in spans if s.name == "forward"]
    assert forwards and all(link[0] == sampled.trace_id for s in forwards for link in s.links)


async def test_otlp_over_http(start_server: Any, fault_bundle: Path, receiver: Receiver) -> None:
    served: Running = await start_server(bundle=fault_bundle, otlp_endpoint=receiver.http_endpoint,
                                         otlp_protocol="http", otlp_export_delay_ms=20.0)
    caller = Caller()
    await served.stub.Encode(ids_request([1, 2, 3]), metadata=caller.metadata, timeout=30)
    check_call(await received(receiver, caller), caller, ENCODE, "attention.v1", "grpc", tokens=3)


class SpanCount:
    """Every span object made in this process (the SDK's and the API's non-recording ones), counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made = 0
        for cls in (sdk_trace.ReadableSpan, api_trace.NonRecordingSpan):
            init = cls.__init__

            def counted(obj: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
                self.made += 1
                _init(obj, *args, **kwargs)

            monkeypatch.setattr(cls, "__init__", counted)


async def every_door(served: Running, caller: Caller) -> None:
    """One call through each door (attention.v1 unary and stream, KServe, OpenAI, TEI) and a failed one."""
    await served.stub.Encode(ids_request([1, 2, 3]), metadata=caller.metadata, timeout=30)
    answers = served.stub.EncodeStream(iter([ids_request([4, 5])]), metadata=caller.metadata, timeout=30)
    assert len([a async for a in answers]) == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await served.stub.Encode(ids_request([150]), metadata=caller.metadata, timeout=30)
    kserve = triton_aio.InferenceServerClient(served.target)
    try:
        await kserve.infer(MODEL, kserve_inputs([5, 6]), headers={"traceparent": caller.header})
    finally:
        await kserve.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.server.http_port}") as http:
        for path, body in (("/v1/embeddings", {"model": MODEL, "input": [[1, 2]]}), ("/embed", {"inputs": [[3, 4]]})):
            assert (await http.post(path, json=body, headers={"traceparent": caller.header})).status_code == 200


async def test_no_endpoint_no_span_objects(start_server: Any, fault_bundle: Path, receiver: Receiver,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    count = SpanCount(monkeypatch)
    off: Running = await start_server(bundle=fault_bundle, http_port=0, openai_token_ids=True)
    assert off.server.lifecycle.tracing is None and off.server.engine.tracing is None
    await every_door(off, Caller())
    assert count.made == 0
    # The count can fail: the same calls with an endpoint make spans.
    on: Running = await start_server(bundle=fault_bundle, http_port=0, openai_token_ids=True,
                                     otlp_endpoint=receiver.endpoint)
    await every_door(on, Caller())
    assert count.made >= 5 * 4  # five calls answered OK, four spans each at least


def test_tracing_settings_are_validated() -> None:
    for bad, named in (({"otlp_endpoint": "127.0.0.1:4317"}, "otlp_endpoint"),
                       ({"otlp_endpoint": "grpc://collector:4317"}, "otlp_endpoint"),
                       ({"otlp_protocol": "thrift"}, "otlp_protocol"),
                       ({"trace_sample_ratio": 1.5}, "trace_sample_ratio"),
                       ({"otlp_export_delay_ms": 0.0}, "otlp_export_delay_ms"),
                       ({"otlp_service_name": " "}, "otlp_service_name")):
        with pytest.raises(ValueError, match=named):
            ServiceConfig(**bad)
    config = ServiceConfig.from_args(["--otlp-protocol", "http", "--trace-sample-ratio", "0.25"],
                                     {"ATTN_OTLP_ENDPOINT": "https://collector:4318/otlp/v1/traces"})
    assert (config.otlp_endpoint, config.otlp_protocol, config.trace_sample_ratio) == (
        "https://collector:4318/otlp/v1/traces", "http", 0.25)


@pytest.mark.slow
async def test_edge_processes_trace_calls_and_the_model_process_links_its_forwards(
        fault_bundle: Path, receiver: Receiver, tmp_path: Path) -> None:
    server = ServerProcess(fault_bundle, "--edge-processes", "2", "--openai-token-ids",
                           "--otlp-endpoint", receiver.endpoint,
                           "--otlp-export-delay-ms", "20", directory=tmp_path)
    callers = [Caller() for _ in range(4)]
    try:
        channel = grpc.aio.insecure_channel(server.target)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        await stub.Encode(ids_request([1, 2, 3], [4, 5]), metadata=callers[0].metadata, timeout=30)
        await channel.close()
        kserve = triton_aio.InferenceServerClient(server.target)
        try:
            await kserve.infer(MODEL, kserve_inputs([5, 6, 7, 8]), headers={"traceparent": callers[1].header})
        finally:
            await kserve.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports['http_port']}") as http:
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": [[1, 2]]},
                                headers={"traceparent": callers[2].header})
            assert r.status_code == 200, r.text
            r = await http.post("/embed", json={"inputs": [[3, 4, 5, 6, 7, 8]]},
                                headers={"traceparent": callers[3].header})
            assert r.status_code == 200, r.text
        spans = await received(receiver, *callers)
    finally:
        server.stop()
    for caller, name, door, transport, tokens, sequences in (
            (callers[0], ENCODE, "attention.v1", "grpc", 5, 2), (callers[1], INFER, "kserve", "grpc", 4, 1),
            (callers[2], "POST /v1/embeddings", "openai", "http", 2, 1),
            (callers[3], "POST /embed", "tei", "http", 6, 1)):
        call = check_call(spans, caller, name, door, transport, tokens, sequences)
        assert call.process.startswith("edge "), call.process  # the call is the edge's ...
        assert {s.process for s in linked(spans, call)} == {"model"}  # ... its forward the model process's
    assert {s.process for s in spans} <= {"model", "edge 0", "edge 1"}


def test_a_full_export_queue_logs_a_line_a_minute_not_one_per_dropped_span() -> None:
    drops = tracing._DropsPerMinute()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("opentelemetry.sdk._shared_internal", logging.WARNING, __file__, 0, message,
                                 ("Span",), None)

    passed = [r for r in (record("Queue full, dropping %s.") for _ in range(100)) if drops.filter(r)]
    assert len(passed) == 1 and passed[0].getMessage().endswith(": 1 span(s) dropped")
    assert drops.filter(record("Exception while exporting %s."))  # anything else goes through
