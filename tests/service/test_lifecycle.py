"""`python -m service` as a real process: ready file, SIGTERM drain (NOT_SERVING, in-flight calls
finish, new calls refused), exit code 0, and configuration errors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from model import faults
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from tests.support.helpers import health, ids_request, test_config, wait_for
from tests.support.server_process import ServerProcess


@pytest.mark.parametrize("mode", [(), ("--edge-processes", "2")], ids=["one-process", "edge-processes"])
async def test_sigterm_drains_in_flight_calls_and_exits_zero(fault_bundle: Path, tmp_path: Path, mode: tuple[str, ...]):
    server = ServerProcess(fault_bundle, "--drain-delay-s", "0.5", "--drain-grace-s", "5", *mode, directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
            in_flight = asyncio.ensure_future(stub.Encode(ids_request([faults.SLEEP, 4, 5]), timeout=30))
            await wait_for(lambda: server.started() == 1, 10, "the call to reach the server")
            os.kill(server.pid, signal.SIGTERM)

            async def not_serving() -> None:
                while await health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(not_serving(), 5)  # at once, while the drain delay keeps serving
            response = await in_flight
            assert from_tensor(response.outputs[0].hidden).shape == (3, 32)
            assert np.isfinite(from_tensor(response.outputs[0].hidden)).all()

            async def refused() -> grpc.aio.AioRpcError:  # once the drain delay has passed
                while True:
                    try:
                        await stub.Encode(ids_request([1, 2]), timeout=5)
                    except grpc.aio.AioRpcError as error:
                        return error
                    await asyncio.sleep(0.02)

            # Ours, before the gRPC server stops (service/process.py REFUSING_S): a call that reached
            # grpcio's core only as it stopped would be CANCELLED, and one after it connection-refused.
            error = await asyncio.wait_for(refused(), 10)
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (error.details() or ""), error
        # A cap for a hang only: how long the drain took is the service's own account (its log; the
        # shutdown tests in tests/reliability check it), and exiting a torch process on a busy machine is slow.
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()


def test_bad_configuration_exits_2_naming_the_value():
    result = subprocess.run([sys.executable, "-m", "service", "--max-batch-size", "0"], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2
    assert "max_batch_size must be >= 1; got 0" in result.stderr


def test_help_documents_every_setting_with_its_environment_variable():
    from dataclasses import fields

    from service.config import ServiceConfig

    result = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for f in fields(ServiceConfig):
        assert f"ATTN_{f.name.upper()}" in result.stdout, f.name


def test_the_configuration_chapter_documents_every_setting():
    from dataclasses import fields

    from service.config import ServiceConfig

    chapter = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for f in fields(ServiceConfig):
        assert f"`ATTN_{f.name.upper()}`" in chapter, f"docs/configuration.md lacks ATTN_{f.name.upper()}"


@pytest.mark.parametrize("second, echoes, stops", [(signal.SIGTERM, True, [None]), (signal.SIGINT, True, [None, 0]),
                                                   (signal.SIGTERM, False, [None, 0])],
                         ids=["under-make-SIGTERM-again-is-the-echo", "SIGINT-stops-at-once",
                              "elsewhere-SIGTERM-again-stops-at-once"])
async def test_a_sigterm_delivered_twice_at_once_is_one_request(tiny_bundle: Path, second: int, echoes: bool,
                                                                stops: list[float | None]):
    """Issue 27: a supervisor's SIGTERM to `make run`'s process group reaches the service twice (the
    group's, and make's forward). The drain goes on; a second, different signal still stops at once,
    and so does a second SIGTERM under a parent that forwards nothing."""
    from service.process import drain_on_signal

    asked: list[float | None] = []
    release = asyncio.Event()

    async def stop(grace: float | None) -> None:
        asked.append(grace)
        if grace is None:
            await release.wait()  # a drain that is still under way when the second signal is read

    signals: asyncio.Queue[int] = asyncio.Queue()
    signals.put_nowait(signal.SIGTERM)
    signals.put_nowait(second)  # both already delivered when the drain starts
    draining = asyncio.create_task(drain_on_signal(asyncio.create_task(signals.get()), signals,
                                                   test_config(tiny_bundle), stop, echoes))
    await wait_for(lambda: signals.empty() and len(asked) >= len(stops), 10, "both signals read")
    for _ in range(3):
        await asyncio.sleep(0)  # a second stop, if one were coming, is asked now
    release.set()
    await asyncio.wait_for(draining, 10)
    assert asked == stops
