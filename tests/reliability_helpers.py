"""Shared pieces of the reliability, security and soak tests (RELIABILITY.md 4.0).

- `assert_clean_status`: the error-hygiene rule, applied to every non-OK status these tests see.
- `Admissions`: counts the sequences the batcher admitted, for the ledger (admitted = batched + dropped).
- `assert_ledger_balanced`: every started call handled, queue empty, model idle, admissions accounted.
- `ServerProcess`: `python -m service` as a subprocess (ready file, metrics scrape, SIGTERM).
- `fault_state`: resets model/faults.py's process-wide state and releases hung forwards after a test.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from model import faults
from service.batcher import Item
from service.server import ledger
from service.servicer import SERVICE_NAME
from tests.conftest import Running

REPO = Path(__file__).resolve().parents[1]

# Words that must never reach a caller: tracebacks, Python reprs, credentials.
FORBIDDEN = ("Traceback", "<class", "token=", "Bearer", "bearer", "File \"")
PATH = re.compile(r"(^|[\s'\"(=:,])(/[\w.-]+){2,}")  # /opt/x, /home/u/model.pt ...
PRINTABLE = re.compile(r"[\x20-\x7e]{1,300}")


def assert_clean_status(error: grpc.RpcError, *, secrets: Sequence[str] = ()) -> None:
    """RELIABILITY.md 4.0: not UNKNOWN; details printable ASCII, 1..300 chars, without tracebacks,
    paths, reprs, credentials or request content (`secrets`); the rich status, when sent, decodes and
    agrees with the plain one."""
    code = error.code()  # type: ignore[attr-defined]
    details = error.details() or ""  # type: ignore[attr-defined]
    assert code != grpc.StatusCode.UNKNOWN, details
    assert PRINTABLE.fullmatch(details), f"details not 1..300 printable ASCII chars: {details!r}"
    for word in FORBIDDEN:
        assert word not in details, f"{word!r} in {details!r}"
    assert not PATH.search(details), f"a path in {details!r}"
    for secret in secrets:
        assert secret not in details, f"request content {secret!r} in {details!r}"
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            rich = status_pb2.Status.FromString(value)
            assert rich.code == code.value[0] and rich.message == details, (rich, code, details)


def details_of(error: grpc.RpcError) -> list[Any]:
    """The `google.rpc.Status` details (packed Any messages) a status carries."""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            return list(status_pb2.Status.FromString(value).details)
    return []


async def health(channel: grpc.aio.Channel, service: str = SERVICE_NAME, timeout: float = 5) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return int(response.status)


class Admissions:
    """Wraps `server.batcher.submit` (the real one still runs) to count admitted calls and sequences.
    With `keep_items`, keeps each call's items (and so their results: not for long runs), so that a
    test can play "our own code cancelled a future"."""

    def __init__(self, running: Running, *, keep_items: bool = False) -> None:
        self.calls = 0
        self.sequences = 0
        self.items: list[list[Item[Any]]] = []
        batcher = running.server.batcher
        real = batcher.submit

        def submit(requests: Any, deadline: float) -> list[Item[Any]]:
            items = real(requests, deadline)  # raises Overloaded/ShuttingDown: not admitted
            self.calls += 1
            self.sequences += len(items)
            if keep_items:
                self.items.append(items)
            return items

        batcher.submit = submit  # type: ignore[method-assign]


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


def service_ledger(running: Running) -> dict[str, Any]:
    return ledger(running.registry)


async def assert_ledger_balanced(running: Running, admissions: Admissions | None = None,
                                 timeout: float = 10.0) -> dict[str, Any]:
    """Every started AttentionService call was handled; the queue is empty and the model idle; and
    every admitted sequence either rode in a batch or was dropped (by reason)."""

    def settled() -> bool:
        book = service_ledger(running)
        return running.server.batcher.idle and book["started"] == sum(book["handled"].values())

    await wait_for(settled, timeout, "the ledger to settle")
    book = service_ledger(running)
    assert book["queue_depth"] == 0, book
    assert running.sample("attention_queue_tokens") == 0, book
    assert "UNKNOWN" not in book["handled"], book
    if admissions is not None:
        dropped = sum(book["dropped"].values())
        assert admissions.sequences == book["batched_sequences"] + dropped, (admissions.sequences, book)
    return book


def batches(running: Running) -> float:
    return running.sample("attention_batch_size_count")


@pytest.fixture
def fault_state() -> Iterator[Any]:
    """model/faults.py's process-wide state, fresh for the test; hung forwards released afterwards."""
    faults.reset()
    yield faults
    faults.HANG_RELEASE.set()
    faults.LEAKED.clear()


# -- a subprocess server ---------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    log: Path
    stopped_in: float | None = field(default=None)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports['port']}"

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples named `name` whose labels include `labels`."""
        want = set((labels or {}).items())
        return sum(v for (n, ls), v in scrape(self.ports["metrics_port"]).items() if n == name and want <= ls)

    def started(self) -> float:
        return self.sample("grpc_server_started_total", {"grpc_service": SERVICE_NAME})

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; records how long the exit took."""
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self.stopped_in = time.monotonic() - sent
        return code

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def exit_ledger(self) -> dict[str, Any]:
        lines = [line for line in self.output().splitlines() if "stopped; ledger " in line]
        assert lines, f"no ledger line in the server log:\n{self.output()[-3000:]}"
        result: dict[str, Any] = json.loads(lines[-1].split("stopped; ledger ", 1)[1])
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start_process(bundle: Path, directory: Path, *flags: str, env: dict[str, str] | None = None,
                  timeout: float = 90.0) -> ServerProcess:
    """`python -m service` on 127.0.0.1:0 (metrics too), SERVING when this returns."""
    directory.mkdir(parents=True, exist_ok=True)
    ready, log = directory / "ready.json", directory / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
             "--model", str(bundle), "--ready-file", str(ready), *flags],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
    end = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > end:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            raise AssertionError(f"server did not become ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return ServerProcess(proc, json.loads(ready.read_text()), log)


async def no_messages() -> Any:
    """A request stream of no messages, for stream calls the server refuses: on a grpc.aio client a
    write that races the server's status turns that status into INTERNAL "Failed execute_batch"
    (grpc/grpc#36066, the client library's bug, not what the server sent)."""
    return
    yield
