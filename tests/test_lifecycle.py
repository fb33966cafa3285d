"""`python -m service` as a real process: ready file, SIGTERM drain (NOT_SERVING, in-flight calls
finish, new calls refused), exit code 0, and configuration errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.tensors import from_tensor
from model import faults
from proto.attention.v1 import attention_pb2_grpc
from service.servicer import SERVICE_NAME
from tests.conftest import ids_request


def start_process(bundle: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    ready, log = tmp_path / "ready.json", tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", "0", "--metrics-port", "0", "--model", str(bundle),
             "--ready-file", str(ready), *flags],
            cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"server did not become ready: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


async def test_sigterm_drains_in_flight_calls_and_exits_zero(fault_bundle: Path, tmp_path: Path):
    proc, ports = start_process(fault_bundle, tmp_path, "--drain-delay-s", "0.5", "--drain-grace-s", "5")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            ready = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert ready.status == health_pb2.HealthCheckResponse.SERVING
            in_flight = asyncio.ensure_future(stub.Encode(ids_request([faults.SLEEP, 4, 5]), timeout=30))
            await asyncio.sleep(0.05)
            os.kill(proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.1)
            status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            response = await in_flight
            assert from_tensor(response.outputs[0].hidden).shape == (3, 32)
            assert np.isfinite(from_tensor(response.outputs[0].hidden)).all()
            await asyncio.sleep(0.6)  # past the drain delay: new calls are refused
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(ids_request([1, 2]), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_configuration_exits_2_naming_the_value():
    result = subprocess.run([sys.executable, "-m", "service", "--max-batch-size", "0"], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2
    assert "max_batch_size must be >= 1; got 0" in result.stderr


def test_help_documents_every_setting_with_its_environment_variable():
    from dataclasses import fields

    from service.config import ServiceConfig

    result = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[1], env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for f in fields(ServiceConfig):
        assert f"ATTN_{f.name.upper()}" in result.stdout, f.name


def test_readme_documents_every_setting():
    from dataclasses import fields

    from service.config import ServiceConfig

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for f in fields(ServiceConfig):
        assert f"`ATTN_{f.name.upper()}`" in readme, f"README's configuration table lacks ATTN_{f.name.upper()}"
