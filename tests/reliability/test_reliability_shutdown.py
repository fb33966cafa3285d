"""Shutdown under load, in a real `python -m service` process (RELIABILITY.md S-01..S-03, row 30).

SIGTERM: readiness NOT_SERVING at once, new calls refused, queued and in-flight calls finished or
answered UNAVAILABLE "shutting down" within the grace period, exit 0, and the server's exit ledger
balances against what the callers saw. Nothing is left without an answer.

Bounds come from events, not from this test's clock, so a busy machine cannot fail them: "at once" is
NOT_SERVING read while the drain still has calls to answer; "within the grace" is work that would take
longer than the grace (200 ms sleeps, a 30 s hang) answered "shutting down", and the drain's length as
the service's own log timestamps tell it (signal ... draining -> stopped; ledger) within what
service/server.py and service/multiproc/host.py allow it: the grace, plus STOP_SLACK_S for what follows
it (one process: the batcher's margin and closing the ports; edge processes: up to 0.25 s + 1 s for the
edges to exit and 2 s more after killing a late one). The clock caps left (HANG_CAP_S) only turn a hang
into a failure; they are far above anything a correct run takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from client import EncoderClient
from client.errors import ClientError
from model import faults
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from tests.support.helpers import health, ids_request, wait_for
from tests.support.reliability_helpers import assert_clean_status
from tests.support.server_process import ROOT, ServerProcess

Code = grpc.StatusCode
# One process, and the same service as a model process behind two edge processes (service/multiproc/).
MODES = pytest.mark.parametrize("mode", [(), ("--edge-processes", "2")], ids=["one-process", "edge-processes"])
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOP_SLACK_S = {(): 1.5, ("--edge-processes", "2"): 3.5}  # the service's bound past its grace, by mode
HANG_CAP_S = 25.0  # under faults.HANG's 30 s: a drain that waited for a hung forward fails


async def outcomes_of(calls: list[grpc.aio.UnaryUnaryCall], bound: float) -> list[tuple[Code, object]]:
    """Each call's terminal status; fails if any is still pending after `bound` seconds."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    _, pending = await asyncio.wait(tasks, timeout=bound)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} calls left without an answer"
    results: list[tuple[Code, object]] = []
    for task in tasks:
        error = task.exception()
        if error is None:
            results.append((Code.OK, task.result()))
        else:
            assert isinstance(error, grpc.aio.AioRpcError), repr(error)
            assert_clean_status(error)
            results.append((error.code(), error))
    return results


async def not_serving_after_sigterm(server: ServerProcess, probe: grpc.aio.Channel) -> None:
    """Send SIGTERM; return once readiness reads NOT_SERVING on the plaintext health port (the process
    must still be running then: a readiness that only ends with the process is no drain)."""
    sent = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    while await health(probe, timeout=HANG_CAP_S) != NOT_SERVING:
        assert server.proc.poll() is None, "the process exited before readiness read NOT_SERVING"
        assert time.monotonic() - sent < HANG_CAP_S, f"readiness still SERVING {HANG_CAP_S:.0f} s after SIGTERM"
        await asyncio.sleep(0.005)


