"""The batcher's contract (service/batching/batcher.py docstring), with a fake `execute` and event gates.

No sleeps decide a result: a `threading.Event` holds the model thread while the queue fills, so
"what was queued while the model ran" is exact.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.batching import Batcher, BatchLimits, Done, ModelThreads, Request
from service.batching.choice import FRESH_WEIGHT, choose_batch, choose_window
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, ServiceError, ShuttingDown
from tests.support.helpers import FunctionRunner


class FakeModel:
    """Records every batch; each output is the payload doubled. `gate` holds the model thread."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_payloads: set[int] = set()
        self.raise_on: set[int] = set()

    def __call__(self, payloads: list[int]) -> tuple[list[object], float]:
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.batches.append(list(payloads))
        if self.raise_on & set(payloads):
            raise RuntimeError("boom")
        outs: list[object] = [ModelFailure() if p in self.fail_payloads else p * 2 for p in payloads]
        return outs, 0.001


def far() -> float:
    return time.monotonic() + 30


@pytest.fixture
async def model_and_batcher():
    made: list[tuple[Batcher[int], ModelThreads]] = []

    def make(**limits: float) -> tuple[FakeModel, Batcher[int]]:
        model = FakeModel()
        threads = ModelThreads()
        threads.start()
        batcher: Batcher[int] = Batcher(FunctionRunner(model), BatchLimits(**limits), threads)
        batcher.start()
        made.append((batcher, threads))
        return model, batcher

    yield make
    for batcher, threads in made:
        await batcher.aclose()
        threads.close()


def req(payload: int, length: int = 10, key: object = "k") -> Request[int]:
    return Request(payload, length, key)


async def hold(model: FakeModel, batcher: Batcher[int]) -> asyncio.Future[Done]:
    """Occupy the model thread with one item behind the closed gate; returns that item's future."""
    model.gate.clear()
    model.started.clear()
    [item] = batcher.submit([req(-1)], far())
    assert await asyncio.to_thread(model.started.wait, 10)
    return item.future


async def test_each_caller_gets_its_own_result(model_and_batcher):
    model, batcher = model_and_batcher()
    items = [batcher.submit([req(i, length=1 + i % 7)], far())[0] for i in range(50)]
    results = await asyncio.gather(*(it.future for it in items))
    assert [r.output for r in results] == [2 * i for i in range(50)]
    assert sorted(p for b in model.batches for p in b) == list(range(50))


async def test_idle_model_runs_at_once_and_queued_items_ride_together(model_and_batcher):
    model, batcher = model_and_batcher()
    first = await hold(model, batcher)  # ran alone, without waiting for company
    later = [batcher.submit([req(i)], far())[0] for i in range(5)]
    await asyncio.sleep(0.05)
    assert not any(it.future.done() for it in later), "nothing may finish while the model is held"
    model.gate.set()
    results = await asyncio.gather(first, *(it.future for it in later))
    assert model.batches == [[-1], [0, 1, 2, 3, 4]]
    assert {r.batch_size for r in results[1:]} == {5}
    assert results[0].batch_size == 1


async def test_token_budget_and_size_are_never_exceeded(model_and_batcher):
    model, batcher = model_and_batcher(max_batch_tokens=200, max_batch_size=6)
    first = await hold(model, batcher)
    lengths = [(i * 37) % 50 + 1 for i in range(60)]
    items = [batcher.submit([req(i, length=n)], far())[0] for i, n in enumerate(lengths)]
    model.gate.set()
    results = await asyncio.gather(first, *(it.future for it in items))
    for r in results:
        assert r.batch_size * r.padded_length <= 200 and r.batch_size <= 6
    for batch in model.batches[1:]:
        assert len(batch) * max(lengths[p] for p in batch) <= 200


async def test_different_computations_never_share_a_batch(model_and_batcher):
    model, batcher = model_and_batcher()
    first = await hold(model, batcher)
    items = [batcher.submit([req(i, key=i % 3)], far())[0] for i in range(12)]
    model.gate.set()
    await asyncio.gather(first, *(it.future for it in items))
    for batch in model.batches[1:]:
        assert len({p % 3 for p in batch}) == 1
    assert len(model.batches) == 1 + 3


async def test_similar_lengths_are_grouped(model_and_batcher):
    model, batcher = model_and_batcher(max_batch_tokens=800, max_batch_size=64, max_age_ms=1e6)
    first = await hold(model, batcher)
    lengths = {i: (10 if i % 2 else 100) for i in range(16)}  # interleaved short and long
    items = [batcher.submit([req(i, length=n)], far())[0] for i, n in lengths.items()]
    model.gate.set()
    await asyncio.gather(first, *(it.future for it in items))
    padded = sum(len(b) * max(lengths[p] for p in b) for b in model.batches[1:])
    real = sum(lengths.values())
    assert padded / real <= 1.05, model.batches  # FIFO batching would pad the shorts to 100: ratio ~1.8


