"""Edge processes (`--edge-processes N`, service/multiproc/): real processes, over real sockets.

The calls give what one process gives, bit for bit; calls from many connections reach both edges and
are batched together in the one model process; cancellation, deadlines, overload and model failures
travel between the processes with the codes of one process; metrics and the exit ledger add up over
all of them; a crashed edge is restarted; a crashed model process takes its edges down, failing their
calls UNAVAILABLE; the port cannot be shared by accident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from opentelemetry.trace import SpanContext, TraceFlags
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as v2
from tritonclient.grpc import service_pb2_grpc

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import SERVICE_NAME
from service import tracing
from service.config import ServiceConfig
from service.multiproc import frames
from service.multiproc.host import reserve_port
from service.server import build_server
from tests.support.helpers import details_of, ids_request, test_config, wait_for
from tests.support.reliability_helpers import assert_clean_status
from tests.support.server_process import ServerProcess

Code = grpc.StatusCode
EDGE = ("--edge-processes", "2")
# One TCP connection per channel: grpc shares a subchannel between channels to one target otherwise.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def edge_ledgers(server: ServerProcess) -> list[dict[str, object]]:
    """Each edge's own call ledger, as the model process logged it when the edge stopped."""
    marker = "stopped; its calls "
    return [json.loads(line.split(marker, 1)[1]) for line in server.output().splitlines() if marker in line]