@MODES
async def test_sigterm_under_load_answers_every_call_and_exits_zero_in_time(fault_bundle: Path, tmp_path: Path,
                                                                           reference_model, mode: tuple[str, ...]):
    grace = 3.0
    server = ServerProcess(fault_bundle, "--drain-grace-s", str(grace), "--max-batch-size", "4",
                           "--health-port", "0", "--log-level", "info", *mode, directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['health_port']}") as probe:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            # 30 calls of 200 ms model time each, four to a batch: ~6 s of work for a 3 s grace.
            seqs = [np.array([faults.SLEEP, i + 1, i + 2]) for i in range(30)]
            calls = [stub.Encode(ids_request(ids), timeout=30) for ids in seqs]
            await wait_for(lambda: server.started() == 30, 20, "all 30 calls to start on the server")

            await not_serving_after_sigterm(server, probe)
            # At once: NOT_SERVING while the drain still has work (6 s of it, cut by the 3 s grace).
            assert sum(not c.done() for c in calls) > 0, "readiness changed only once every call was answered"
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # a new call, on the open connection
                await stub.Encode(ids_request([1, 2]), timeout=5)
            assert refused.value.code() == Code.UNAVAILABLE
            assert_clean_status(refused.value)
            async with grpc.aio.insecure_channel(server.target) as fresh:  # and on a new one
                with pytest.raises(grpc.aio.AioRpcError) as refused_new:
                    await attention_pb2_grpc.AttentionServiceStub(fresh).Encode(ids_request([1, 2]), timeout=5)
                assert refused_new.value.code() == Code.UNAVAILABLE

            results = await outcomes_of(calls, HANG_CAP_S)
        code = server.proc.wait(timeout=HANG_CAP_S)
    finally:
        server.kill()

    assert code == 0, server.output()[-3000:]
    # Within the grace: the service's own account of its drain (the UNAVAILABLE answers below show that
    # the grace, not the 6 s of work, ended it).
    assert server.drained_in() <= grace + STOP_SLACK_S[mode], (server.drained_in(), server.output()[-3000:])
    seen: dict[str, int] = {}
    for (status, outcome), ids in zip(results, seqs, strict=True):
        seen[status.name] = seen.get(status.name, 0) + 1
        assert status in (Code.OK, Code.UNAVAILABLE), status
        if status == Code.UNAVAILABLE:  # our answer, not grpcio's "Cancelling all calls"
            assert "shutting down" in outcome.details(), outcome.details()  # type: ignore[attr-defined]
        else:
            hidden = from_tensor(outcome.outputs[0].hidden)  # type: ignore[attr-defined]
            np.testing.assert_allclose(hidden, reference_model(ids)[0], atol=1e-5, rtol=0)
    assert seen.get("OK", 0) >= 4 and seen.get("UNAVAILABLE", 0) >= 4, seen  # some finished, some did not

    book = server.exit_ledger()
    late = book["started"] - 30  # refused calls that still reached a handler (answered UNAVAILABLE)
    assert 0 <= late <= 2, book
    assert sum(book["handled"].values()) == book["started"], book
    assert book["handled"].get("OK", 0) == seen["OK"], book
    assert book["handled"].get("UNAVAILABLE", 0) == seen["UNAVAILABLE"] + late, book
    assert book["queue_depth"] == 0, book
    assert book["batched_sequences"] + sum(book["dropped"].values()) == 30, book  # admitted = batched + dropped
    assert "Traceback" not in server.output()


@MODES
async def test_a_call_longer_than_grace_is_answered_and_exit_is_still_on_time(fault_bundle: Path, tmp_path: Path,
                                                                             mode: tuple[str, ...]):
    """S-02: the model hangs (30 s) past a 1 s grace: the caller gets UNAVAILABLE "shutting down"
    before the grace ends and the process exits 0 by grace + 1 s anyway."""
    grace = 1.0
    server = ServerProcess(fault_bundle, "--drain-grace-s", str(grace), "--health-port", "0", *mode,
                           directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['health_port']}") as probe:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            hung = stub.Encode(ids_request([faults.HANG, 1]), timeout=60)
            await wait_for(lambda: server.sample("attention_batch_size_count") == 1, 20, "the hung forward")
            queued = stub.Encode(ids_request([1, 2]), timeout=60)
            await wait_for(lambda: server.started() == 2, 20, "the queued call to start")
            await not_serving_after_sigterm(server, probe)
            results = await outcomes_of([hung, queued], HANG_CAP_S)  # the hang lasts 30 s
        code = server.proc.wait(timeout=HANG_CAP_S)
    finally:
        server.kill()
    assert code == 0, server.output()[-3000:]
    assert [s for s, _ in results] == [Code.UNAVAILABLE, Code.UNAVAILABLE]
    assert all("shutting down" in o.details() for _, o in results)  # type: ignore[attr-defined]
    assert server.drained_in() <= grace + STOP_SLACK_S[mode], (server.drained_in(), server.output()[-3000:])
    book = server.exit_ledger()
    assert book["handled"] == {"UNAVAILABLE": 2} and book["started"] == 2, book
    assert book["batched_sequences"] + sum(book["dropped"].values()) == 2, book


