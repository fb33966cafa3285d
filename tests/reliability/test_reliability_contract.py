"""RELIABILITY.md's situation table, row by row: the status code each situation gets and the metric
that counts it, on a real server (127.0.0.1:0) serving the fault-injecting model.

Every row also checks the error-hygiene rule (4.0), that the model ran only where the row says so,
and that the server is still SERVING afterwards. Rows about texts apply to token ids here; rows left
out (28 sticky CUDA error, 34 per-identity authorization, 36 keepalive, 41 streaming half-close)
are listed in the module's last comment.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import SERVICE_NAME
from tests.support.helpers import Running, details_of, health, ids_request, wait_for
from tests.support.reliability_helpers import (
    Admissions,
    assert_clean_status,
    assert_ledger_balanced,
    batches,
    fault_state,  # noqa: F401  (a fixture, used by name)
    no_messages,
)

Code = grpc.StatusCode
ENCODE = f"/{SERVICE_NAME}/Encode"
HOOKS: dict[str, Any] = {"allow_fault_hooks": True}


def raw_encode(s: Running, **channel_kw: Any) -> Any:
    return s.channel.unary_unary(ENCODE, **channel_kw)  # bytes in, bytes out


# -- the calls of each row: each returns the call's status code and error (None when OK) -------------

Outcome = tuple[grpc.StatusCode, grpc.aio.AioRpcError | None]


async def outcome(call: Awaitable[Any]) -> Outcome:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error
    return Code.OK, None


def encode(*seqs: Any, timeout: float | None = 10, **fields: Any) -> Callable[[Running], Awaitable[Outcome]]:
    async def run(s: Running) -> Outcome:
        return await outcome(s.stub.Encode(ids_request(*seqs, **fields), timeout=timeout))

    return run


def raw(data: bytes) -> Callable[[Running], Awaitable[Outcome]]:
    async def run(s: Running) -> Outcome:
        return await outcome(raw_encode(s)(data, timeout=10))

    return run


async def response_over_client_limit(s: Running) -> Outcome:
    async with grpc.aio.insecure_channel(s.target, options=[("grpc.max_receive_message_length", 1024)]) as ch:
        stub = attention_pb2_grpc.AttentionServiceStub(ch)
        return await outcome(stub.Encode(ids_request(np.arange(1, 60)), timeout=10))


async def gzip_bomb(s: Running) -> Outcome:
    request = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=pb.Tensor(
        dtype=pb.DTYPE_INT64, shape=[1], data=bytes(4 << 20)))])  # 4 MiB of zeros, a few KiB gzipped
    return await outcome(s.stub.Encode(request, timeout=10, compression=grpc.Compression.Gzip))


async def unknown_method(s: Running) -> Outcome:
    return await outcome(s.channel.unary_unary(f"/{SERVICE_NAME}/Decode")(b"", timeout=10))


async def unknown_service(s: Running) -> Outcome:
    return await outcome(s.channel.unary_unary("/attention.v9.Nope/Encode")(b"", timeout=10))


async def cancel_when(s: Running, ready: Callable[[], bool]) -> Outcome:
    call = s.stub.Encode(ids_request([4, 5, 6]), timeout=30)
    await wait_for(ready, what="the call to reach the window")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    return await call.code(), None


async def cancel_while_queued(s: Running) -> Outcome:
    return await cancel_when(s, lambda: s.sample("attention_queue_depth") == 1)


async def cancel_while_running(s: Running) -> Outcome:
    return await cancel_when(s, lambda: batches(s) == 1)


async def own_cancelled_error(s: Running) -> Outcome:
    """Our own code cancels the futures a live call awaits (a bug, or a shutdown path): the caller
    must get an answer at once, not hang until its 30 s deadline (grpc/grpc#29248)."""
    admissions = Admissions(s, keep_items=True)
    call = s.stub.Encode(ids_request([4, 5, 6]), timeout=30)
    await wait_for(lambda: len(admissions.items) == 1, what="admission")
    for item in admissions.items[0]:
        item.future.cancel()
    # At once: the row expects our INTERNAL "request aborted"; a call left hanging would end
    # DEADLINE_EXCEEDED at its 30 s deadline instead, and one answered only when the item ripened
    # (fault_delay_after_admit_ms) would have formed a batch first.
    result = await outcome(call)
    assert batches(s) == 0
    return result


async def while_warming_up(s: Running) -> Outcome:
    assert await health(s.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await health(s.channel, "") == health_pb2.HealthCheckResponse.SERVING  # alive meanwhile
    result = await encode([1, 2])(s)
    await asyncio.wait_for(s.server.ready(), 30)
    return result


async def while_shutting_down(s: Running) -> Outcome:
    stopping = asyncio.ensure_future(s.server.stop(5))
    await wait_for(lambda: s.server.serving.draining, what="draining")
    result = await encode([1, 2])(s)  # the in_shutdown hook holds the listener open meanwhile
    await stopping
    return result


def with_metadata(*metadata: tuple[str, str]) -> Callable[[Running], Awaitable[Outcome]]:
    async def run(s: Running) -> Outcome:
        return await outcome(s.stub.Encode(ids_request([1, 2]), metadata=metadata, timeout=10))

    return run


async def reflection_call(s: Running) -> Outcome:
    stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)

    try:  # no message (see no_messages); an enabled service would still answer OK, with no rows
        _ = [r async for r in stub.ServerReflectionInfo(no_messages(), timeout=10)]
    except grpc.aio.AioRpcError as error:
        return error.code(), error
    return Code.OK, None


# -- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    row: str  # RELIABILITY.md situation number
    situation: str
    call: Callable[[Running], Awaitable[Outcome]]
    code: grpc.StatusCode
    metric: tuple[str, dict[str, str]]
    delta: float = 1
    batches: int = 0  # model batches the row may run
    config: dict[str, Any] = field(default_factory=dict)
    message: str = ""  # a regex the details must match
    field: str = ""  # the BadRequest field, for INVALID_ARGUMENT
    ready: bool = True


def failures(reason: str) -> tuple[str, dict[str, str]]:
    return "attention_failures_total", {"reason": reason}


def requests(code: str) -> tuple[str, dict[str, str]]:
    return "attention_requests_total", {"method": "Encode", "code": code}


def auth(reason: str) -> tuple[str, dict[str, str]]:
    return "attention_auth_failures_total", {"reason": reason}


STARTED = ("grpc_server_started_total", {"grpc_service": SERVICE_NAME, "grpc_method": "Encode"})
TOKENS = {"auth_tokens": "tok-alpha,tok-beta"}
CREDENTIALS = "missing or invalid credentials"

ROWS = [
    Row("1", "no sequences", encode(), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences", message="1..64 sequences; got 0"),
    Row("2", "an empty sequence", encode([]), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences[0].token_ids", message="length must be 1..64; got 0"),
    Row("3", "too many sequences", encode(*[[1]] * 65), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences", message="got 65"),
    Row("4", "sequence over max_length", encode(np.ones(65)), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences[0].token_ids", message="got 65"),
    Row("5", "too many tokens per call", encode(np.ones(60), np.ones(60)), Code.INVALID_ARGUMENT,
        failures("invalid_argument"), config={"max_tokens_per_call": 100}, field="sequences",
        message="120 tokens in all; at most 100"),
    Row("6", "invalid UTF-8 in a string field", raw(b"\x0a\x02\xff\xfe"), Code.INVALID_ARGUMENT,
        failures("invalid_argument"), field="request", message="not a valid attention.v1.EncodeRequest"),
    Row("7", "garbage bytes", raw(b"\xff\xff\xff\xff garbage"), Code.INVALID_ARGUMENT,
        failures("invalid_argument"), field="request"),
    Row("7", "truncated message", raw(ids_request(np.arange(1, 30)).SerializeToString()[:-7]),
        Code.INVALID_ARGUMENT, failures("invalid_argument"), field="request"),
    Row("8", "id out of vocabulary", encode([1, 2, 100]), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences[0].token_ids[2]", message=r"id 100 not in \[0, 100\)"),
    Row("8", "negative id", encode([-1]), Code.INVALID_ARGUMENT, failures("invalid_argument"),
        field="sequences[0].token_ids[0]"),
    Row("9", "byte size mismatch", lambda s: outcome(s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(
        token_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], data=bytes(20)))]), timeout=10)),
        Code.INVALID_ARGUMENT, failures("invalid_argument"), field="sequences[0].token_ids",
        message="needs 24 bytes, got 20"),
    Row("10", "attention switched off", encode([1, 2], attention=pb.AttentionOptions(return_attention=True)),
        Code.FAILED_PRECONDITION, failures("failed_precondition"), config={"allow_attention": False},
        message="return_attention is disabled"),
    Row("11", "attention over budget", encode(np.ones(64), attention=pb.AttentionOptions(return_attention=True)),
        Code.INVALID_ARGUMENT, failures("invalid_argument"), config={"max_attention_bytes": 4096},
        field="attention", message="over the budget of 4096 bytes"),
    Row("12", "response over the client's receive limit (lib, at the client)", response_over_client_limit,
        Code.RESOURCE_EXHAUSTED, requests("OK"), batches=1, message="larger than max"),
    Row("13", "request over the server's receive limit (lib)", raw(bytes(80_000)), Code.RESOURCE_EXHAUSTED,
        STARTED, delta=0, config={"max_message_bytes": 65536}, message="larger than max"),
    Row("14", "gzip bomb (lib)", gzip_bomb, Code.RESOURCE_EXHAUSTED, STARTED, delta=0,
        config={"max_message_bytes": 1 << 20}),
    Row("16", "unknown method (lib)", unknown_method, Code.UNIMPLEMENTED, STARTED, delta=0),
    Row("16", "unknown service (lib)", unknown_service, Code.UNIMPLEMENTED, STARTED, delta=0),
    Row("17", "queue full", encode([1], [2], [3]), Code.RESOURCE_EXHAUSTED, failures("queue_full"),
        config={"max_queue_requests": 2}, message="overloaded: queue holds 0/2 sequences"),
    Row("18", "no deadline, queued past default_timeout_s", encode([1, 2], timeout=None), Code.DEADLINE_EXCEEDED,
        failures("deadline"), config={**HOOKS, "default_timeout_s": 0.3, "fault_delay_after_admit_ms": 800}),
    Row("19", "deadline too short to meet", encode([1, 2], timeout=0.3), Code.DEADLINE_EXCEEDED,
        failures("deadline_unmeetable"),
        config={"min_deadline_ms": 500}, message="deadline too short"),
    Row("20", "deadline passes while queued", encode([1, 2], timeout=0.3), Code.DEADLINE_EXCEEDED,
        ("attention_dropped_total", {"reason": "deadline"}), config={**HOOKS, "fault_delay_after_admit_ms": 800}),
    Row("21", "deadline passes during execution", encode([1, 2], timeout=0.3), Code.DEADLINE_EXCEEDED,
        requests("DEADLINE_EXCEEDED"), batches=1, config={**HOOKS, "fault_delay_after_dequeue_ms": 800}),
    Row("22", "cancelled while queued", cancel_while_queued, Code.CANCELLED,
        ("attention_dropped_total", {"reason": "cancelled"}), config={**HOOKS, "fault_delay_after_admit_ms": 2000}),
    Row("23", "cancelled during execution", cancel_while_running, Code.CANCELLED, requests("CANCELLED"), batches=1,
        config={**HOOKS, "fault_delay_after_dequeue_ms": 2000}),
    Row("24", "our own code cancels the call's futures", own_cancelled_error, Code.INTERNAL, failures("internal"),
        config={**HOOKS, "fault_delay_after_admit_ms": 2000}, message=r"^request aborted \(ref=[0-9a-f]{12}\)$"),
    Row("25", "model raises", encode([1, faults.RAISE]), Code.INTERNAL, failures("model_error"), batches=1,
        message=r"^inference failed \(ref=[0-9a-f]{12}\)$"),
    Row("26", "one sequence out of memory", encode([1, faults.OOM]), Code.RESOURCE_EXHAUSTED, failures("oom"),
        batches=1, message="insufficient device memory for 1 sequence of 2 tokens"),
    Row("27", "non-finite output in every precision", encode([1, faults.NAN_ALWAYS]), Code.INTERNAL,
        failures("nonfinite_output"), batches=1, message=r"^non-finite model output \(ref=[0-9a-f]{12}\)$"),
    Row("29", "warming up", while_warming_up, Code.UNAVAILABLE, failures("not_ready"), ready=False,
        config={**HOOKS, "fault_delay_before_ready_ms": 1500}, message="warming up"),
    Row("30", "new call while shutting down", while_shutting_down, Code.UNAVAILABLE, failures("shutting_down"),
        config={**HOOKS, "fault_delay_in_shutdown_ms": 500}, message="shutting down"),
    Row("32", "no credentials", with_metadata(), Code.UNAUTHENTICATED, auth("missing"), config=TOKENS,
        message=f"^{CREDENTIALS}$"),
    Row("33", "wrong token", with_metadata(("authorization", "Bearer tok-gamma")), Code.UNAUTHENTICATED,
        auth("invalid"), config=TOKENS, message=f"^{CREDENTIALS}$"),
    Row("33", "wrong scheme", with_metadata(("authorization", "Basic dG9rLWFscGhhOg==")), Code.UNAUTHENTICATED,
        auth("scheme"), config=TOKENS, message=f"^{CREDENTIALS}$"),
    Row("33", "two authorization entries", with_metadata(
        ("authorization", "Bearer tok-alpha"), ("authorization", "Bearer tok-beta")), Code.UNAUTHENTICATED,
        auth("duplicate"), config=TOKENS, message=f"^{CREDENTIALS}$"),
    Row("38", "reflection switched off", reflection_call, Code.UNIMPLEMENTED,
        ("grpc_server_started_total", {}), delta=0, config={"reflection": False}),
]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.row}-{r.situation}" for r in ROWS])
@pytest.mark.usefixtures("fault_state")
async def test_situation_table(row: Row, start_server, fault_bundle: Path, caplog):
    caplog.set_level(logging.INFO)
    s = await start_server(bundle=fault_bundle, wait_ready=row.ready, **row.config)
    name, labels = row.metric
    before = s.sample(name, labels) if labels else sum_all(s, name)
    code, error = await asyncio.wait_for(row.call(s), 20)

    assert code == row.code, (code, error)
    if error is not None:
        assert_clean_status(error, secrets=("fault-model", "sentinel", "TorchScript", "CUDA"))  # the model's own words
        if row.message:
            assert re.search(row.message, error.details()), error.details()
        if row.field:
            bad = error_details_pb2.BadRequest()
            assert any(d.Unpack(bad) for d in details_of(error)), "no BadRequest detail"
            assert bad.field_violations[0].field == row.field
        if row.code == Code.RESOURCE_EXHAUSTED and "queue" in row.situation:
            retry = error_details_pb2.RetryInfo()
            assert any(d.Unpack(retry) for d in details_of(error)) and retry.retry_delay.ToNanoseconds() > 0
        if "ref=" in error.details():  # the reference id is in the server log, next to the traceback
            ref = error.details().split("ref=")[1].rstrip(")")
            assert any(ref in r.getMessage() for r in caplog.records), ref
    if not s.server.serving.draining:
        await assert_ledger_balanced(s)
    after = s.sample(name, labels) if labels else sum_all(s, name)
    assert after - before == row.delta, (name, labels, before, after)
    assert batches(s) == row.batches
    assert s.sample("grpc_server_handled_total", {"grpc_type": "unary", "grpc_service": SERVICE_NAME,
                                                  "grpc_method": "Encode", "grpc_code": "UNKNOWN"}) == 0
    if not s.server.serving.draining:
        assert await health(s.channel) == health_pb2.HealthCheckResponse.SERVING