def families(server: ServerProcess) -> dict[str, tuple[str, frozenset[str]]]:
    """The families /metrics exports with samples: name -> (type, label names). Without the `_created`
    timestamps, which prometheus_client's multiprocess mode does not export (docs/edge-processes.md)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports['metrics_port']}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels if k != "le"))
            for f in text_string_to_metric_families(text) if f.samples and not f.name.endswith("_created")}


def edge_pids(server: ServerProcess) -> list[int]:
    """The pids of the edges running now (the last one started in each slot), from the log."""
    latest: dict[str, int] = {}
    for line in server.output().splitlines():
        if " started (pid " in line and "service.multiproc.host: edge " in line:
            slot = line.split("service.multiproc.host: edge ", 1)[1].split()[0]
            latest[slot] = int(line.rsplit("pid ", 1)[1].rstrip(")"))
    return list(latest.values())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SCRAPE_POLL_S = 0.2  # tests/support/helpers.py wait_for: how often a predicate may scrape the service


@pytest.fixture(scope="module")
def edged(fault_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(fault_bundle, *EDGE, "--max-queue-tokens", "150", "--max-batch-size", "16",
                           directory=tmp_path_factory.mktemp("edged"))
    yield server
    server.stop()


async def hold(stub: attention_pb2_grpc.AttentionServiceStub, server: ServerProcess,
               sleeps: int) -> grpc.aio.UnaryUnaryCall:
    """A call that keeps the model busy `sleeps` x 200 ms; returns once its forward runs."""
    before = server.sample("attention_batch_size_count")
    call = stub.Encode(ids_request([faults.SLEEP] * sleeps), timeout=30)
    await wait_for(lambda: server.sample("attention_batch_size_count") > before, 20, "the holding forward",
                   SCRAPE_POLL_S)
    return call


def test_edge_processes_is_validated():
    assert ServiceConfig(edge_processes=2).edge_processes == 2
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="edge_processes"):
            ServiceConfig(edge_processes=bad)
    assert ServiceConfig.from_args([], env={"ATTN_EDGE_PROCESSES": "3"}).edge_processes == 3


async def test_outputs_are_bitwise_those_of_one_process(fault_bundle: Path, edged: ServerProcess, tmp_path: Path):
    single = ServerProcess(fault_bundle, directory=tmp_path)
    rng = np.random.default_rng(0)
    requests = [
        ids_request(rng.integers(1, 90, 7)),
        ids_request(rng.integers(1, 90, 12), rng.integers(1, 90, 3),
                    attention=pb.AttentionOptions(return_attention=True, layers=[0, -1], heads=pb.HEADS_MEAN),
                    output=pb.OutputOptions(pooling=pb.POOLING_MEAN, normalize=True)),
        pb.EncodeRequest(sequences=[pb.Sequence(embeddings=pb.Tensor(
            dtype=pb.DTYPE_FLOAT32, shape=[5, 32], data=rng.standard_normal((5, 32), np.float32).tobytes()))],
            causal=True, output=pb.OutputOptions(dtype=pb.DTYPE_FLOAT16, return_hidden=False,
                                                 pooling=pb.POOLING_CLS)),
        ids_request(rng.integers(1, 90, 70), long_inputs=pb.LONG_INPUTS_CHUNK, chunk_stride=32),  # 64-token model
    ]
    try:
        answers = []
        for server in (single, edged):
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                answers.append(([(await stub.Encode(r, timeout=30)).outputs for r in requests],
                                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)))
        exported = [families(single), families(edged)]
    finally:
        single.stop()
    assert exported[0] == exported[1]  # the same families, of the same types, with the same label sets
    (one, info_one), (edges, info_edges) = answers
    for a, b in zip(one, edges, strict=True):
        assert [o.SerializeToString() for o in a] == [o.SerializeToString() for o in b]
    assert one[-1][0].windows > 1  # the long one ran as several windows, stitched the same way
    assert info_one == info_edges


async def test_text_is_tokenized_in_the_edges_with_the_model_process_tokenizer(tiny_text_bundle: Path,
                                                                                tmp_path: Path):
    from model.bundle import read_manifest

    server = ServerProcess(tiny_text_bundle, *EDGE, directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            r = await stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text="cat"), pb.Sequence(text="")],
                                                   output=pb.OutputOptions(pooling=pb.POOLING_CLS, prompt_name="query",
                                                                           return_tokens=True)), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as too_long:
                await stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text="a b c a b c a b c")]), timeout=10)
    finally:
        server.stop()
    manifest = read_manifest(tiny_text_bundle)
    assert manifest.text is not None and info.text.accepted
    assert info.text.tokenizer_checksum == manifest.text.tokenizer_sha256 and info.text.max_tokens == 8
    assert [list(o.tokens) for o in r.outputs] == [["[CLS]", "a", "cat", "[SEP]"], ["[CLS]", "a", "[SEP]"]]
    assert too_long.value.code() == Code.INVALID_ARGUMENT


async def test_bearer_tokens_from_the_environment_guard_every_edge(fault_bundle: Path, tmp_path: Path):
    server = ServerProcess(fault_bundle, *EDGE, directory=tmp_path, env={"ATTN_AUTH_TOKENS": "tok-alpha"})
    try:
        for _ in range(4):  # fresh connections, so both edges are asked
            async with grpc.aio.insecure_channel(server.target, options=OWN_CONNECTION) as channel:
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Encode(ids_request([1, 2]), timeout=10)
                assert refused.value.code() == Code.UNAUTHENTICATED
                ok = await stub.Encode(ids_request([1, 2]), timeout=10,
                                       metadata=(("authorization", "Bearer tok-alpha"),))
                assert ok.outputs
    finally:
        server.stop()
    assert "tok-alpha" not in server.output()  # the secret reached the edges, never the log
    assert server.exit_ledger()["handled"] == {"OK": 4}  # refused before any handler: not started


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp folder with a short path, for the service's Unix socket (108 bytes at most)."""
    with tempfile.TemporaryDirectory(prefix="sweep-") as name:
        yield Path(name)