@MODES
async def test_a_second_signal_stops_at_once(fault_bundle: Path, tmp_path: Path, mode: tuple[str, ...]):
    """S-03: during a long drain (10 s grace, a hung model) a second SIGTERM exits promptly, cleanly."""
    server = ServerProcess(fault_bundle, "--drain-grace-s", "10", "--health-port", "0", *mode, directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['health_port']}") as probe:
            hung = attention_pb2_grpc.AttentionServiceStub(channel).Encode(ids_request([faults.HANG]), timeout=60)
            await wait_for(lambda: server.started() == 1, 20, "the call to start")
            await not_serving_after_sigterm(server, probe)
            server.proc.send_signal(signal.SIGTERM)
            [(status, _)] = await outcomes_of([hung], HANG_CAP_S)
        code = server.proc.wait(timeout=HANG_CAP_S)
    finally:
        server.kill()
    assert code == 0, (code, server.output()[-3000:])
    assert status == Code.UNAVAILABLE
    assert "second signal" in server.output() and "Traceback" not in server.output()
    # At once, by the service's log: stopped well inside the 10 s grace (the hang lasts 30 s), within the
    # stop(0) path's own bound of the second signal.
    assert server.drained_in() < 10, (server.drained_in(), server.output()[-3000:])
    assert server.drained_in("second signal") <= STOP_SLACK_S[mode], server.output()[-3000:]


