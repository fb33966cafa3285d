"""Continuous, length-aware batching of single sequences into model batches.

The contract (held by tests/test_batcher.py):

- `submit(requests, deadline)` admits all sequences of one call or none. Over `max_queue_requests`
  queued sequences or `max_queue_tokens` queued tokens it raises `Overloaded` at once; after
  `close()` it raises `ShuttingDown`. It never blocks on the model.
- Every admitted item gets exactly one outcome on its future: a `Done` or a `ServiceError`
  (or it is cancelled by its caller). Nothing is left unresolved, on any path.
- One model thread loops: choose a batch, run it, resolve its futures, repeat. The batch is
  chosen at the moment the model frees, so it holds everything that arrived during the previous
  forward (continuous batching: no fixed wait when idle). Decoding and validation happen on the
  event loop while the model runs. `max_wait_ms` > 0 may hold a not-full batch open to grow it.
- A batch holds one computation `key` only (attention or not, causal or not, ...), at most
  `max_batch_size` items and at most `max_batch_tokens` tokens counted as size x padded length.
- Length-aware: among the oldest queued items of the chosen key (about `pool_batches` batches'
  worth), sorted by length, it takes the window of
  similar lengths that does the most real work per unit of cost, where a batch costs its padded
  tokens plus `batch_overhead_tokens` (the fixed cost of one forward, in tokens). Age bound: the
  key with the oldest item goes first, and once that item has waited `max_age_ms` the window must
  contain it, so no item starves behind newcomers.
- Items whose deadline has passed or whose caller cancelled are dropped before they are computed
  (counted by reason: `deadline`, `cancelled`, `shutting_down`).
- `aclose()` fails what is still queued with `ShuttingDown` and lets the running batch finish; with
  `join_timeout`, a batch still running after that long is failed with `ShuttingDown` too, so a
  caller waiting on a stuck model still gets an answer.
- `execute(payloads)` returns `(outputs, compute_s)`: one output or `ServiceError` per item, and
  the forward's wall time. An exception from it fails only that batch's items (as `ModelFailure`),
  and the loop lives on.

It imports neither grpc nor torch: `execute` is injected (service/runner.py provides it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from service.errors import DeadlineExceeded, ModelFailure, Overloaded, ServiceError, ShuttingDown
from service.window import choose_window

log = logging.getLogger(__name__)

P = TypeVar("P")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    max_age_ms: float = 500.0
    batch_overhead_tokens: int = 128
    pool_batches: int = 4
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
    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float]) -> None: ...
    def on_dropped(self, reason: str, count: int) -> None: ...


class _NullObserver:
    def on_queue(self, sequences: int, tokens: int) -> None:
        pass

    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float]) -> None:
        pass

    def on_dropped(self, reason: str, count: int) -> None:
        pass


class Batcher(Generic[P]):
    """Queues sequences from many calls and feeds them, batched, to `execute` on one model thread."""

    def __init__(
        self,
        execute: Callable[[list[P]], tuple[Sequence[Any], float]],
        limits: BatchLimits,
        *,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        thread_name: str = "model-runner",
        admit_delay_s: float = 0.0,
    ) -> None:
        self._execute = execute
        self._limits = limits
        self._observer: BatchObserver = observer or _NullObserver()
        self._clock = clock
        self._queues: dict[Hashable, list[Item[P]]] = {}
        self._queued_tokens = 0
        self._queued_items = 0
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._busy = False
        self._running: list[Item[P]] = []
        self._admit_delay = admit_delay_s  # test hook (service/hooks.py): items ripen this long before batching
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, requests: Sequence[Request[P]], deadline: float) -> list[Item[P]]:
        """Admit all `requests` of one call (or raise `Overloaded`/`ShuttingDown`); returns their items."""
        assert self._loop is not None, "Batcher.start() was not called. This is a bug."
        now = self._clock()
        tokens = sum(r.length for r in requests)
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("server shutting down; retry on another replica")
            lim = self._limits
            if self._queued_items + len(requests) > lim.max_queue_requests or (
                self._queued_tokens + tokens > lim.max_queue_tokens
            ):
                raise Overloaded(
                    f"overloaded: queue holds {self._queued_items}/{lim.max_queue_requests} sequences and "
                    f"{self._queued_tokens}/{lim.max_queue_tokens} tokens; retry after a backoff"
                )
            items = [Item(r, deadline, now, self._loop.create_future()) for r in requests]
            for item in items:
                self._queues.setdefault(item.request.key, []).append(item)
            self._queued_items += len(items)
            self._queued_tokens += tokens
            self._observer.on_queue(self._queued_items, self._queued_tokens)
            self._cond.notify()
        return items

    def cancel(self, items: Sequence[Item[P]]) -> None:
        """The caller is gone: drop its items that are still queued and cancel their futures."""
        dropped = {"cancelled": 0, "deadline": 0}
        now = self._clock()
        with self._cond:
            for item in items:
                if item.state == "queued":
                    self._remove(item)
                    item.state = "cancelled"
                    # A caller whose deadline passed while queued leaves for that reason, not by choice.
                    dropped["deadline" if item.deadline <= now else "cancelled"] += 1
            if any(dropped.values()):
                self._observer.on_queue(self._queued_items, self._queued_tokens)
        for item in items:
            item.future.cancel()
        for reason, count in dropped.items():
            if count:
                self._observer.on_dropped(reason, count)

    def close(self) -> None:
        """Stop admitting; queued items are still computed (drain)."""
        with self._cond:
            self._accepting = False

    @property
    def model_thread_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._queued_items == 0 and not self._busy

    async def drain(self, timeout: float) -> bool:
        """Wait until the queue is empty and the model idle, up to `timeout`; True when drained."""
        end = self._clock() + timeout
        while not self.idle:
            if self._clock() >= end:
                return False
            await asyncio.sleep(0.01)
        return True

    async def aclose(self, join_timeout: float | None = None) -> None:
        """Stop admitting, fail what is still queued with `ShuttingDown`, stop the model thread.

        Waits for the model thread's current batch at most `join_timeout` seconds (None: as long as it
        takes); a batch still running then is failed with `ShuttingDown` and its thread abandoned (a
        daemon; its late results are ignored).
        """
        with self._cond:
            self._accepting = False
            self._stopping = True
            leftover = [item for queue in self._queues.values() for item in queue]
            for item in leftover:
                item.state = "dropped"
            self._queues.clear()
            self._queued_items = self._queued_tokens = 0
            self._observer.on_queue(0, 0)
            self._cond.notify_all()
        for item in leftover:
            _settle(item.future, ShuttingDown("server shutting down; retry on another replica"))
        if leftover:
            self._observer.on_dropped("shutting_down", len(leftover))
        end = None if join_timeout is None else self._clock() + join_timeout
        while self._thread.is_alive() and (end is None or self._clock() < end):
            await asyncio.sleep(0.005)
        with self._cond:
            running = list(self._running) if self._thread.is_alive() else []
        for item in running:  # counted in its batch already
            _settle(item.future, ShuttingDown("request aborted: server shutting down; retry on another replica"))

    # -- model-thread side -----------------------------------------------------------------------

    def _remove(self, item: Item[P]) -> None:
        queue = self._queues[item.request.key]
        queue.remove(item)
        if not queue:
            del self._queues[item.request.key]
        self._queued_items -= 1
        self._queued_tokens -= item.request.length

    def _take_expired(self, now: float) -> list[Item[P]]:
        expired = [item for q in self._queues.values() for item in q if item.deadline <= now]
        for item in expired:
            self._remove(item)
            item.state = "dropped"
        return expired

    def _choose(self, now: float) -> tuple[list[Item[P]], float]:
        """The next batch, and how long to hold it open for `max_wait_ms` (0 = run it now)."""
        queues: Sequence[list[Item[P]]] = list(self._queues.values())
        if self._admit_delay > 0:
            ripe = now - self._admit_delay
            first = min(q[0].enqueued_at for q in queues)  # each queue is in admission order
            if first > ripe:
                return [], first - ripe
            queues = [ready for q in queues if (ready := [i for i in q if i.enqueued_at <= ripe])]
        queue = min(queues, key=lambda q: q[0].enqueued_at)
        oldest = queue[0]
        # Choose among the oldest items only, about `pool_batches` batches' worth of tokens: items
        # further back wait their turn, which bounds everyone's wait (the latency tail) while leaving
        # enough choice to group similar lengths.
        pool: list[Item[P]] = []
        tokens = 0
        budget = self._limits.pool_batches * self._limits.max_batch_tokens
        for item in queue:
            if tokens >= budget or len(pool) >= self._limits.pool_batches * self._limits.max_batch_size:
                break
            pool.append(item)
            tokens += item.request.length
        ordered = sorted(pool, key=lambda item: item.request.length)
        anchor = None
        if now - oldest.enqueued_at >= self._limits.max_age_ms / 1e3:
            anchor = ordered.index(oldest)
        lo, hi = choose_window([item.request.length for item in ordered], self._limits, anchor)
        batch = ordered[lo : hi + 1]
        hold = 0.0
        if self._limits.max_wait_ms > 0 and lo == 0 and hi == len(queue) - 1:
            # Everything compatible fits: waiting could grow the batch, up to max_wait_ms.
            longest = batch[-1].request.length
            full = len(batch) >= self._limits.max_batch_size or (
                (len(batch) + 1) * longest > self._limits.max_batch_tokens
            )
            if not full:
                hold = oldest.enqueued_at + self._limits.max_wait_ms / 1e3 - now
        return batch, max(hold, 0.0)

    def _next_batch(self) -> list[Item[P]] | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = self._clock()
                expired = self._take_expired(now)
                if expired:
                    self._observer.on_dropped("deadline", len(expired))
                    self._settle_all([(i.future, DeadlineExceeded("deadline exceeded while queued"))
                                      for i in expired])
                if not self._queues:
                    self._observer.on_queue(0, 0)
                    self._cond.wait()
                    continue
                batch, hold = self._choose(now)
                if hold > 0:
                    self._cond.wait(timeout=hold)
                    continue
                for item in batch:
                    self._remove(item)
                    item.state = "running"
                self._running = batch
                self._busy = True
                self._observer.on_queue(self._queued_items, self._queued_tokens)
                return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run_batch(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._running = []

    def _run_batch(self, batch: list[Item[P]]) -> None:
        started = self._clock()
        padded = max(item.request.length for item in batch)
        queue_s = [started - item.enqueued_at for item in batch]
        self._observer.on_batch(len(batch), padded, sum(i.request.length for i in batch), queue_s)
        try:
            outputs, compute_s = self._execute([item.request.payload for item in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(f"execute returned {len(outputs)} outputs for {len(batch)} items")
            outcomes: list[tuple[asyncio.Future[Done], Any]] = []
            for item, out, waited in zip(batch, outputs, queue_s, strict=True):
                if isinstance(out, BaseException):
                    outcomes.append((item.future, out))
                else:
                    outcomes.append((item.future, Done(out, waited, compute_s, len(batch), padded)))
        except Exception:
            error = ModelFailure()
            log.exception("batch of %d failed (ref=%s)", len(batch), error.ref)
            outcomes = [(item.future, error) for item in batch]
        self._settle_all(outcomes)

    def _settle_all(self, outcomes: list[tuple[asyncio.Future[Done], Any]]) -> None:
        if outcomes and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_settle_many, outcomes)
            except RuntimeError:  # the loop closed between the check and the call
                pass


def _settle(future: asyncio.Future[Done], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
        future.exception()  # marks it retrieved: a caller that left must not cause a log line
    else:
        future.set_result(outcome)


def _settle_many(outcomes: list[tuple[asyncio.Future[Done], Any]]) -> None:
    for future, outcome in outcomes:
        _settle(future, outcome)


__all__ = [
    "BatchLimits", "BatchObserver", "Batcher", "Done", "Item", "Request", "ServiceError",
]