async def test_age_bound_puts_an_old_item_first(model_and_batcher):
    for max_age_ms, long_goes_first in ((1e6, False), (0.0, True)):
        model, batcher = model_and_batcher(max_batch_tokens=100, max_batch_size=64, max_age_ms=max_age_ms)
        first = await hold(model, batcher)
        # 60 real of 60 padded loses to 100 of 100 (per cost, 128 tokens overhead) unless the age bound
        # forces the oldest in; the few microseconds it is older weigh nothing against that.
        old = batcher.submit([req(1000, length=60)], far())[0]
        shorts = [batcher.submit([req(i, length=10)], far())[0] for i in range(10)]
        model.gate.set()
        await asyncio.gather(first, old.future, *(it.future for it in shorts))
        assert (model.batches[1] == [1000]) is long_goes_first, model.batches


async def test_old_item_is_not_starved_by_a_stream_of_newcomers(model_and_batcher):
    model, batcher = model_and_batcher(max_batch_tokens=100, max_batch_size=64, max_age_ms=20)
    old = batcher.submit([req(1000, length=100)], far())[0]
    for i in range(200):  # newcomers keep arriving; shorts would always win on tokens alone
        batcher.submit([req(i, length=10)], far())
        await asyncio.sleep(0.001)
        if old.future.done():
            break
    result = await asyncio.wait_for(old.future, 10)
    assert result.output == 2000


async def test_full_queue_refuses_at_once_and_admits_all_or_nothing(model_and_batcher):
    model, batcher = model_and_batcher(max_queue_requests=3, max_queue_tokens=10_000)
    first = await hold(model, batcher)
    batcher.submit([req(1), req(2)], far())
    with pytest.raises(Overloaded, match="queue holds 2/3"):
        batcher.submit([req(3), req(4)], far())  # 2 + 2 > 3: none of them is admitted
    last = batcher.submit([req(5)], far())[0]
    model.gate.set()
    await first
    await last.future
    assert sorted(p for b in model.batches for p in b) == [-1, 1, 2, 5]


async def test_expired_items_are_dropped_before_compute(model_and_batcher):
    model, batcher = model_and_batcher()
    first = await hold(model, batcher)
    expired = batcher.submit([req(7)], time.monotonic() + 0.01)[0]
    alive = batcher.submit([req(8)], far())[0]
    await asyncio.sleep(0.05)
    model.gate.set()
    with pytest.raises(DeadlineExceeded):
        await expired.future
    assert (await alive.future).output == 16
    await first
    assert all(7 not in b for b in model.batches)


async def test_cancelled_items_are_dropped_before_compute(model_and_batcher):
    model, batcher = model_and_batcher()
    first = await hold(model, batcher)
    gone = batcher.submit([req(7)], far())
    stays = batcher.submit([req(8)], far())[0]
    batcher.cancel(gone)
    model.gate.set()
    assert (await stays.future).output == 16
    await first
    assert gone[0].future.cancelled()
    assert all(7 not in b for b in model.batches)


async def test_a_failing_batch_fails_only_its_items_and_the_loop_lives_on(model_and_batcher):
    model, batcher = model_and_batcher()
    model.raise_on = {3}
    first = await hold(model, batcher)
    bad = [batcher.submit([req(i, key="a")], far())[0] for i in (3, 4)]
    good = batcher.submit([req(5, key="b")], far())[0]
    model.gate.set()
    await first
    for item in bad:
        with pytest.raises(ModelFailure, match=r"inference failed \(ref=[0-9a-f]+\)"):
            await item.future
    assert (await good.future).output == 10
    after = batcher.submit([req(6, key="a")], far())[0]
    assert (await after.future).output == 12


async def test_per_item_errors_fail_only_that_item(model_and_batcher):
    model, batcher = model_and_batcher()
    model.fail_payloads = {2}
    items = batcher.submit([req(1), req(2), req(3)], far())
    outcomes = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
    assert outcomes[0].output == 2 and outcomes[2].output == 6
    assert isinstance(outcomes[1], ModelFailure)


async def test_max_wait_holds_a_batch_open_to_grow_it(model_and_batcher):
    # A wait far longer than a busy machine's stall, ended by an event: the second item fills the batch.
    model, batcher = model_and_batcher(max_wait_ms=30_000, max_batch_size=2)
    a = batcher.submit([req(1)], far())[0]
    await asyncio.sleep(0.05)
    assert not a.future.done()
    b = batcher.submit([req(2)], far())[0]
    await asyncio.gather(a.future, b.future)
    assert model.batches == [[1, 2]]