async def test_make_run_stopped_by_a_signal_to_its_process_group_drains(fault_bundle: Path, tmp_path: Path):
    """Issue 27: a supervisor stops `make run` with SIGTERM to its process group; make forwards SIGTERM
    to the service as well, which took the two for "a second signal" and stopped at once."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    ready = tmp_path / "ready.json"
    env = {**os.environ, "ATTN_HOST": "127.0.0.1", "ATTN_PORT": "0", "ATTN_METRICS_PORT": "0",
           "ATTN_MODEL": str(fault_bundle), "ATTN_READY_FILE": str(ready), "ATTN_DRAIN_GRACE_S": "30"}
    # The repository's own `run` recipe; BIN and STAMP overridden: this interpreter, no venv build.
    with open(tmp_path / "make.log", "wb") as log:
        group = subprocess.Popen([make, "--no-print-directory", "-C", str(ROOT), "run",
                                  f"BIN={Path(sys.executable).parent}", "STAMP=", "RUN_STAMP="],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await wait_for(lambda: ready.exists() or group.poll() is not None, 120, "the service to be ready")
        ports = json.loads(ready.read_text())

        def batches() -> float:
            url = f"http://127.0.0.1:{ports['metrics_port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                lines = response.read().decode().splitlines()
            return sum(float(line.split()[-1]) for line in lines if line.startswith("attention_batch_size_count"))

        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as channel:
            before = batches()
            held = attention_pb2_grpc.AttentionServiceStub(channel).Encode(ids_request([faults.SLEEP] * 10), timeout=60)
            await wait_for(lambda: batches() > before, 30, "the held call's forward")  # 2 s of model time
            os.killpg(group.pid, signal.SIGTERM)  # the supervisor: the whole group
            [(status, _)] = await outcomes_of([held], 45)
        group.wait(timeout=45)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)
        group.wait(timeout=10)
    output = (tmp_path / "make.log").read_text()
    assert status == Code.OK, output[-3000:]  # drained: the accepted call was answered
    assert "second signal" not in output and "stopped; ledger" in output, output[-3000:]


@MODES
async def test_calls_racing_the_drain_end_are_never_cancelled_for_the_client(fault_bundle: Path, tmp_path: Path,
                                                                            mode: tuple[str, ...]):
    """Issue 27: a call that reaches a draining server in the instant its gRPC server stops is one grpcio's
    core has not handed to any handler yet; the core cancels it (the caller sees CANCELLED, the server's
    ledger never counts it: it never ran). Encode is a pure function, so the client library's default retry
    policy retries such a CANCELLED (grpc never retries a call its caller cancelled), as Envoy's route does
    (deploy/envoy/envoy.yaml): callers of the library see OK or UNAVAILABLE, never CANCELLED. 24 callers
    keep calling through the whole drain (bounded: 3,000 calls each, 60 s), on one channel."""
    server = ServerProcess(fault_bundle, "--drain-grace-s", "1", "--drain-delay-s", "0.3", "--log-level", "info",
                           *mode, directory=tmp_path)
    seen: dict[str, int] = {}
    try:
        async with EncoderClient(server.target, timeout=10) as client:
            end = time.monotonic() + 60

            async def caller() -> None:
                for _ in range(3000):
                    if time.monotonic() > end:
                        return
                    try:
                        await client.encode([np.array([1, 2, 3])])
                        seen["OK"] = seen.get("OK", 0) + 1
                    except ClientError as error:
                        seen[error.code] = seen.get(error.code, 0) + 1
                        if server.proc.poll() is not None:
                            return

            callers = [asyncio.create_task(caller()) for _ in range(24)]
            await wait_for(lambda: seen.get("OK", 0) >= 200, 30, "the callers to get going")
            os.kill(server.proc.pid, signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*callers), 90)
        code = server.proc.wait(timeout=HANG_CAP_S)
    finally:
        server.kill()
    assert code == 0, server.output()[-3000:]
    assert set(seen) <= {"OK", "UNAVAILABLE"}, seen
    book = server.exit_ledger()
    assert sum(book["handled"].values()) == book["started"] and "CANCELLED" not in book["handled"], book


@MODES
async def test_raw_stubs_through_the_drain_get_unavailable_and_cancelled_only_for_calls_never_run(
        fault_bundle: Path, tmp_path: Path, mode: tuple[str, ...]):
    """Issue 39: raw grpc stubs (no retry policy) calling through a drain. grpcio's core cancels every call
    it holds without a handler when its server stops, and the caller sees CANCELLED (grpc/grpc#41785), so
    the gRPC server refuses new calls UNAVAILABLE "shutting down" for a moment before it stops
    (service/process.py REFUSING_S). A caller that moves on at its first refusal, as the status table tells it to,
    has nothing in flight by then and ends with UNAVAILABLE (without the pause 9-14 of 16 such callers saw
    CANCELLED at load 8 on 2 cores). A caller that keeps calling after "shutting down" can get CANCELLED,
    but only for a call the service never ran: the server's ledger counts exactly the OKs and the
    "shutting down" answers the callers saw. 16 callers of each kind on 8 channels (bounded: 40 s)."""
    server = ServerProcess(fault_bundle, "--drain-delay-s", "0.3", "--drain-grace-s", "2", "--log-level", "info",
                           *mode, directory=tmp_path)
    seen: dict[str, int] = {}
    first_refusals: list[str] = []  # the polite callers'
    channels = [grpc.aio.insecure_channel(server.target) for _ in range(8)]
    try:
        stubs = [attention_pb2_grpc.AttentionServiceStub(channel) for channel in channels]
        end = time.monotonic() + 40

        async def caller(i: int, polite: bool) -> None:
            while time.monotonic() < end and server.proc.poll() is None:
                try:
                    await stubs[i % len(stubs)].Encode(ids_request([1, 2, 3]), timeout=10)
                    outcome = "OK"
                except grpc.aio.AioRpcError as error:
                    assert_clean_status(error)
                    assert error.code() in (Code.UNAVAILABLE, Code.CANCELLED), error
                    # Ours ("server shutting down"), or grpcio's (connection refused once the listener closed).
                    ours = error.code() == Code.UNAVAILABLE and "shutting down" in (error.details() or "")
                    outcome = error.code().name + (" shutting down" if ours else "")
                seen[outcome] = seen.get(outcome, 0) + 1
                if outcome != "OK" and polite:
                    first_refusals.append(outcome)
                    return
                if outcome == "UNAVAILABLE":  # the listener is closed: the drain is over for this caller
                    return

        callers = [asyncio.create_task(caller(i, polite)) for i in range(16) for polite in (True, False)]
        await wait_for(lambda: seen.get("OK", 0) >= 100, 30, "the callers to get going")
        os.kill(server.pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*callers), 60)
        code = server.proc.wait(timeout=HANG_CAP_S)
    finally:
        for channel in channels:
            await channel.close()
        server.kill()
    assert code == 0, server.output()[-3000:]
    assert len(first_refusals) == 16 and {r.split()[0] for r in first_refusals} == {"UNAVAILABLE"}, (
        first_refusals, seen)
    book = server.exit_ledger()
    assert sum(book["handled"].values()) == book["started"], book
    assert book["handled"] == {"OK": seen["OK"], "UNAVAILABLE": seen.get("UNAVAILABLE shutting down", 0)}, (
        book, seen)  # every call the service ran is one the callers saw answered: no CANCELLED among them
