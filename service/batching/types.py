"""The batcher's data and the interfaces it is given (batching/batcher.py has the contract): its
limits, a request and what its future resolves to, a queued item, the observer it reports to, the
tracer of its forwards, and the runner it feeds (`BatchRunner`: service/runner.py in production, fakes
in tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

P = TypeVar("P")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    max_age_ms: float = 500.0
    batch_overhead_tokens: int = 128
    pool_batches: int = 3
    max_queue_tokens: int = 262144
    max_queue_requests: int = 4096


@dataclass(frozen=True)
class Request(Generic[P]):
    """One sequence to compute: an opaque payload, its length and its computation key; `trace`, the traced
    call it belongs to (opaque here: the tracing layer's, service/tracing.py), or None."""

    payload: P
    length: int
    key: Hashable
    trace: object = None


@dataclass(frozen=True)
class Done:
    """What an item's future resolves to."""

    output: Any
    queue_s: float
    compute_s: float
    batch_size: int
    padded_length: int


# A cancellation that reaches the service this close to a call's deadline is that deadline passing, not the
# caller leaving: the caller's clock started before ours (its deadline travels as a relative grpc-timeout,
# written when the call's headers go out, so a busy caller or edge process shifts ours later by the delay),
# and its own timer fires first and cancels. 1 ms was too tight on a busy machine: calls whose callers saw
# DEADLINE_EXCEEDED were counted CANCELLED, their queued work dropped as "cancelled".
DEADLINE_SLACK_S = 0.05


@dataclass(eq=False)
class Item(Generic[P]):
    request: Request[P]
    deadline: float
    enqueued_at: float
    future: asyncio.Future[Done]
    state: str = field(default="queued")  # queued -> running | dropped | cancelled


class BatchObserver(Protocol):
    """Where the batcher reports what it does (service/metrics.py implements it)."""

    def on_queue(self, sequences: int, tokens: int) -> None: ...
    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float],
                 wide: bool) -> None: ...
    def on_dropped(self, reason: str, count: int) -> None: ...


class NullObserver:
    def on_queue(self, sequences: int, tokens: int) -> None:
        pass

    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float],
                 wide: bool) -> None:
        pass

    def on_dropped(self, reason: str, count: int) -> None:
        pass


class BatchTracer(Protocol):
    """Where a lane's forwards are traced (service/tracing.py implements it). Only a batch that holds a request
    with a `trace` is reported: `start` on its model thread as its forward starts, with the traces of its
    requests that have one (a call's several sequences each bring theirs), returning a handle; `end(handle,
    failed)` as it ends, with how many of its items failed. Neither may raise."""

    def start(self, traces: list[object], size: int, padded_length: int, real_tokens: int, wide: bool) -> object: ...
    def end(self, handle: object, failed: int) -> None: ...


class InFlight(Protocol):
    """A batch launched on a pipelined runner, until `BatchRunner.finish` hands back its outputs."""

    @property
    def failed(self) -> bool: ...  # the launch failed: launch nothing more until this batch is finished


class BatchRunner(Protocol[P]):
    """What the batcher runs batches on. `execute` returns `(outputs, compute_s)`: one output or
    `ServiceError` per payload, and the forward's time. Pipelined (`pipelined` true, read before each
    batch), the batcher calls the two halves instead: `launch` starts a batch without waiting for the
    device, `finish` waits for it and returns what `execute` would. A failure in either half is the
    runner's to handle (it splits the batch, as `execute` does); an exception that escapes any of
    these fails the batch's items with `ModelFailure`."""

    @property
    def pipelined(self) -> bool: ...
    def set_wide(self, wide: bool) -> None: ...  # on the thread about to run a batch: all cores, or a share
    def execute(self, payloads: list[P]) -> tuple[Sequence[Any], float]: ...
    def launch(self, payloads: list[P]) -> InFlight: ...
    def finish(self, in_flight: Any) -> tuple[Sequence[Any], float]: ...
