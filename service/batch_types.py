"""The batcher's data and the interfaces it is given (service/batcher.py has the contract): its
limits, a request and what its future resolves to, a queued item, the observer it reports to, and
the two-phase `Pipeline` of a device that can overlap batches."""

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
    """One sequence to compute: an opaque payload, its length and its computation key."""

    payload: P
    length: int
    key: Hashable


@dataclass(frozen=True)
class Done:
    """What an item's future resolves to."""

    output: Any
    queue_s: float
    compute_s: float
    batch_size: int
    padded_length: int


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


class Pipeline(Protocol[P]):
    """`execute` in two halves, so the model thread can prepare the next batch while one computes."""

    @property
    def pipelined(self) -> bool: ...  # read before each batch; False: use `execute`
    def launch(self, payloads: list[P]) -> Any: ...  # start the batch; returns a handle for `finish`
    def finish(self, handle: Any) -> tuple[Sequence[Any], float]: ...  # as `execute` returns