def sum_all(s: Running, name: str) -> float:
    return sum(sample.value for family in s.registry.collect() for sample in family.samples if sample.name == name)


async def test_metadata_over_the_hard_limit_is_refused_by_the_library(start_server, fault_bundle):
    """Row 15: a 20 KiB header exceeds grpc's 16 KiB hard limit; no handler runs, the server lives on."""
    s = await start_server(bundle=fault_bundle)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(ids_request([1]), metadata=(("x-big", "v" * 20_000),), timeout=10)
    assert info.value.code() in (Code.RESOURCE_EXHAUSTED, Code.INTERNAL, Code.UNAVAILABLE)
    assert_clean_status(info.value, secrets=("v" * 50,))
    assert s.sample(*STARTED) == 0
    ok = await s.stub.Encode(ids_request([1, 2]), timeout=10)
    assert len(ok.outputs) == 1


async def test_no_deadline_is_served_not_treated_as_zero(start_server, fault_bundle):
    """D-08: `time_remaining()` is None without a deadline; the call is served under default_timeout_s."""
    s = await start_server(bundle=fault_bundle, min_deadline_ms=100)
    response = await s.stub.Encode(ids_request([1, 2, 3]))
    assert len(response.outputs) == 1


async def test_a_callers_deadline_longer_than_the_default_is_honoured(start_server, tiny_bundle):
    """default_timeout_s is for calls that carry no deadline; a caller that sets a longer one gets it
    (issue 16 item 8: it used to cap every call)."""
    s = await start_server(bundle=tiny_bundle, **HOOKS, default_timeout_s=0.3, fault_delay_after_dequeue_ms=800)
    response = await s.stub.Encode(ids_request([1, 2, 3]), timeout=20)  # the forward starts 0.8 s in
    assert len(response.outputs) == 1 and response.metadata.batch_size == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:  # no deadline: the default's 0.3 s apply
        await s.stub.Encode(ids_request([1, 2, 3]))
    assert info.value.code() == Code.DEADLINE_EXCEEDED


async def test_model_error_and_oom_leave_the_loop_queue_and_health_alive(start_server, fault_bundle):
    s = await start_server(bundle=fault_bundle)
    for sentinel in (faults.RAISE, faults.OOM, faults.NAN_ALWAYS) * 3:
        with pytest.raises(grpc.aio.AioRpcError):
            await s.stub.Encode(ids_request([1, sentinel]), timeout=10)
    ok = await s.stub.Encode(ids_request([1, 2], [3, 4, 5]), timeout=10)
    assert len(ok.outputs) == 2
    assert await health(s.channel) == health_pb2.HealthCheckResponse.SERVING
    await assert_ledger_balanced(s)


async def test_a_long_echo_of_the_request_is_cut_short(start_server, fault_bundle):
    """Found by the byte fuzz: a flipped tag turned the data bytes into a 300-dimension shape, which
    the message quoted in full. Messages are capped (256 chars); the field still names the culprit."""
    s = await start_server(bundle=fault_bundle)
    request = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[7] * 300))])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(request, timeout=10)
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert_clean_status(info.value)
    assert len(info.value.details()) <= 256 and info.value.details().endswith(" ...")
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in details_of(info.value))
    assert bad.field_violations[0].field == "sequences[0].token_ids"
