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
from tests.support.helpers import health, ids_request, wait_for
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

            async def refused() -> grpc.StatusCode:  # once the drain delay has passed
                while True:
                    try:
                        await stub.Encode(ids_request([1, 2]), timeout=5)
                    except grpc.aio.AioRpcError as error:
                        return error.code()
                    await asyncio.sleep(0.02)

            assert await asyncio.wait_for(refused(), 10) == grpc.StatusCode.UNAVAILABLE
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


def test_readme_documents_every_setting():
    from dataclasses import fields

    from service.config import ServiceConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for f in fields(ServiceConfig):
        assert f"`ATTN_{f.name.upper()}`" in readme, f"README's configuration table lacks ATTN_{f.name.upper()}"
