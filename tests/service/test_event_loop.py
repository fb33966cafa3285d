"""The event loop a serving process runs on (service/event_loop.py, `--event-loop`): uvloop where installed
(auto), the standard library's when asked or when uvloop cannot be imported, the choice logged; both serve
gRPC and HTTP and drain on SIGTERM, in one process and in edge processes. The in-process tests run on the
standard loop (pytest-asyncio's), every `python -m service` of the suite on auto."""

from __future__ import annotations

import asyncio
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import uvloop

from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from service import event_loop
from service.config import ServiceConfig
from tests.support.helpers import ids_request
from tests.support.server_process import LEDGER_LINE, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
# A process in which `import uvloop` fails, as where it is not installed (None in sys.modules blocks an import).
WITHOUT_UVLOOP = "import sys; sys.modules['uvloop'] = None\n"


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_run_runs_on_the_loop_it_names_and_auto_takes_uvloop_where_installed() -> None:
    assert event_loop.resolve("auto") == "uvloop"
    assert event_loop.run(_loop_type(), "auto") is uvloop.Loop
    assert event_loop.run(_loop_type(), "uvloop") is uvloop.Loop
    asyncio_loop = event_loop.run(_loop_type(), "asyncio")
    assert not issubclass(asyncio_loop, uvloop.Loop) and issubclass(asyncio_loop, asyncio.BaseEventLoop)
    with pytest.raises(ValueError, match="event_loop must be one of auto|uvloop|asyncio; got 'libuv'"):
        ServiceConfig(event_loop="libuv")


def test_without_uvloop_auto_falls_back_and_asking_for_it_is_a_configuration_error() -> None:
    program = (WITHOUT_UVLOOP + "import asyncio\nfrom service import event_loop\n"
               "async def kind():\n    return type(asyncio.get_running_loop()).__module__\n"
               "print(event_loop.resolve('auto'), event_loop.run(kind(), 'auto'))\n"
               "from service.__main__ import main\nsys.exit(main(['--event-loop', 'uvloop']))")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["asyncio", "asyncio.unix_events"]
    assert result.returncode == 2
    assert "event_loop uvloop: uvloop is not installed" in result.stderr


UVLOOP_AUTO = f"uvloop {importlib.metadata.version('uvloop')} (auto)"


@pytest.mark.parametrize(("flags", "loops"), [
    (("--event-loop", "asyncio"), ["asyncio (configured)"]),
    ((), [UVLOOP_AUTO]),
    (("--edge-processes", "1"), [UVLOOP_AUTO, UVLOOP_AUTO]),  # the model process's and the edge's
], ids=["asyncio", "auto", "auto-edge-processes"])
async def test_the_served_process_runs_on_the_chosen_loop_answers_both_doors_and_drains(
        tiny_bundle: Path, flags: tuple[str, ...], loops: list[str]) -> None:
    server = ServerProcess(tiny_bundle, *flags)
    try:
        logged = [line.split("event loop: ", 1)[1] for line in server.output().splitlines() if "event loop: " in line]
        assert logged == loops
        async with grpc.aio.insecure_channel(server.target) as channel:
            response = await attention_pb2_grpc.AttentionServiceStub(channel).Encode(
                ids_request(np.array([1, 2, 3])), timeout=30)
        assert from_tensor(response.outputs[0].hidden).shape[0] == 3
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports['http_port']}",
                                     trust_env=False, timeout=30) as http:
            answer = await http.post("/embed", json={"inputs": [[1, 2, 3]]})
        assert answer.status_code == 200 and np.isfinite(answer.json()).all()
        assert server.terminate() == 0
        assert LEDGER_LINE in server.output()
    finally:
        server.stop()