async def test_no_file_holds_a_token_and_what_a_killed_model_process_leaves_is_swept(fault_bundle: Path,
                                                                                     tmp_path: Path, short_tmp: Path):
    # Issue 27, item 9: config.json held ATTN_AUTH_TOKENS in clear, and a kill -9 left it behind for good.
    secret = "tok-never-on-disk"
    tmp = short_tmp  # the service's temp folder, this test's alone
    env = {"ATTN_AUTH_TOKENS": secret, "TMPDIR": str(tmp)}
    first = ServerProcess(fault_bundle, "--edge-processes", "1", directory=tmp_path / "first", env=env)
    edges: list[int] = first.ports["edge_pids"]  # type: ignore[assignment]
    try:
        files = [path for path in tmp.rglob("*") if path.is_file()]
        assert any(path.name == "config.json" for path in files), files  # the edges' config is there...
        for path in files:
            assert secret.encode() not in path.read_bytes(), path  # ... but no token, in any file
        async with grpc.aio.insecure_channel(first.target) as channel:  # yet the edge checks tokens
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Encode(ids_request([1, 2]), timeout=10)
            assert refused.value.code() == Code.UNAUTHENTICATED
            assert (await stub.Encode(ids_request([1, 2]), timeout=10,
                                      metadata=(("authorization", f"Bearer {secret}"),))).outputs
        first.proc.kill()
        await wait_for(lambda: not any(alive(pid) for pid in edges), 20, "the edges to exit")
    finally:
        first.kill()
        for pid in edges:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    left = {path.name for path in tmp.iterdir()}
    lock = f"attention-service-{os.getuid()}-port-{first.ports['port']}.lock"
    http_lock = f"attention-service-{os.getuid()}-port-{first.ports['http_port']}.lock"  # the HTTP door's port
    assert {lock, http_lock} <= left and len(left) == 3, left  # the private directory and the lock files
    second = ServerProcess(fault_bundle, "--edge-processes", "1", directory=tmp_path / "second", env=env)
    now = {path.name for path in tmp.iterdir()}
    assert not (left - {lock, http_lock}) & now, now  # the dead owner's directory is gone
    assert lock not in now or second.ports["port"] == first.ports["port"], now
    assert http_lock not in now or second.ports["http_port"] == first.ports["http_port"], now
    assert second.terminate() == 0, second.output()[-3000:]
    assert not list(tmp.iterdir()), list(tmp.iterdir())  # a clean exit leaves nothing: lock file included
    assert "left by a model process that is gone" in second.output()


async def test_model_failure_invalid_input_and_overload_keep_their_codes(edged: ServerProcess):
    async with grpc.aio.insecure_channel(edged.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Encode(ids_request([faults.RAISE, 1]), timeout=30)
        assert failed.value.code() == Code.INTERNAL and "ref=" in failed.value.details()
        assert faults.RAISE_MESSAGE not in failed.value.details()  # internals stay in the log
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.Encode(ids_request([1, 1000]), timeout=30)
        assert invalid.value.code() == Code.INVALID_ARGUMENT

        held = await hold(stub, edged, 25)  # 5 s: room for a busy machine to queue two calls behind it
        queued = [stub.Encode(ids_request(np.arange(1, 65)), timeout=30) for _ in range(2)]
        await wait_for(lambda: edged.sample("attention_queue_depth") == 2, 20, "two queued calls")
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # max_queue_tokens 150: 128 queued, 64 more
            await stub.Encode(ids_request(np.arange(1, 65)), timeout=30)
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        assert_clean_status(refused.value)
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in details_of(refused.value)) and retry.retry_delay.ToNanoseconds() > 0
        for call in (held, *queued):
            assert (await call).outputs


