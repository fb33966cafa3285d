"""The scheduler: the loops that run on the model threads and feed every model's lane (its queue, limits and
runner) to the one set of threads. The contract is batching/batcher.py's docstring; a `Batcher` is one lane
of a `Scheduler` (its own, or one shared by the models of a process, service/engine.py).

Across lanes: every lane with a batch ready competes; the lane chosen is the one that has had the least
model time (start-time fair queueing over measured compute seconds: a lane's tag grows by its batches'
compute time, a lane that wakes up from idle starts at the tag of the batch now running, so it cannot bank
time while idle, and it goes next), ties to the lane whose oldest item has waited longest. Within the lane
the batch is chosen as with one model (batching/queue.py, batching/choice.py). Why time, not the window
scores of choice.py across lanes: a score is work per cost within one model; a token of a large model costs
many of a small one's, so scores of two models do not compare, and the oldest-first rule alone would queue a
lone call to an idle model behind the whole backlog of a busy one. Model time shared equally is what two
one-model processes on the same cores get from the OS, which is the setup this replaces.

State lives under one lock (`_cond`); the lead model thread waits on `_cond`, the others on `_followers`.
`Lane` is plain state the scheduler owns; `Batcher` is its public face.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from service.batching.queue import BatchQueue
from service.batching.threads import ModelThreads
from service.batching.types import (
    DEADLINE_SLACK_S,
    BatchObserver,
    BatchRunner,
    BatchTracer,
    Done,
    InFlight,
    Item,
    NullObserver,
    Request,
)
from service.errors import DeadlineExceeded, ModelFailure, ShuttingDown

log = logging.getLogger(__name__)

P = TypeVar("P")
T = TypeVar("T")

SHUTTING_DOWN = "server shutting down; retry on another replica"
# The least a batch is charged, in seconds: every batch moves its lane's tag, so a lane whose batches
# report no time (a fake runner) still cannot keep the model threads from the others.
MIN_CHARGE_S = 1e-6
# How fast a lane's estimate of compute seconds per padded token follows its measured batches.
RATE_WEIGHT = 0.2


@dataclass(eq=False)
class Lane(Generic[P]):
    """One model's share of the scheduler: its queue (and limits), its runner, where it reports, and what it
    has in flight. The scheduler reads and writes it under its lock only."""

    name: str
    runner: BatchRunner[P]
    queue: BatchQueue[P]
    observer: BatchObserver = field(default_factory=NullObserver)
    after_batch: Callable[[list[P]], Callable[[], None] | None] | None = None
    tracer: BatchTracer | None = None  # None: tracing off (a request's `trace` is then never looked at)
    accepting: bool = True
    refusal: str = SHUTTING_DOWN  # the ShuttingDown message once it stops accepting
    attached: bool = True  # False once removed from its scheduler (aclose)
    running: list[Item[P]] = field(default_factory=list)  # its items in batches in flight
    tag: float = 0.0  # model seconds it has been charged: the start tag of its next batch
    seconds_per_token: float = 0.0  # measured compute seconds per padded token (0: none measured yet)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running


@dataclass(eq=False)
class _Batch(Generic[P]):
    lane: Lane[P]
    items: list[Item[P]]
    charged: float  # the estimate charged to the lane's tag when it was chosen
    traced: object = None  # its forward's handle from the lane's tracer, when one of its requests is traced

    @property
    def tokens(self) -> int:
        return len(self.items) * max(item.request.length for item in self.items)


@dataclass(eq=False)
class _Task:
    fn: Callable[[], Any]
    future: Future[Any]


class Scheduler(Generic[P]):
    """The batching loops of one set of model threads, over any number of lanes (batching/batcher.py)."""

    def __init__(self, threads: ModelThreads, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.clock = clock
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the state's lock; the lead (or the only model thread) waits here
        self._followers = threading.Condition(lock)  # the other workers wait here (see _wake)
        self._lanes: list[Lane[P]] = []
        self._stopping = False
        self._running: list[Item[P]] = []  # the items of every batch in flight (one per worker, two pipelined)
        self._wide: list[Item[P]] | None = None  # the wide batch running (workers > 1), if one is
        self._clock_tag = 0.0  # the start tag of the batch chosen last (a waking lane starts here)
        self._tasks: list[collections.deque[_Task]] = []  # per model thread: setup work between batches
        self._task_turn: list[bool] = []  # per model thread: a task may go before the next batch
        self._loops: list[Future[None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- lanes -----------------------------------------------------------------------------------

    def attach(self, lane: Lane[P]) -> None:
        """Add a lane (before or after `start`); it competes from its first item on."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown(SHUTTING_DOWN)
            lane.tag = self._clock_tag
            self._lanes = [*self._lanes, lane]

    @property
    def lanes(self) -> tuple[Lane[P], ...]:
        return tuple(self._lanes)

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start one batching loop on each model thread (they run every lane, present and future)."""
        self.loop = asyncio.get_running_loop()
        self._tasks = [collections.deque() for _ in range(len(self.threads))]
        self._task_turn = [True] * len(self.threads)
        self._loops = [self.threads.submit(worker, functools.partial(self._run, worker))
                       for worker in range(len(self.threads))]

    @property
    def started(self) -> bool:
        return bool(self._loops)

    def run_on(self, worker: int, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on model thread `worker` (0: the lead) between its batches, and hand its result or
        exception to the returned future. Before `start` it runs at once, in order (ModelThreads.submit).
        A thread alternates: at most one such call before each batch it could run."""
        if not self._loops:
            return self.threads.submit(worker, fn)
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(ShuttingDown(SHUTTING_DOWN))
                return future
            self._tasks[worker].append(_Task(fn, future))
            if worker == 0:
                self._cond.notify()
            else:
                self._followers.notify_all()
        return future

    def submit(self, lane: Lane[P], requests: Sequence[Request[P]], deadline: float) -> list[Item[P]]:
        assert self.loop is not None, "Batcher.start() was not called. This is a bug."
        now = self.clock()
        with self._cond:
            if not lane.accepting:
                raise ShuttingDown(lane.refusal)
            items = [Item(r, deadline, now, self.loop.create_future()) for r in requests]
            waking = lane.idle
            lane.queue.admit(items)
            if waking:  # idle until now: it starts at the tag of the batch running, not where it stopped
                lane.tag = max(lane.tag, self._clock_tag)
            lane.observer.on_queue(lane.queue.items, lane.queue.tokens)
            self._wake()
        return items

    def cancel(self, lane: Lane[P], items: Sequence[Item[P]]) -> None:
        if not any(item.state == "queued" for item in items):
            # Every call ends here, most with their items run: no lock to take, nothing to count. An
            # item leaves "queued" under the lock and never returns to it, so the unlocked read is safe.
            for item in items:
                item.future.cancel()
            return
        dropped = {"cancelled": 0, "deadline": 0}
        now = self.clock()
        with self._cond:
            for item in items:
                if item.state == "queued":
                    lane.queue.remove(item)
                    item.state = "cancelled"
                    # A caller whose deadline passed while queued leaves for that reason, not by choice.
                    dropped["deadline" if item.deadline <= now + DEADLINE_SLACK_S else "cancelled"] += 1
            if any(dropped.values()):
                lane.observer.on_queue(lane.queue.items, lane.queue.tokens)
        for item in items:
            item.future.cancel()
        for reason, count in dropped.items():
            if count:
                lane.observer.on_dropped(reason, count)

    def close(self, lane: Lane[P] | None = None, refusal: str = SHUTTING_DOWN) -> None:
        """`lane` (None: every lane) admits nothing more; what it queued is still computed."""
        with self._cond:
            for each in self._lanes if lane is None else [lane]:
                if each.accepting:
                    each.accepting, each.refusal = False, refusal

    def idle(self, lane: Lane[P] | None = None) -> bool:
        with self._cond:
            return all(each.idle for each in (self._lanes if lane is None else [lane]))

    @property
    def running(self) -> bool:
        """Whether a batching loop still runs (after `aclose`, one may be stuck in a forward)."""
        return not all(loop.done() for loop in self._loops)

    async def drain(self, timeout: float, lane: Lane[P] | None = None) -> bool:
        """Wait until `lane`'s (None: every lane's) queue is empty and nothing of it runs, up to `timeout`;
        True when drained."""
        end = self.clock() + timeout
        while not self.idle(lane):
            if self.clock() >= end:
                return False
            await asyncio.sleep(0.01)
        return True

    async def aclose_lane(self, lane: Lane[P], join_timeout: float | None = None) -> None:
        """Stop admitting into `lane`, fail what it still queues with `ShuttingDown`, wait at most
        `join_timeout` seconds for its batches running (None: as long as they take), fail those still
        running then, and remove it. Other lanes are not touched."""
        with self._cond:
            if lane.accepting:
                lane.accepting, lane.refusal = False, SHUTTING_DOWN
            leftover = lane.queue.take_all()
            lane.observer.on_queue(0, 0)
        self._fail(lane, leftover)
        end = None if join_timeout is None else self.clock() + join_timeout
        while not self.idle(lane) and (end is None or self.clock() < end):
            await asyncio.sleep(0.01)
        with self._cond:
            running = list(lane.running)
            self._lanes = [each for each in self._lanes if each is not lane]
            lane.attached = False
            # Let go of the runner (and the model it holds) even while callers keep the lane: its memory returns.
            lane.runner, lane.after_batch = _Detached(), None
        for item in running:  # counted in its batch already
            _settle(item.future, ShuttingDown("request aborted: model unloading; retry"))

    async def aclose(self, join_timeout: float | None = None) -> None:
        """Stop admitting into every lane, fail what is still queued with `ShuttingDown`, stop the loops.

        Waits for the model threads' current batches at most `join_timeout` seconds (None: as long as it
        takes); a batch still running then is failed with `ShuttingDown` and its loop abandoned (its
        late results are ignored). Setup work not yet run fails with `ShuttingDown` too.
        """
        with self._cond:
            self._stopping = True
            leftovers = []
            for lane in self._lanes:
                lane.accepting = False
                leftovers.append((lane, lane.queue.take_all()))
                lane.observer.on_queue(0, 0)
            tasks = [task for queue in self._tasks for task in queue]
            for queue in self._tasks:
                queue.clear()
            self._wake_all()
        for lane, leftover in leftovers:
            self._fail(lane, leftover)
        for task in tasks:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(ShuttingDown(SHUTTING_DOWN))
        if self._loops:
            await asyncio.wait([asyncio.wrap_future(loop) for loop in self._loops], timeout=join_timeout)
        with self._cond:
            running = list(self._running) if self.running else []
        for item in running:  # counted in its batch already
            _settle(item.future, ShuttingDown("request aborted: server shutting down; retry on another replica"))

    def _fail(self, lane: Lane[P], leftover: list[Item[P]]) -> None:
        for item in leftover:
            _settle(item.future, ShuttingDown(lane.refusal))
        if leftover:
            lane.observer.on_dropped("shutting_down", len(leftover))

    # -- model-thread side -----------------------------------------------------------------------

    def _queued(self) -> int:
        return sum(lane.queue.items for lane in self._lanes)

    def _wake(self) -> None:
        """Under `_cond`: something changed. The lead always wakes; followers only when one could take a
        batch (a narrow one runs, or more than one sequence is queued). A lone sequence is the lead's:
        a follower woken by every call at concurrency 1 would take the lock and the GIL from the lead
        as it starts the forward."""
        self._cond.notify()
        if (self._running and self._wide is None) or self._queued() > 1:
            self._followers.notify_all()

    def _wake_all(self) -> None:
        self._cond.notify_all()
        self._followers.notify_all()

    def _wait(self, worker: int, timeout: float | None = None) -> None:  # under _cond
        (self._cond if worker == 0 else self._followers).wait(timeout)

    def _expire(self, now: float) -> None:  # under _cond
        for lane in self._lanes:
            expired = lane.queue.take_expired(now)
            if expired:
                lane.observer.on_dropped("deadline", len(expired))
                lane.observer.on_queue(lane.queue.items, lane.queue.tokens)
                self._settle_all([(i.future, DeadlineExceeded("deadline exceeded while queued")) for i in expired])

    def _choose(self, now: float, worker: int) -> tuple[tuple[Lane[P], list[Item[P]], bool] | None, float | None]:
        """Under `_cond`: (lane, batch, alone) to run now, or None and how long until one may be ready
        (None: until something changes). Lanes in the order of their tags, then of their oldest items."""
        if self._wide is not None:
            return None, None
        queued = [lane for lane in self._lanes if lane.queue]
        total = sum(lane.queue.items for lane in queued)
        hold: float | None = None
        # Tags rounded to the nanosecond: a tie decided by the last bit of a sum of floats is no decision.
        for lane in sorted(queued, key=lambda each: (round(each.tag, 9), each.queue.oldest())):
            batch, wait = lane.queue.choose(now)
            if wait > 0 or not batch:  # held open for max_wait_ms (or not ripe, fault hooks): another lane may go
                hold = wait if hold is None else min(hold, wait)
                continue
            alone = not self._running and len(batch) == total
            if alone and worker > 0:
                return None, hold  # a batch that would run alone is the lead's to run wide; a follower leaves it
            return (lane, batch, alone), hold
        return None, hold

    def _next(self, worker: int, wait: bool = True, tasks: bool = True) -> _Batch[P] | _Task | None:
        """The next work for `worker`: a batch, marked running, or a setup task; None when stopping, or
        (with `wait` false) when no batch is ready now: nothing queued, or the choice would hold it open."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                pending = self._tasks[worker] if tasks and self._tasks else None
                if pending and self._task_turn[worker]:
                    self._task_turn[worker] = False
                    return pending.popleft()
                now = self.clock()
                self._expire(now)
                chosen, hold = self._choose(now, worker)
                if chosen is None:
                    if pending:
                        return pending.popleft()
                    if not wait:
                        return None
                    self._wait(worker, hold or None)
                    continue
                lane, batch, alone = chosen
                for item in batch:
                    lane.queue.remove(item)
                    item.state = "running"
                lane.running = [*lane.running, *batch]
                self._running = [*self._running, *batch]
                if alone and len(self.threads) > 1:
                    self._wide = batch
                work = _Batch(lane, batch, 0.0)
                work.charged = max(work.tokens * lane.seconds_per_token, MIN_CHARGE_S)
                self._clock_tag = lane.tag
                lane.tag += work.charged
                if self._tasks:
                    self._task_turn[worker] = True
                lane.observer.on_queue(lane.queue.items, lane.queue.tokens)
                return work

    def _run(self, worker: int) -> None:
        """One model thread's loop, until `aclose`."""
        in_flight: tuple[_Batch[P], float, InFlight] | None = None  # launched, not finished (pipelined)
        while True:
            if in_flight is None:
                work = self._next(worker)
                if work is None:
                    return
                if isinstance(work, _Task):
                    _run_task(work)
                elif work.lane.runner.pipelined and len(self.threads) == 1:
                    in_flight = self._launch(work)
                else:
                    self._run_batch(work)
                continue
            # Batch N is in flight: launch N+1 first if one is ready now, so its choice and collation
            # overlap N's device work; never wait for arrivals, which would delay delivering N. After a
            # failed launch nothing else is launched until that batch has been finished.
            following: _Batch[P] | None = None
            if not in_flight[2].failed:
                nxt = self._next(worker, wait=False, tasks=False)
                assert not isinstance(nxt, _Task)
                following = nxt
            launched = None
            if following is not None and following.lane.runner.pipelined:
                launched = self._launch(following)
            work, started, handle = in_flight
            self._deliver(work, started, functools.partial(work.lane.runner.finish, handle))
            in_flight = launched
            if following is not None and not following.lane.runner.pipelined:
                self._run_batch(following)

    def _run_batch(self, work: _Batch[P]) -> None:
        wide = len(self.threads) == 1 or work.items is self._wide  # one worker: every batch has every thread
        work.lane.runner.set_wide(wide)
        started = self.clock()
        self._on_batch(work, started, wide)
        self._deliver(work, started, lambda: work.lane.runner.execute(_payloads(work.items)))

    def _launch(self, work: _Batch[P]) -> tuple[_Batch[P], float, InFlight] | None:
        started = self.clock()
        self._on_batch(work, started, wide=True)  # pipelined: one worker
        try:
            return work, started, work.lane.runner.launch(_payloads(work.items))
        except Exception as exc:  # noqa: BLE001 - the runner keeps its own failures; this one is a bug
            error = exc  # `exc` is unbound once the except block ends

            def fail() -> tuple[Sequence[Any], float]:
                raise error

            self._deliver(work, started, fail)  # fails the batch's items, as an exception from execute would
            return None

    def _on_batch(self, work: _Batch[P], started: float, wide: bool) -> None:
        batch = work.items
        padded = max(item.request.length for item in batch)
        queue_s = [started - item.enqueued_at for item in batch]
        real = sum(i.request.length for i in batch)
        work.lane.observer.on_batch(len(batch), padded, real, queue_s, wide)
        tracer = work.lane.tracer
        if tracer is not None:  # tracing off: this test is all it costs
            traces = [item.request.trace for item in batch if item.request.trace is not None]
            if traces:
                work.traced = tracer.start(traces, len(batch), padded, real, wide)

    def _deliver(self, work: _Batch[P], started: float, run: Callable[[], tuple[Sequence[Any], float]]) -> None:
        """Run the batch's computation, retire it, and resolve its futures, whatever happens. Retired
        first: a caller's next request, which can follow its answer at once, must find the batch gone
        (or a follower would take a lone batch narrow, see `_next`). A batch with side work is
        retired after it instead (`_run_side_work`): its thread is still busy."""
        outcomes: list[tuple[asyncio.Future[Done], Any]] = []
        side: Callable[[], None] | None = None
        compute_s: float | None = None
        try:
            outcomes, compute_s = self._outcomes(work, started, run)
            if work.traced is not None:
                self._end_trace(work, outcomes)
            if work.lane.after_batch is not None:  # off (attention health unsampled): this test is all it costs
                side = self._side_work(work, work.lane.after_batch)
        finally:
            if side is None:
                self._retire(work, compute_s)
        self._settle_all(outcomes)
        if side is not None:
            self._run_side_work(work, side, compute_s)

    def _end_trace(self, work: _Batch[P], outcomes: list[tuple[asyncio.Future[Done], Any]]) -> None:
        tracer = work.lane.tracer
        try:
            if tracer is not None:
                tracer.end(work.traced, sum(isinstance(out, BaseException) for _, out in outcomes))
        except Exception:  # noqa: BLE001 - tracing must not end the loop, nor keep a batch's results
            log.exception("the tracer failed on a batch of %d", len(work.items))

    def _retire(self, work: _Batch[P], compute_s: float | None) -> None:
        with self._cond:
            done = set(work.items)
            lane = work.lane
            self._running = [item for item in self._running if item not in done]
            lane.running = [item for item in lane.running if item not in done]
            if compute_s is not None:  # the estimate charged when it was chosen, made the measured time
                lane.tag += max(compute_s, MIN_CHARGE_S) - work.charged
                rate = compute_s / work.tokens
                lane.seconds_per_token = rate if not lane.seconds_per_token else (
                    (1 - RATE_WEIGHT) * lane.seconds_per_token + RATE_WEIGHT * rate)
            if self._wide is work.items:
                self._wide = None
                self._wake()  # the followers may start on what queued meanwhile

    def _side_work(self, work: _Batch[P], after_batch: Callable[[list[P]], Callable[[], None] | None]
                   ) -> Callable[[], None] | None:
        try:
            return after_batch(_payloads(work.items))
        except Exception:  # noqa: BLE001 - side work must not end the loop
            log.exception("after_batch failed on a batch of %d", len(work.items))
            return None

    def _run_side_work(self, work: _Batch[P], side: Callable[[], None], compute_s: float | None) -> None:
        """The callers have their answers (handed to the loop above). The batch stays running until the side
        work is done, narrow: a wide batch gives its threads back first, so the followers start on what
        queued meanwhile beside this thread rather than after it (or beside it with every core)."""
        with self._cond:
            if self._wide is work.items:
                self._wide = None
                self._wake()
        try:
            if len(self.threads) > 1:
                work.lane.runner.set_wide(False)
            side()
        except Exception:  # noqa: BLE001 - side work must not end the loop
            log.exception("after_batch's work failed on a batch of %d", len(work.items))
        finally:
            self._retire(work, compute_s)

    def _outcomes(self, work: _Batch[P], started: float, run: Callable[[], tuple[Sequence[Any], float]]
                  ) -> tuple[list[tuple[asyncio.Future[Done], Any]], float | None]:
        """The futures' outcomes, and the batch's compute seconds (None when it raised)."""
        batch = work.items
        padded = max(item.request.length for item in batch)
        try:
            outputs, compute_s = run()
            if len(outputs) != len(batch):
                raise RuntimeError(f"execute returned {len(outputs)} outputs for {len(batch)} items")
            return [(item.future, out if isinstance(out, BaseException)
                     else Done(out, started - item.enqueued_at, compute_s, len(batch), padded))
                    for item, out in zip(batch, outputs, strict=True)], compute_s
        except Exception:
            error = ModelFailure()
            log.exception("batch of %d failed (ref=%s)", len(batch), error.ref)
            return [(item.future, error) for item in batch], None

    def _settle_all(self, outcomes: Sequence[tuple[asyncio.Future[Any], Any]]) -> None:
        if outcomes and self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(_settle_many, outcomes)
            except RuntimeError:  # the loop closed between the check and the call
                pass


class _Detached:
    """The runner of a lane that has left its scheduler: nothing reaches it (the lane admits nothing)."""

    pipelined = False

    def set_wide(self, wide: bool) -> None:
        pass

    def execute(self, payloads: list[Any]) -> tuple[Sequence[Any], float]:
        raise ShuttingDown(SHUTTING_DOWN)

    def launch(self, payloads: list[Any]) -> InFlight:
        raise ShuttingDown(SHUTTING_DOWN)

    def finish(self, in_flight: Any) -> tuple[Sequence[Any], float]:
        raise ShuttingDown(SHUTTING_DOWN)


def _run_task(task: _Task) -> None:
    if task.future.set_running_or_notify_cancel():
        try:
            task.future.set_result(task.fn())
        except BaseException as exc:  # noqa: BLE001 - the submitter gets it
            task.future.set_exception(exc)


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
