"""What the tests share besides fixtures (those are in conftest.py): the running-server handle and the
tests' server config, request builders, one health check, one rich-status reader, one free port, one
bounded wait, and a function-backed runner for the batcher's tests."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import SERVICE_NAME, to_tensor
from service.config import ServiceConfig
from service.device import default_threads, default_workers
from service.doors.attention_wire import NAMES, encode_ask, response_bytes
from service.jobs import ModelSpec
from service.plan import Plan, plan
from service.server import Server


@dataclass
class Running:
    server: Server
    port: int
    channel: grpc.aio.Channel
    stub: attention_pb2_grpc.AttentionServiceStub
    registry: CollectorRegistry

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The sample named `name` with exactly `labels`, summed over the `model` label (one per model served)
        unless `labels` gives it."""
        want = labels or {}
        return sum(s.value for family in self.registry.collect() for s in family.samples
                   if s.name == name and {k: v for k, v in s.labels.items() if k != "model" or "model" in want} == want)


def test_config(bundle: Path, **overrides: Any) -> ServiceConfig:
    """The tests' server config. The device is pinned to cpu (fp32), so the suite compares the same things on
    a machine with a GPU; CUDA is what tests/gpu/test_gpu.py asks for by overriding it. The model workers are
    the device's default, configured, so a test's split is not a warm-up measurement's choice (a test asks
    for model_workers=0 to measure it). The heap is not frozen at SERVING (`gc_freeze`): a test process starts
    many servers, and a freeze would keep the cycles of every server still alive then for the rest of its life
    (`python -m service`, one server a process, freezes)."""
    device, threads = str(overrides.get("device", "cpu")), int(overrides.get("torch_threads") or default_threads())
    base = ServiceConfig(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, model=str(bundle), device=device,
                         precision="fp32", max_batch_tokens=2048, drain_grace_s=2.0,
                         model_workers=default_workers(device, threads), gc_freeze=False)
    return dataclasses.replace(base, **overrides)


test_config.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test, despite its name


def ids_request(*sequences: np.ndarray, **fields: Any) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(np.asarray(s, np.int64))) for s in sequences],
                            **fields)


async def health(channel: grpc.aio.Channel, service: str = SERVICE_NAME, timeout: float = 5) -> int:
    """grpc.health.v1 Check of `service` ("" = the process) on `channel`."""
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return int(response.status)


def plan_request(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig) -> Plan:
    """An EncodeRequest's plan, on the calling thread: what Encode plans before it runs."""
    return plan(encode_ask(request, spec, config), spec, config, NAMES, response_bytes)


def rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The `google.rpc.Status` a failed call carries in its trailers, if any."""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    return None


def details_of(error: grpc.RpcError) -> list[Any]:
    """The rich status's details (packed Any messages); empty without one."""
    status = rich_status(error)
    return list(status.details) if status is not None else []


def violated_field(error: grpc.RpcError) -> str:
    """The field of the BadRequest detail an INVALID_ARGUMENT carries."""
    for detail in details_of(error):
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return str(bad.field_violations[0].field)
    raise AssertionError(f"no BadRequest detail in {error!r}")


def free_port() -> int:
    """A port that was free a moment ago (for programs that cannot bind port 0; callers retry on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition",
                   poll: float = 0.01) -> None:
    """Wait until `predicate()` holds, polling every `poll` seconds, at most `timeout` seconds (then fail
    naming `what`). A predicate that scrapes a server's /metrics wants a slower poll: back-to-back scrapes
    of a service with edge processes (prometheus_client's multiprocess files, summed per scrape) kept its
    model process too busy to act on a cancellation for 20 s."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(poll)


class FunctionRunner:
    """A `BatchRunner` (service/batching/types.py) over a plain `execute(payloads)` function, never
    pipelined; `set_wide` is handed on when given."""

    pipelined = False

    def __init__(self, execute: Callable[[list[Any]], tuple[Sequence[Any], float]],
                 set_wide: Callable[[bool], None] | None = None) -> None:
        self.execute = execute
        self._set_wide = set_wide

    def set_wide(self, wide: bool) -> None:
        if self._set_wide is not None:
            self._set_wide(wide)

    def launch(self, payloads: list[Any]) -> Any:
        raise AssertionError("a FunctionRunner is never pipelined")

    def finish(self, in_flight: Any) -> tuple[Sequence[Any], float]:
        raise AssertionError("a FunctionRunner is never pipelined")