async def test_a_cancelled_call_is_dropped_in_the_model_process(edged: ServerProcess):
    async with grpc.aio.insecure_channel(edged.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        before = edged.sample("attention_dropped_total", {"reason": "cancelled"})
        held = await hold(stub, edged, 25)  # 5 s, as above
        gone = stub.Encode(ids_request([5, 6]), timeout=30)
        await wait_for(lambda: edged.sample("attention_queue_depth") == 1, 20, "the queued call")
        gone.cancel()
        await wait_for(lambda: edged.sample("attention_dropped_total", {"reason": "cancelled"}) == before + 1, 20,
                       "the cancelled job dropped")
        assert edged.sample("attention_queue_depth") == 0
        assert (await held).outputs


async def test_a_deadline_that_passes_in_the_queue_is_deadline_exceeded(edged: ServerProcess):
    async with grpc.aio.insecure_channel(edged.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        before = edged.sample("attention_dropped_total", {"reason": "deadline"})
        # 5 s of model time for a 1 s deadline: the late call must reach the model process's queue before
        # its deadline (through an edge process: 0.3 s was too short at load 13) and expire there while the
        # forward runs, which a busy machine's stall (the forward seen by a /metrics scrape) must not outlast.
        held = await hold(stub, edged, 25)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.Encode(ids_request([7, 8]), timeout=1.0)
        assert late.value.code() == Code.DEADLINE_EXCEEDED
        await wait_for(lambda: edged.sample("attention_dropped_total", {"reason": "deadline"}) == before + 1, 20,
                       "the expired job dropped", SCRAPE_POLL_S)
        assert (await held).outputs


async def test_the_port_is_not_shared_with_another_service(fault_bundle: Path, edged: ServerProcess):
    port = edged.ports["port"]
    with pytest.raises(RuntimeError, match="Failed to bind"):  # a service in one process
        build_server(test_config(fault_bundle, port=port), CollectorRegistry())
    with pytest.raises(OSError, match="held by another service's edge processes"):  # one with edge processes
        reserve_port("127.0.0.1", port)
    with socket.socket() as plain:  # and this mode cannot take the port of a service in one process
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError, match="gRPC port .* (is already in use|cannot be bound)"):
            reserve_port("127.0.0.1", plain.getsockname()[1])


async def test_a_crashed_edge_is_restarted(edged: ServerProcess):
    victim = edged.ports["edge_pids"][0]  # type: ignore[index]
    processes = {dict(labels)["process"]: v for (name, labels), v in edged.scrape().items()
                 if name == "process_start_time_seconds"}  # each process's own, read from its /proc
    assert sorted(processes) == ["edge 0", "edge 1", "model"], processes
    started = processes["edge 0"]
    os.kill(victim, signal.SIGKILL)
    await wait_for(lambda: "restarting it" in edged.output() and edged.output().count("edge 0 started") == 2, 20,
                   "the edge restarted")
    await wait_for(lambda: edged.sample("attention_ready") == 1, 20, "every edge ready again")
    # /metrics follows the new process under the old name (service/process_metrics.py)
    assert edged.sample("process_start_time_seconds", {"process": "edge 0"}) > started > 0
    for _ in range(6):  # fresh connections: whichever edge each lands on answers
        async with grpc.aio.insecure_channel(edged.target, options=OWN_CONNECTION) as channel:
            assert (await attention_pb2_grpc.AttentionServiceStub(channel).Encode(ids_request([1, 2]),
                                                                                  timeout=30)).outputs


async def test_an_edge_crash_loop_stops_the_service_loudly(edged: ServerProcess):
    """Last of the module's service (test_a_crashed_edge_is_restarted made the first crash): three more
    within the minute, and the model process drains and exits 1."""
    first = edge_pids(edged)
    for pid in first:  # crashes 2 and 3: restarted
        os.kill(pid, signal.SIGKILL)
    await wait_for(lambda: len(set(edge_pids(edged)) - set(first)) == 2, 30, "both edges restarted")
    os.kill(edge_pids(edged)[0], signal.SIGKILL)  # crash 4
    assert edged.proc.wait(timeout=30) == 1
    assert "4 edge crashes within 60 s; stopping the service" in edged.output()
    book = edged.exit_ledger()  # what it had served still adds up
    assert book["started"] > 0 and sum(book["handled"].values()) == book["started"], book
    await wait_for(lambda: not any(alive(pid) for pid in edge_pids(edged)), 20, "the edges to exit")


async def test_calls_spread_over_the_edges_batch_together_and_every_count_adds_up(fault_bundle: Path,
                                                                                  tmp_path: Path):
    server = ServerProcess(fault_bundle, *EDGE, "--max-batch-size", "16", directory=tmp_path)
    channels = [grpc.aio.insecure_channel(server.target, options=OWN_CONNECTION) for _ in range(12)]
    try:
        stubs = [attention_pb2_grpc.AttentionServiceStub(c) for c in channels]
        held = await hold(stubs[0], server, 15)
        calls = [stub.Encode(ids_request([1, 2, 3]), timeout=30) for stub in stubs]
        await wait_for(lambda: server.sample("attention_queue_depth") == 12, 20, "12 queued calls")
        answers = [await call for call in calls]
        await held
        metrics = {name: server.sample(name, labels) for name, labels in (
            ("attention_requests_total", {"method": "Encode", "code": "OK"}),
            ("grpc_server_handled_total", {"grpc_service": SERVICE_NAME, "grpc_code": "OK"}),
            ("grpc_server_started_total", {"grpc_service": SERVICE_NAME}),
            ("attention_sequences_total", {}), ("attention_batch_size_sum", {}))}
        # KServe statistics read every process's numbers, whichever edge answers; readiness is each edge's own.
        kserve = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]
        stats = [(await stub.ModelStatistics(v2.ModelStatisticsRequest(name="fault-model"), timeout=10)).model_stats[0]
                 for stub in kserve]
        ready = {(await stub.ServerReady(v2.ServerReadyRequest(), timeout=10)).ready for stub in kserve}
        index = {tuple((m.name, m.state) for m in (await stub.RepositoryIndex(
            v2.RepositoryIndexRequest(), timeout=10)).models) for stub in kserve}
    finally:
        for channel in channels:
            await channel.close()
        code = server.terminate()
    assert code == 0, server.output()[-3000:]
    # One batch for the 12, whichever edge each came through.
    assert [a.metadata.batch_size for a in answers] == [12] * 12
    edges = edge_ledgers(server)
    assert len(edges) == 2 and all(e["started"] > 0 for e in edges), edges  # type: ignore[operator]
    assert sum(e["started"] for e in edges) == 49  # type: ignore[misc]  # 13 Encode, 12 x 3 KServe calls
    assert metrics == dict.fromkeys(metrics, 13.0), metrics
    assert {(s.inference_count, s.execution_count, s.inference_stats.success.count, s.inference_stats.queue.count)
            for s in stats} == {(13, 2, 13, 13)}
    # The forwards are the model process's (warm-up's included); the three compute counts perf_analyzer compares.
    [(inputs, forwards, outputs)] = {(s.inference_stats.compute_input.count, s.inference_stats.compute_infer.count,
                                      s.inference_stats.compute_output.count) for s in stats}
    assert inputs == forwards == outputs >= 3, (inputs, forwards, outputs)  # the 2 batches and the warm-up's
    assert ready == {True} and index == {(("fault-model", "READY"),)}
    book = server.exit_ledger()
    assert book["started"] == 49 and book["handled"] == {"OK": 49}, book
    assert book["batched_sequences"] == 13 and book["queue_depth"] == 0, book
    assert "Traceback" not in server.output()


