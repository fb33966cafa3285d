"""Shared pieces of the reliability, security and soak tests (RELIABILITY.md 4.0).

- `assert_clean_status`: the error-hygiene rule, applied to every non-OK status these tests see.
- `Admissions`: counts the sequences the batcher admitted, for the ledger (admitted = batched + dropped).
- `assert_ledger_balanced`: every started call handled, queue empty, model idle, admissions accounted.
- `fault_state`: resets model/faults.py's process-wide state and releases hung forwards after a test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2
from hypothesis import strategies as st

from model import faults
from service.batching import Item
from service.doors.grpc_server import ledger
from tests.support.helpers import Running, wait_for

REPO = Path(__file__).resolve().parents[2]

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


async def no_messages() -> Any:
    """A request stream of no messages, for stream calls the server refuses: on a grpc.aio client a
    write that races the server's status turns that status into INTERNAL "Failed execute_batch"
    (grpc/grpc#36066, the client library's bug, not what the server sent)."""
    return
    yield


@st.composite
def byte_mutations(draw: st.DrawFn, seed: bytes, random_max: int = 2048) -> bytes:
    """A valid encoding `seed` truncated, bit-flipped or spliced, or random bytes (RELIABILITY.md F-02)."""
    data = bytearray(seed)
    how = draw(st.sampled_from(["truncate", "flip", "splice", "random"]))
    if how == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "splice":
        i = draw(st.integers(0, len(data)))
        return bytes(data[:i] + draw(st.binary(min_size=1, max_size=64)) + data[i:])
    return draw(st.binary(max_size=random_max))
