"""Continuous, length-aware batching of single sequences into model batches, for one model or several.

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
- `tracer` (service/tracing.py), when given, is told of each forward whose batch holds a request that carries
  a `trace`, on the model thread as it starts and ends (`BatchTracer`); without one, or with no traced
  request in a batch, nothing is asked of it.
- The runner's `execute(payloads)` returns `(outputs, compute_s)`: one output or `ServiceError`
  per item, and the forward's time. An exception from it fails only that batch's items (as
  `ModelFailure`), and the loop lives on.


Several models (lanes; service/engine.py serves each model through one): a `Batcher` is one model's lane
of a `Scheduler` (batching/scheduler.py), its own when none is given (the one-model case, all of the above
exactly), or one shared by every model of the process. Each lane has its own queue, limits, bounds, runner
and observer; the one set of model threads runs them all, never more threads per model.
- Admission is per lane: `submit` is all or none against the lane's own bounds (`Overloaded` names its
  queue), and raises `ShuttingDown` once that lane is closing (`close()`, with the message given), while
  the other lanes admit as before.
- A lone call on an idle lane runs at once, whatever the other lanes hold queued: the model threads go
  next to the lane that has had the least model time, not to the oldest item of all. A lane's share is
  measured compute seconds (a lane that wakes up from idle starts even with the batch running now, so
  it goes next, and cannot save up time while idle); ties go to the lane with the oldest item. Within a
  lane the batch is chosen as above. No lane starves: every batch a lane runs adds to its own count, so
  any lane with work queued gets the threads within a bounded number of other batches. A batch is never
  mixed across lanes, and what "runs alone" (wide, on the lead) counts every lane's queue.
- A lane's `drain(timeout)` waits for its own items only; its `aclose(join_timeout)` fails only its own
  queued items (`ShuttingDown`), waits for only its own running batches, then leaves the scheduler (a
  shared scheduler's loops live on; a lane's own scheduler stops with it).
- `Scheduler.run_on(worker, fn)` runs setup work (loading and warming up a model added at run time) on a
  model thread between batches: a thread runs at most one such call before each batch it could run, so
  the other models' calls keep flowing while a model loads.

The batcher is handed a loaded, warm runner (`BatchRunner`, service/runner.py), its limits and the
model threads it runs on (batching/threads.py); it imports neither grpc nor torch. The queue itself
(per-key FIFOs, the bounds, expiry, the choice of a batch) is batching/queue.py, used under the
scheduler's lock; the loops around it are batching/scheduler.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from service.batching.queue import BatchQueue
from service.batching.scheduler import SHUTTING_DOWN, Lane, Scheduler
from service.batching.threads import ModelThreads
from service.batching.types import BatchLimits, BatchObserver, BatchRunner, BatchTracer, Item, NullObserver, Request

P = TypeVar("P")


class Batcher(Generic[P]):
    """Queues sequences from many calls and feeds them, batched, to the runner on the model threads: one
    model's lane, on its own scheduler or on `scheduler` (shared with other models' lanes)."""

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
        scheduler: Scheduler[P] | None = None,
        name: str = "",
        tracer: BatchTracer | None = None,
    ) -> None:
        self._own = scheduler is None
        self._scheduler: Scheduler[P] = Scheduler(threads, clock=clock) if scheduler is None else scheduler
        assert self._scheduler.threads is threads, "a lane runs on its scheduler's threads. This is a bug."
        # make_queue: fault hooks hand in one that delays (service/fault_hooks.py)
        self._lane: Lane[P] = Lane(name, runner, make_queue(limits), observer or NullObserver(), after_batch, tracer)
        self._scheduler.attach(self._lane)

    @property
    def name(self) -> str:
        return self._lane.name

    @property
    def scheduler(self) -> Scheduler[P]:
        return self._scheduler

    @property
    def _runner(self) -> BatchRunner[P]:
        return self._lane.runner

    @property
    def _after_batch(self) -> Callable[[list[P]], Callable[[], None] | None] | None:
        return self._lane.after_batch

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loops on the model threads (a shared scheduler is started by its owner)."""
        if self._own:
            self._scheduler.start()

    def submit(self, requests: Sequence[Request[P]], deadline: float) -> list[Item[P]]:
        """Admit all `requests` of one call (or raise `Overloaded`/`ShuttingDown`); returns their items."""
        return self._scheduler.submit(self._lane, requests, deadline)

    def cancel(self, items: Sequence[Item[P]]) -> None:
        """The caller is gone: drop its items that are still queued and cancel their futures."""
        self._scheduler.cancel(self._lane, items)

    def close(self, refusal: str = SHUTTING_DOWN) -> None:
        """Stop admitting (calls get `ShuttingDown(refusal)`); queued items are still computed (drain)."""
        self._scheduler.close(self._lane, refusal)

    @property
    def accepting(self) -> bool:
        return self._lane.accepting

    @property
    def limits(self) -> BatchLimits:
        return self._lane.queue.limits

    @property
    def running(self) -> bool:
        """Whether a batching loop still runs this lane (after `aclose`, one may be stuck in a forward)."""
        return self._scheduler.running if self._own else self._lane.attached and self._scheduler.running

    @property
    def idle(self) -> bool:
        return self._scheduler.idle(self._lane)

    async def drain(self, timeout: float) -> bool:
        """Wait until this lane's queue is empty and none of its batches runs, up to `timeout`; True when
        drained."""
        return await self._scheduler.drain(timeout, self._lane)

    async def aclose(self, join_timeout: float | None = None) -> None:
        """Stop admitting, fail what is still queued with `ShuttingDown`, let the running batch(es) finish.

        Waits for them at most `join_timeout` seconds (None: as long as it takes); a batch still running
        then is failed with `ShuttingDown` (its late results are ignored). On its own scheduler the loops
        stop too; on a shared one the lane leaves it and the loops run the other lanes on.
        """
        if self._own:
            await self._scheduler.aclose(join_timeout)
        else:
            await self._scheduler.aclose_lane(self._lane, join_timeout)