async def test_a_crashed_model_process_fails_calls_unavailable_and_the_edges_exit(fault_bundle: Path,
                                                                                  tmp_path: Path):
    server = ServerProcess(fault_bundle, *EDGE, directory=tmp_path)
    edges: list[int] = server.ports["edge_pids"]  # type: ignore[assignment]
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            held = await hold(stub, server, 25)
            server.proc.kill()
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await held
            assert lost.value.code() == Code.UNAVAILABLE
            assert_clean_status(lost.value)
        await wait_for(lambda: not any(alive(pid) for pid in edges), 20, "the edges to exit")
    finally:
        server.kill()
        for pid in edges:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- the frames, in one process ---------------------------------------------------------------------

def test_every_service_error_crosses_as_itself():
    from service import errors

    made = [errors.InvalidInput("sequences[0]", "too long"), errors.NonFiniteInput("embeddings", "NaN"),
            errors.Overloaded("queue full", retry_after_s=0.25), errors.ModelFailure("inference failed"),
            errors.NonFiniteOutput(), errors.DeadlineExceeded("deadline exceeded while queued"),
            errors.DeadlineUnmeetable("too short"), errors.ShuttingDown("server shutting down"),
            errors.OutOfMemory("one sequence does not fit"), errors.NotReady("loading")]
    for error in made:
        kind, call, body = _parse(frames.error(7, 3, error))
        index, back = frames.read_error(body)
        assert (kind, call, index) == (frames.ERROR, 7, 3)
        assert type(back) is type(error) and back.message == error.message == str(back)
        assert errors.status_of(back) == errors.status_of(error) and errors.reason_of(back) == errors.reason_of(error)
        for name in ("field", "description", "retry_after_s", "ref"):
            assert getattr(back, name, None) == getattr(error, name, None), name


