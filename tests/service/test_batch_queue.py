"""service/batching/queue.py: what waits for a batch, without the batcher's threads (held under its lock there)."""

from __future__ import annotations

import asyncio

import pytest

from service.batching import BatchLimits, BatchQueue, Item, Request
from service.errors import Overloaded
from service.fault_hooks import DelayedQueue


def items(*lengths: int, key: str = "k", deadline: float = 100.0, at: float = 0.0) -> list[Item[int]]:
    loop = asyncio.get_running_loop()
    return [Item(Request(i, n, key), deadline, at, loop.create_future()) for i, n in enumerate(lengths)]


async def test_a_call_is_admitted_whole_or_not_at_all():
    queue: BatchQueue[int] = BatchQueue(BatchLimits(max_queue_requests=4, max_queue_tokens=100))
    queue.admit(items(10, 20, 30))
    with pytest.raises(Overloaded, match="3/4 sequences and 60/100 tokens"):
        queue.admit(items(1, 1))  # 5 sequences
    with pytest.raises(Overloaded):
        queue.admit(items(41))  # 101 tokens
    assert (queue.items, queue.tokens) == (3, 60)
    queue.admit(items(40))
    assert (queue.items, queue.tokens) == (4, 100)


async def test_removal_expiry_and_emptying_keep_the_counts():
    queue: BatchQueue[int] = BatchQueue(BatchLimits())
    soon, later = items(5, 6, deadline=1.0), items(7, key="other", deadline=9.0)
    queue.admit(soon)
    queue.admit(later)
    queue.remove(soon[0])
    assert (queue.items, queue.tokens) == (2, 13)
    assert queue.take_expired(now=1.0) == [soon[1]] and soon[1].state == "dropped"
    assert (queue.items, queue.tokens, bool(queue)) == (1, 7, True)
    assert queue.take_all() == later and later[0].state == "dropped"
    assert (queue.items, queue.tokens, bool(queue)) == (0, 0, False)


async def test_the_oldest_key_goes_first_and_max_wait_holds_a_batch_that_could_grow():
    queue: BatchQueue[int] = BatchQueue(BatchLimits(max_wait_ms=50))
    queue.admit(items(8, key="attention", at=2.0))
    queue.admit(items(8, 9, key="plain", at=1.0))
    batch, hold = queue.choose(now=1.02)  # 20 ms after the oldest came: 30 ms more could grow the batch
    assert [i.request.key for i in batch] == ["plain", "plain"] and hold == pytest.approx(0.03)
    assert queue.items == 3  # choosing removes nothing
    batch, hold = queue.choose(now=2.01)  # the wait is over: run it now
    assert len(batch) == 2 and hold == 0.0


async def test_admit_delay_ripens_items_before_they_can_be_chosen():
    queue: BatchQueue[int] = DelayedQueue(BatchLimits(), delay_s=0.5)  # the after_admit fault hook
    queue.admit(items(4, at=10.0))
    assert queue.choose(now=10.2) == ([], pytest.approx(0.3))
    batch, hold = queue.choose(now=10.5)
    assert len(batch) == 1 and hold == 0.0
