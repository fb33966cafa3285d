"""Continuous, length-aware batching of single sequences into model batches.

The contract (held by tests/service/test_batcher.py):

- `submit(requests, deadline)` admits all sequences of one call or none. Over `max_queue_requests`
  queued sequences or `max_queue_tokens` queued tokens it raises `Overloaded` at once; after
  `close()` it raises `ShuttingDown`. It never blocks on the model.
- Every admitted item gets exactly one outcome on its future: a `Done` or a `ServiceError`
  (or it is cancelled by its caller). Nothing is left unresolved, on any path.
- One model thread loops: choose a batch, run it, resolve its futures, repeat. The batch is
  chosen at the moment the model frees, so it holds everything that arrived during the previous
  forward (continuous batching: no fixed wait when idle). Decoding and validation happen on the
  event loop while the model runs. `max_wait_ms` > 0 may hold a not-full batch open to grow it.
- Pipelined (a runner whose `pipelined` is true, e.g. on a GPU): the model thread `launch`es a
  batch, then, if another is ready at once (it never waits for arrivals), chooses and launches that
  one before it `finish`es and delivers the first, so choosing and collating batch N+1 overlaps
  batch N's device work. At most two batches are in flight; with nothing ready it finishes N first;
  after a failed launch nothing more is launched until that batch is finished (the runner handles
  a failed half, service/runner.py). Not pipelined, the loop is exactly the one above.
- Workers (more than one model thread, for CPUs; never pipelined): that many model threads run
  batches side by side, each with its share of the cores. Thread 0 leads (batching/threads.py): a
  batch that starts while no other runs and leaves nothing queued is wide, run alone with every core
  (`set_wide(True)` on its thread first), so a lone request is as fast as with one worker. Every
  other batch is narrow (`set_wide(False)`); the other workers take only those, and none starts
  while a wide one runs. Two narrow forwards side by side share no OpenMP barrier, so one that the
  event loop preempts does not stall the other (bench/RESULTS.md).
- What a batch holds (one computation key, the size and token bounds, similar lengths, the age
  bound that keeps any item from starving): batching/queue.py and batching/choice.py.
- Items whose deadline has passed or whose caller cancelled are dropped before they are computed
  (counted by reason: `deadline`, `cancelled`, `shutting_down`).
- `aclose()` fails what is still queued with `ShuttingDown` and lets the running batch(es) finish;
  with `join_timeout`, batches still running after that long are failed with `ShuttingDown` too,
  so a caller waiting on a stuck model still gets an answer.
- `after_batch(payloads)`, when given, is asked on the model thread after each batch whether there is side
  work for it (the service samples attention health so, service/runner.py): None, or a callable run on that
  thread once the batch's results are handed to the event loop (off the callers' latency). While it runs,
  the batch still counts as running, narrow (the thread is busy: what queues meanwhile goes to the
  followers beside it, and a lone call is not left waiting for the lead); a batch without side work is
  retired before its results go out, as always. An exception from either is logged and the loop lives on.
- The runner's `execute(payloads)` returns `(outputs, compute_s)`: one output or `ServiceError`
  per item, and the forward's time. An exception from it fails only that batch's items (as
  `ModelFailure`), and the loop lives on.

The batcher is handed a loaded, warm runner (`BatchRunner`, service/runner.py), its limits and the
model threads it runs on (batching/threads.py); it imports neither grpc nor torch. The queue itself
(per-key FIFOs, the bounds, expiry, the choice of a batch) is batching/queue.py, used under this
class's lock; this class is the loops around it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from service.batching.queue import BatchQueue
from service.batching.threads import ModelThreads
from service.batching.types import (
    DEADLINE_SLACK_S,
    BatchLimits,
    BatchObserver,
    BatchRunner,
    Done,
    InFlight,
    Item,
    NullObserver,
    Request,
)
from service.errors import DeadlineExceeded, ModelFailure, ShuttingDown

log = logging.getLogger(__name__)

P = TypeVar("P")


class Batcher(Generic[P]):
    """Queues sequences from many calls and feeds them, batched, to the runner on the model threads."""

    def __init__(
        self,
        runner: BatchRunner[P],
        limits: BatchLimits,
        threads: ModelThreads,
        *,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        make_queue: Callable[[BatchLimits], BatchQueue[P]] = BatchQueue,
        after_batch: Callable[[list[P]], Callable[[], None] | None] | None = None,
    ) -> None:
        self._runner = runner
        self._after_batch = after_batch
        self._threads = threads
        self._observer: BatchObserver = observer or NullObserver()
        self._clock = clock
        self._queue = make_queue(limits)  # fault hooks hand in one that delays (service/fault_hooks.py)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the state's lock; the lead (or the only model thread) waits here
        self._followers = threading.Condition(lock)  # the other workers wait here (see _wake)
        self._accepting = True
        self._stopping = False
        self._busy = False
        self._running: list[Item[P]] = []  # the items of the batches in flight (one per worker, two pipelined)
        self._wide: list[Item[P]] | None = None  # the wide batch running (workers > 1), if one is
        self._loops: list[Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start one batching loop on each model thread."""
        self._loop = asyncio.get_running_loop()
        self._loops = [self._threads.submit(worker, functools.partial(self._run, worker))
                       for worker in range(len(self._threads))]

    def submit(self, requests: Sequence[Request[P]], deadline: float) -> list[Item[P]]:
        """Admit all `requests` of one call (or raise `Overloaded`/`ShuttingDown`); returns their items."""
        assert self._loop is not None, "Batcher.start() was not called. This is a bug."
        now = self._clock()
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("server shutting down; retry on another replica")
            items = [Item(r, deadline, now, self._loop.create_future()) for r in requests]
            self._queue.admit(items)
            self._observer.on_queue(self._queue.items, self._queue.tokens)
            self._wake()
        return items

    def cancel(self, items: Sequence[Item[P]]) -> None:
        """The caller is gone: drop its items that are still queued and cancel their futures."""
        if not any(item.state == "queued" for item in items):
            # Every call ends here, most with their items run: no lock to take, nothing to count. An
            # item leaves "queued" under the lock and never returns to it, so the unlocked read is safe.
            for item in items:
                item.future.cancel()
            return
        dropped = {"cancelled": 0, "deadline": 0}
        now = self._clock()
        with self._cond:
            for item in items:
                if item.state == "queued":
                    self._queue.remove(item)
                    item.state = "cancelled"
                    # A caller whose deadline passed while queued leaves for that reason, not by choice.
                    dropped["deadline" if item.deadline <= now + DEADLINE_SLACK_S else "cancelled"] += 1
            if any(dropped.values()):
                self._observer.on_queue(self._queue.items, self._queue.tokens)
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
    def limits(self) -> BatchLimits:
        return self._queue.limits

    @property
    def running(self) -> bool:
        """Whether a batching loop still runs (after `aclose`, one may be stuck in a forward)."""
        return not all(loop.done() for loop in self._loops)

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

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

        Waits for the model threads' current batches at most `join_timeout` seconds (None: as long as it
        takes); a batch still running then is failed with `ShuttingDown` and its loop abandoned (its
        late results are ignored).
        """
        with self._cond:
            self._accepting = False
            self._stopping = True
            leftover = self._queue.take_all()
            self._observer.on_queue(0, 0)
            self._wake_all()
        for item in leftover:
            _settle(item.future, ShuttingDown("server shutting down; retry on another replica"))
        if leftover:
            self._observer.on_dropped("shutting_down", len(leftover))
        if self._loops:
            await asyncio.wait([asyncio.wrap_future(loop) for loop in self._loops], timeout=join_timeout)
        with self._cond:
            running = list(self._running) if self.running else []
        for item in running:  # counted in its batch already
            _settle(item.future, ShuttingDown("request aborted: server shutting down; retry on another replica"))

    # -- model-thread side -----------------------------------------------------------------------

    def _wake(self) -> None:
        """Under `_cond`: something changed. The lead always wakes; followers only when one could take a
        batch (a narrow one runs, or more than one sequence is queued). A lone sequence is the lead's:
        a follower woken by every call at concurrency 1 would take the lock and the GIL from the lead
        as it starts the forward."""
        self._cond.notify()
        if (self._running and self._wide is None) or self._queue.items > 1:
            self._followers.notify_all()

    def _wake_all(self) -> None:
        self._cond.notify_all()
        self._followers.notify_all()

    def _wait(self, worker: int, timeout: float | None = None) -> None:  # under _cond
        (self._cond if worker == 0 else self._followers).wait(timeout)

    def _next_batch(self, worker: int = 0, wait: bool = True) -> list[Item[P]] | None:
        """The next batch for `worker`, marked running; None when stopping, or (with `wait` false) when
        none is ready now: nothing queued, or the choice would hold the batch open."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = self._clock()
                expired = self._queue.take_expired(now)
                if expired:
                    self._observer.on_dropped("deadline", len(expired))
                    self._settle_all([(i.future, DeadlineExceeded("deadline exceeded while queued"))
                                      for i in expired])
                if not self._queue or self._wide is not None:
                    if not self._queue:
                        self._observer.on_queue(0, 0)
                    if not wait:
                        return None
                    self._wait(worker)
                    continue
                batch, hold = self._queue.choose(now)
                alone = not self._running and len(batch) == self._queue.items
                if hold > 0 or (alone and worker > 0):
                    # A batch that would run alone is the lead's to run wide; a follower leaves it.
                    if not wait:
                        return None
                    self._wait(worker, hold or None)
                    continue
                for item in batch:
                    self._queue.remove(item)
                    item.state = "running"
                self._running = [*self._running, *batch]
                self._busy = True
                if alone and len(self._threads) > 1:
                    self._wide = batch
                self._observer.on_queue(self._queue.items, self._queue.tokens)
                return batch

    def _run(self, worker: int) -> None:
        """One model thread's loop, until `aclose`."""
        in_flight: tuple[list[Item[P]], float, InFlight] | None = None  # launched, not finished (pipelined)
        while True:
            if in_flight is None:
                batch = self._next_batch(worker)
                if batch is None:
                    return
                if self._runner.pipelined and len(self._threads) == 1:
                    in_flight = self._launch(batch)
                else:
                    self._run_batch(batch)
                continue
            # Batch N is in flight: launch N+1 first if one is ready now, so its choice and collation
            # overlap N's device work; never wait for arrivals, which would delay delivering N. After a
            # failed launch nothing else is launched until that batch has been finished.
            following = None
            if not in_flight[2].failed and (batch := self._next_batch(worker, wait=False)) is not None:
                following = self._launch(batch)
            batch, started, handle = in_flight
            self._deliver(batch, started, functools.partial(self._runner.finish, handle))
            in_flight = following

    def _run_batch(self, batch: list[Item[P]]) -> None:
        wide = len(self._threads) == 1 or batch is self._wide  # one worker: every batch has every thread
        self._runner.set_wide(wide)
        started = self._clock()
        self._on_batch(batch, started, wide)
        self._deliver(batch, started, lambda: self._runner.execute(_payloads(batch)))

    def _launch(self, batch: list[Item[P]]) -> tuple[list[Item[P]], float, InFlight] | None:
        started = self._clock()
        self._on_batch(batch, started, wide=True)  # pipelined: one worker
        try:
            return batch, started, self._runner.launch(_payloads(batch))
        except Exception as exc:  # noqa: BLE001 - the runner keeps its own failures; this one is a bug
            error = exc  # `exc` is unbound once the except block ends

            def fail() -> tuple[Sequence[Any], float]:
                raise error

            self._deliver(batch, started, fail)  # fails the batch's items, as an exception from execute would
            return None

    def _on_batch(self, batch: list[Item[P]], started: float, wide: bool) -> None:
        padded = max(item.request.length for item in batch)
        queue_s = [started - item.enqueued_at for item in batch]
        self._observer.on_batch(len(batch), padded, sum(i.request.length for i in batch), queue_s, wide)

    def _deliver(self, batch: list[Item[P]], started: float,
                 run: Callable[[], tuple[Sequence[Any], float]]) -> None:
        """Run the batch's computation, retire it, and resolve its futures, whatever happens. Retired
        first: a caller's next request, which can follow its answer at once, must find the batch gone
        (or a follower would take a lone batch narrow, see `_next_batch`). A batch with side work is
        retired after it instead (`_run_side_work`): its thread is still busy."""
        outcomes: list[tuple[asyncio.Future[Done], Any]] = []
        side: Callable[[], None] | None = None
        try:
            outcomes = self._outcomes(batch, started, run)
            if self._after_batch is not None:  # off (attention health unsampled): this test is all it costs
                side = self._side_work(batch, self._after_batch)
        finally:
            if side is None:
                self._retire(batch)
        self._settle_all(outcomes)
        if side is not None:
            self._run_side_work(batch, side)

    def _retire(self, batch: list[Item[P]]) -> None:
        with self._cond:
            done = set(batch)
            self._running = [item for item in self._running if item not in done]
            self._busy = bool(self._running)
            if self._wide is batch:
                self._wide = None
                self._wake()  # the followers may start on what queued meanwhile

    def _side_work(self, batch: list[Item[P]], after_batch: Callable[[list[P]], Callable[[], None] | None]
                   ) -> Callable[[], None] | None:
        try:
            return after_batch(_payloads(batch))
        except Exception:  # noqa: BLE001 - side work must not end the loop
            log.exception("after_batch failed on a batch of %d", len(batch))
            return None

    def _run_side_work(self, batch: list[Item[P]], side: Callable[[], None]) -> None:
        """The callers have their answers (handed to the loop above). The batch stays running until the side
        work is done, narrow: a wide batch gives its threads back first, so the followers start on what
        queued meanwhile beside this thread rather than after it (or beside it with every core)."""
        with self._cond:
            if self._wide is batch:
                self._wide = None
                self._wake()
        try:
            if len(self._threads) > 1:
                self._runner.set_wide(False)
            side()
        except Exception:  # noqa: BLE001 - side work must not end the loop
            log.exception("after_batch's work failed on a batch of %d", len(batch))
        finally:
            self._retire(batch)

    def _outcomes(self, batch: list[Item[P]], started: float,
                  run: Callable[[], tuple[Sequence[Any], float]]) -> list[tuple[asyncio.Future[Done], Any]]:
        padded = max(item.request.length for item in batch)
        try:
            outputs, compute_s = run()
            if len(outputs) != len(batch):
                raise RuntimeError(f"execute returned {len(outputs)} outputs for {len(batch)} items")
            return [(item.future, out if isinstance(out, BaseException)
                     else Done(out, started - item.enqueued_at, compute_s, len(batch), padded))
                    for item, out in zip(batch, outputs, strict=True)]
        except Exception:
            error = ModelFailure()
            log.exception("batch of %d failed (ref=%s)", len(batch), error.ref)
            return [(item.future, error) for item in batch]

    def _settle_all(self, outcomes: Sequence[tuple[asyncio.Future[Any], Any]]) -> None:
        if outcomes and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_settle_many, outcomes)
            except RuntimeError:  # the loop closed between the check and the call
                pass


def _payloads(batch: list[Item[P]]) -> list[P]:
    return [item.request.payload for item in batch]


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
        future.exception()  # marks it retrieved: a caller that left must not cause a log line
    else:
        future.set_result(outcome)


def _settle_many(outcomes: Sequence[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, outcome in outcomes:
        _settle(future, outcome)


