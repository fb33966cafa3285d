"""The batcher's queue: the sequences waiting for a batch, one FIFO per computation key, with the
admission bounds, deadline expiry and the choice of the next batch. Plain state, no lock and no
threads: batching/batcher.py calls it under its own lock.

What a batch holds (held by tests/service/test_batcher.py and tests/service/test_batch_queue.py):
- One computation `key` only (attention or not, causal or not, ...), at most `max_batch_size` items
  and at most `max_batch_tokens` tokens counted as size x padded length.
- Length-aware: among the oldest queued items of the chosen key (about `pool_batches` batches'
  worth), sorted by length, the window of similar lengths that does the most work per unit of
  cost, where a batch costs its padded tokens plus `batch_overhead_tokens` (the fixed cost of one
  forward, in tokens) and each item's work and padded tokens count more the longer it has waited
  (batching/choice.py). Age bound: the key with the oldest item goes first, and once that item has
  waited `max_age_ms` the window must contain it, so no item starves behind newcomers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from service.batching.choice import choose_batch, pool_size
from service.batching.types import BatchLimits, Item
from service.errors import Overloaded

P = TypeVar("P")


class BatchQueue(Generic[P]):
    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.items = 0  # sequences queued
        self.tokens = 0  # their tokens
        self._queues: dict[Hashable, list[Item[P]]] = {}  # per key, in admission order

    def __bool__(self) -> bool:
        return bool(self._queues)

    def oldest(self) -> float:
        """When the item that has waited longest was admitted. Call only when the queue is not empty."""
        return min(queue[0].enqueued_at for queue in self._queues.values())

    def admit(self, items: Sequence[Item[P]]) -> None:
        """Queue all of `items` (one call's), or none: `Overloaded` past either bound."""
        tokens = sum(item.request.length for item in items)
        lim = self.limits
        if self.items + len(items) > lim.max_queue_requests or self.tokens + tokens > lim.max_queue_tokens:
            raise Overloaded(
                f"overloaded: queue holds {self.items}/{lim.max_queue_requests} sequences and "
                f"{self.tokens}/{lim.max_queue_tokens} tokens; retry after a backoff"
            )
        for item in items:
            self._queues.setdefault(item.request.key, []).append(item)
        self.items += len(items)
        self.tokens += tokens

    def remove(self, item: Item[P]) -> None:
        queue = self._queues[item.request.key]
        queue.remove(item)
        if not queue:
            del self._queues[item.request.key]
        self.items -= 1
        self.tokens -= item.request.length

    def take_expired(self, now: float) -> list[Item[P]]:
        """Remove and return the items whose deadline has passed, marked dropped."""
        expired = [item for q in self._queues.values() for item in q if item.deadline <= now]
        for item in expired:
            self.remove(item)
            item.state = "dropped"
        return expired

    def take_all(self) -> list[Item[P]]:
        """Empty the queue; returns what it held, marked dropped."""
        leftover = [item for queue in self._queues.values() for item in queue]
        for item in leftover:
            item.state = "dropped"
        self._queues.clear()
        self.items = self.tokens = 0
        return leftover

    def choose(self, now: float) -> tuple[list[Item[P]], float]:
        """The next batch (still queued), and how long to hold it open for `max_wait_ms` (0 = run it
        now). The key with the oldest item goes first. Call only when the queue is not empty."""
        return self._choose(list(self._queues.values()), now)

    def _choose(self, queues: Sequence[list[Item[P]]], now: float) -> tuple[list[Item[P]], float]:
        """`choose` among `queues` (per key, in admission order; none empty)."""
        queue = min(queues, key=lambda q: q[0].enqueued_at)
        oldest = queue[0]
        lim = self.limits
        pool = queue[: pool_size(lim)]
        picked = choose_batch([i.request.length for i in pool], [now - i.enqueued_at for i in pool], lim)
        batch = [pool[i] for i in picked]
        hold = 0.0
        if lim.max_wait_ms > 0 and len(batch) == len(queue):
            # Everything compatible fits: waiting could grow the batch, up to max_wait_ms.
            longest = batch[-1].request.length
            full = len(batch) >= lim.max_batch_size or (len(batch) + 1) * longest > lim.max_batch_tokens
            if not full:
                hold = oldest.enqueued_at + lim.max_wait_ms / 1e3 - now
        return batch, max(hold, 0.0)