async def test_close_refuses_new_work_and_aclose_answers_what_is_queued(model_and_batcher):
    model, batcher = model_and_batcher()
    first = await hold(model, batcher)
    queued = batcher.submit([req(1)], far())[0]
    batcher.close()
    with pytest.raises(ShuttingDown):
        batcher.submit([req(2)], far())
    closing = asyncio.create_task(batcher.aclose())
    await asyncio.sleep(0.05)
    model.gate.set()
    await closing
    assert (await first).output == -2
    with pytest.raises(ShuttingDown):
        await queued.future


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    budget=st.integers(64, 512),
    size=st.integers(1, 16),
    anchor_pick=st.none() | st.integers(0, 39),
)
def test_choose_window_respects_limits_and_anchor(lengths, budget, size, anchor_pick):
    lengths = sorted(lengths)
    anchor = None if anchor_pick is None else anchor_pick % len(lengths)
    lo, hi = choose_window(lengths, BatchLimits(max_batch_tokens=budget, max_batch_size=size), anchor)
    assert 0 <= lo <= hi < len(lengths)
    assert hi - lo + 1 <= size and (hi - lo + 1) * lengths[hi] <= budget
    if anchor is not None:
        assert lo <= anchor <= hi


@pytest.mark.parametrize("workers", [1, 2])
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["keep", "cancel", "expire"])),
                    min_size=1, max_size=30))
def test_every_item_gets_exactly_one_outcome(workers, ops):
    async def scenario() -> None:
        model = FakeModel()
        threads = ModelThreads(workers)
        threads.start()
        batcher: Batcher[int] = Batcher(FunctionRunner(model), BatchLimits(max_batch_tokens=64, max_batch_size=4),
                                        threads)
        batcher.start()
        model.gate.clear()
        items = []
        for i, (length, fate) in enumerate(ops):
            deadline = time.monotonic() + (0.0 if fate == "expire" else 30)
            [item] = batcher.submit([req(i, length=length)], deadline)
            if fate == "cancel":
                batcher.cancel([item])
            items.append((item, fate))
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(*(it.future for it, _ in items), return_exceptions=True), 10)
        seen = [p for b in model.batches for p in b]
        assert len(seen) == len(set(seen)), "an item was computed twice"
        for i, (item, fate) in enumerate(items):
            assert item.future.done()
            if fate == "cancel" and item.state == "cancelled":
                assert item.future.cancelled() and i not in seen
            elif fate == "expire" and i not in seen:
                assert isinstance(item.future.exception(), DeadlineExceeded)
            elif not item.future.cancelled():
                exc = item.future.exception()
                assert exc is None or isinstance(exc, ServiceError)
                if exc is None:
                    assert item.future.result().output == 2 * i
        await batcher.aclose()
        threads.close()

    asyncio.run(scenario())


@settings(max_examples=200, deadline=None)
@given(queue=st.lists(st.tuples(st.integers(1, 64), st.floats(0, 10)), min_size=1, max_size=80),
       budget=st.integers(64, 512), size=st.integers(1, 16), max_age_ms=st.sampled_from([0.0, 500.0, 1e9]))
def test_choose_batch_respects_limits_pool_and_age_bound(queue, budget, size, max_age_ms):
    queue.sort(key=lambda item: -item[1])  # admission order: oldest first
    lengths, ages = [n for n, _ in queue], [a for _, a in queue]
    limits = BatchLimits(max_batch_tokens=budget, max_batch_size=size, pool_batches=2, max_age_ms=max_age_ms)
    picked = choose_batch(lengths, ages, limits)
    assert picked and len(set(picked)) == len(picked)
    assert [lengths[i] for i in picked] == sorted(lengths[i] for i in picked)
    longest = max(lengths[i] for i in picked)
    assert len(picked) == 1 or (len(picked) <= size and len(picked) * longest <= budget)
    # Only the pool: the oldest items up to two batches' worth of tokens (or of items).
    pool = 1
    while pool < min(len(lengths), 2 * size) and sum(lengths[:pool]) < 2 * budget:
        pool += 1
    assert max(picked) < pool
    if ages[0] * 1e3 >= max_age_ms:
        assert 0 in picked