def test_jobs_and_results_cross_bit_for_bit():
    from service.batching import Done
    from service.jobs import POOL_CLS, Job, Output

    for cls, carried in ((Job, frames.JOB_FIELDS), (Output, frames.OUTPUT_FIELDS), (Done, frames.DONE_FIELDS)):
        assert {f.name for f in dataclasses.fields(cls)} == carried, cls  # a new field must cross too
    rng = np.random.default_rng(1)
    jobs = [Job(rng.integers(0, 100, 9), None, causal=True, attn_layers=(0, 3), heads_mean=True, pooling=POOL_CLS,
                return_hidden=False, normalize=True),
            Job(None, rng.standard_normal((4, 32)).astype(np.float32)),
            Job(rng.integers(0, 100, 5), None, return_hidden=False, head="rerank",
                token_types=np.array([0, 0, 1, 1, 1], np.int64))]
    link = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=False,
                       trace_flags=TraceFlags(1))
    kind, call, body = _parse(frames.submit(11, 123.5, jobs, model=3, trace=tracing.packed(link)))
    deadline, back, model, traced = frames.read_submit(body)
    assert (kind, call, deadline, model) == (frames.SUBMIT, 11, 123.5, 3)
    crossed = tracing.unpacked(traced)  # the call's span context, which the model process's forwards link to
    assert crossed is not None and crossed.is_remote
    assert (crossed.trace_id, crossed.span_id, crossed.trace_flags) == (link.trace_id, link.span_id, 1)
    _, _, body = _parse(frames.submit(12, 1.0, jobs[:1]))  # an untraced call: zeros, read back as none
    assert tracing.unpacked(frames.read_submit(body)[3]) is None and tracing.packed(None) == bytes(25)
    for a, b in zip(jobs, back, strict=True):
        assert (a.causal, a.attn_layers, a.heads_mean, a.pooling, a.return_hidden, a.normalize, a.head) == (
            b.causal, b.attn_layers, b.heads_mean, b.pooling, b.return_hidden, b.normalize, b.head)
        for x, y in ((a.token_ids, b.token_ids), (a.embeddings, b.embeddings), (a.token_types, b.token_types)):
            assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y) and y.flags.writeable)
    out = Output(rng.standard_normal((9, 32)).astype(np.float32), None,
                 rng.standard_normal((2, 1, 9, 9)).astype(np.float32), True, np.array([0.5, -2.0], np.float32))
    kind, call, body = _parse(frames.result(11, 1, Done(out, 0.01, 0.02, 5, 9)))
    index, done = frames.read_result(body)
    assert (kind, call, index, done.queue_s, done.compute_s, done.batch_size, done.padded_length) == (
        frames.RESULT, 11, 1, 0.01, 0.02, 5, 9)
    assert done.output.pooled is None and done.output.fp32_rerun
    assert done.output.hidden.tobytes() == out.hidden.tobytes() and done.output.attention.shape == (2, 1, 9, 9)
    assert done.output.scores is not None and done.output.scores.tolist() == [0.5, -2.0]


async def test_a_frame_over_its_bound_or_of_no_kind_is_refused():
    for data in (frames.HEADER.pack(1001, frames.SUBMIT, 1) + bytes(1001), frames.HEADER.pack(0, 99, 1)):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        with pytest.raises(frames.FrameError):
            await frames.read_frame(reader, 1000)


def _parse(data: bytes) -> tuple[int, int, memoryview]:
    length, kind, call = frames.HEADER.unpack_from(data)
    assert length == len(data) - frames.HEADER.size
    return kind, call, memoryview(data)[frames.HEADER.size:]