def test_choose_batch_weighs_work_by_age():
    limits = BatchLimits(max_batch_tokens=400, max_batch_size=4, pool_batches=4, max_age_ms=1e9)
    young_first = [90, 90, 90, 90, 100, 100, 100, 100]  # admission order; a window of four fits
    # Equal ages: work per cost decides, and the 100s (400 real / 528) beat the 90s (360 / 488).
    assert sorted(choose_batch(young_first, [1.0] * 8, limits)) == [4, 5, 6, 7]
    # The 90s waited 2 s, the 100s 0.1 s: their work (and cost) weigh about 1 against 0.01, so they go first.
    assert sorted(choose_batch(young_first, [2.0] * 4 + [0.1] * 4, limits)) == [0, 1, 2, 3]
    assert FRESH_WEIGHT > 0  # a newcomer still counts: a batch of only new items is never worth zero


def test_choose_batch_is_fifo_for_equal_lengths():
    limits = BatchLimits(max_batch_tokens=300, max_batch_size=64, pool_batches=4, max_age_ms=1e9)
    ages = [5.0 - i * 0.1 for i in range(10)]
    assert choose_batch([100] * 10, ages, limits) == [0, 1, 2]


async def test_model_threads_run_calls_on_the_lead_in_order_and_live_on_after_one_raises():
    threads = ModelThreads(2)
    threads.start()
    seen: list[tuple[str, int]] = []
    calls = [threads.call(lambda i=i: seen.append((threading.current_thread().name, i)) or i) for i in range(5)]
    assert await asyncio.gather(*calls) == list(range(5))
    assert seen == [("model-runner-0", i) for i in range(5)]  # the lead, in the order handed

    def boom() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        await threads.call(boom)
    assert await threads.call(lambda: 7) == 7
    assert threads.alive
    threads.close()
    await asyncio.to_thread(lambda: [t.join(10) for t in threads._threads])
    assert not threads.alive


async def test_the_batcher_runs_on_the_threads_it_is_handed_and_leaves_them_when_closed(model_and_batcher):
    model, batcher = model_and_batcher()
    assert (await batcher.submit([req(3)], far())[0].future).output == 6
    assert batcher.running
    await batcher.aclose()
    assert not batcher.running
    with pytest.raises(ShuttingDown):
        batcher.submit([req(4)], far())


async def test_a_batch_held_open_by_max_wait_runs_whole_whatever_the_ages(model_and_batcher):
    # A late, longer item weighs little next to one that waited (service/batching/choice.py); held open for it,
    # the batch still takes both. (It fills at two: the 30 s wait ends at once then, not by the clock.)
    model, batcher = model_and_batcher(max_wait_ms=30_000, max_batch_size=2)
    a = batcher.submit([req(1, length=4)], far())[0]
    await asyncio.sleep(0.05)
    b = batcher.submit([req(2, length=12)], far())[0]
    await asyncio.gather(a.future, b.future)
    assert model.batches == [[1, 2]]


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 2, 4, 8, 16, 33, 64]), min_size=1, max_size=12),  # ties happen
       gaps=st.lists(st.floats(0, 0.2), min_size=12, max_size=12),
       max_batch_size=st.integers(1, 8), max_batch_tokens=st.sampled_from([64, 96, 128, 256, 1024]),
       overhead=st.sampled_from([0, 16, 128]), max_age_ms=st.sampled_from([1.0, 50.0, 500.0]),
       max_wait_ms=st.sampled_from([0.0, 2.0]), pool_batches=st.integers(1, 3), anchor=st.integers(0, 11))
def test_the_plain_python_choice_equals_the_numpy_one(
        lengths: list[int], gaps: list[float], max_batch_size: int, max_batch_tokens: int, overhead: int,
        max_age_ms: float, max_wait_ms: float, pool_batches: int, anchor: int) -> None:
    # Small pools are chosen in plain Python (choice.PYTHON_CELLS); the numpy search is the reference.
    from service.batching import choice

    limits = BatchLimits(max_batch_tokens=max(max_batch_tokens, max(lengths)), max_batch_size=max_batch_size,
                         batch_overhead_tokens=overhead, max_age_ms=max_age_ms, max_wait_ms=max_wait_ms,
                         pool_batches=pool_batches)
    ages = [sum(gaps[i:len(lengths)]) for i in range(len(lengths))]  # oldest first
    weights = [1.0 + (g > 0.1) for g in gaps[:len(lengths)]]  # few values: equal scores happen too
    ordered = sorted(lengths)
    pin = anchor if anchor < len(lengths) else None
    python = choose_batch(lengths, ages, limits), choose_window(ordered, limits, pin, weights)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(choice, "PYTHON_CELLS", -1)
        assert (choose_batch(lengths, ages, limits), choose_window(ordered, limits, pin, weights)) == python
