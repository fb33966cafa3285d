"""Several models' lanes on one scheduler (service/batching/batcher.py docstring, "Several models"): each lane
admits and drains on its own, a lone call on an idle lane goes next, model time is shared fairly, and setup
work runs between batches.

Fake runners with event gates hold the model thread, and report fixed compute times, so the order of the
batches is exact, not timed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.batching import Batcher, BatchLimits, ModelThreads, Request, Scheduler
from service.errors import DeadlineExceeded, Overloaded, ServiceError, ShuttingDown
from tests.support.helpers import FunctionRunner


class Log:
    """What ran, in order, across every lane: (lane, payloads) per batch, ("task", name) per setup call."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, what: str, detail: Any) -> None:
        with self.lock:
            self.entries.append((what, detail))

    def batches(self, lane: str | None = None) -> list[list[int]]:
        return [detail for what, detail in self.entries if what != "task" and what == (lane or what)]


class LaneModel:
    """One lane's fake runner: records its batches in the shared log, answers payload * 2, and reports
    `seconds` of compute per batch. `gate` holds the model thread inside a batch."""

    def __init__(self, name: str, log: Log, seconds: float = 0.001) -> None:
        self.name, self.log, self.seconds = name, log, seconds
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def __call__(self, payloads: list[int]) -> tuple[list[object], float]:
        self.log.add(self.name, list(payloads))
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return [p * 2 for p in payloads], self.seconds


def far() -> float:
    return time.monotonic() + 30


def req(payload: int, length: int = 10, key: object = "k") -> Request[int]:
    return Request(payload, length, key)


@pytest.fixture
async def shared():
    """`make(workers)` -> (scheduler, lane(name, seconds=..., **limits) -> (model, batcher), log)."""
    made: list[tuple[Scheduler[int], ModelThreads]] = []

    def make(workers: int = 1) -> tuple[Scheduler[int], Callable[..., tuple[LaneModel, Batcher[int]]], Log]:
        threads = ModelThreads(workers)
        threads.start()
        scheduler: Scheduler[int] = Scheduler(threads)
        log = Log()
        made.append((scheduler, threads))

        def lane(name: str, seconds: float = 0.001, **limits: Any) -> tuple[LaneModel, Batcher[int]]:
            model = LaneModel(name, log, seconds)
            return model, Batcher(FunctionRunner(model), BatchLimits(**limits), threads, scheduler=scheduler,
                                  name=name)

        return scheduler, lane, log

    yield make
    for scheduler, threads in made:
        await scheduler.aclose(join_timeout=10)
        threads.close()


async def hold(model: LaneModel, batcher: Batcher[int], payload: int = -1) -> asyncio.Future[Any]:
    """Occupy the model thread with one batch of `batcher`'s lane behind its model's closed gate."""
    model.gate.clear()
    model.started.clear()
    [item] = batcher.submit([req(payload)], far())
    assert await asyncio.to_thread(model.started.wait, 10)
    return item.future


async def test_each_lane_answers_its_own_items_with_its_own_runner_and_never_mixes_them(shared):
    scheduler, lane, log = shared()
    a_model, a = lane("a")
    b_model, b = lane("b")
    scheduler.start()
    first = await hold(a_model, a)
    items = [(x, x.submit([req(i)], far())[0]) for i in range(20) for x in ((a, b)[i % 2],)]
    a_model.gate.set()
    await first
    results = await asyncio.gather(*(item.future for _, item in items))
    assert [r.output for r in results] == [2 * i for i in range(20)]
    assert sorted(p for batch in log.batches("a") for p in batch) == [-1, *range(0, 20, 2)]
    assert sorted(p for batch in log.batches("b") for p in batch) == list(range(1, 20, 2))


async def test_a_lone_call_on_an_idle_lane_runs_next_not_behind_the_other_lanes_backlog(shared):
    scheduler, lane, log = shared()
    busy_model, busy = lane("busy", max_batch_size=1)
    _, idle = lane("idle", max_batch_size=1)
    scheduler.start()
    first = await hold(busy_model, busy)
    backlog = [busy.submit([req(i)], far())[0] for i in range(10)]  # ten batches, older than the lone call
    lone = idle.submit([req(100)], far())[0]
    busy_model.gate.set()
    await asyncio.gather(first, lone.future, *(item.future for item in backlog))
    # The held batch, then the lone call: the busy lane had the model, the idle one had none.
    assert [what for what, _ in log.entries[:3]] == ["busy", "idle", "busy"], log.entries


async def test_model_time_is_shared_equally_between_busy_lanes(shared):
    # Lane "slow" reports 3 ms per batch, "fast" 1 ms: with both backlogged, each gets about the same
    # model time, so "fast" runs about three batches to each of "slow"'s.
    scheduler, lane, log = shared()
    slow_model, slow = lane("slow", seconds=0.003, max_batch_size=1)
    fast_model, fast = lane("fast", seconds=0.001, max_batch_size=1)
    scheduler.start()
    first = await hold(slow_model, slow)
    items = [x.submit([req(i)], far())[0] for i in range(60) for x in (slow, fast)]
    slow_model.gate.set()
    await asyncio.gather(first, *(item.future for item in items))
    order = [what for what, _ in log.entries[1:]]
    for n in range(4, 60):  # every prefix while both had work: their times within one slow batch
        window = order[:n]
        if window.count("fast") >= 60:
            break
        assert abs(window.count("slow") * 0.003 - window.count("fast") * 0.001) <= 0.003 + 1e-9, (n, order)
    assert 2.5 <= order[:40].count("fast") / order[:40].count("slow") <= 3.5, order[:40]


async def test_equal_lanes_alternate_and_neither_starves(shared):
    scheduler, lane, log = shared()
    a_model, a = lane("a", max_batch_size=2)
    _, b = lane("b", max_batch_size=2)
    scheduler.start()
    first = await hold(a_model, a)
    items = [a.submit([req(i)], far())[0] for i in range(20)] + [b.submit([req(i)], far())[0] for i in range(4)]
    a_model.gate.set()
    await asyncio.gather(first, *(item.future for item in items))
    order = [what for what, _ in log.entries]
    # b's four items (two batches) run long before a's twenty are done: a, then alternating while both wait.
    assert order[:5] == ["a", "b", "a", "b", "a"], order


async def test_a_lane_admits_against_its_own_bounds_and_refuses_alone_when_closing(shared):
    scheduler, lane, _ = shared()
    a_model, a = lane("a", max_queue_requests=2, max_queue_tokens=10_000)
    _, b = lane("b", max_queue_requests=2, max_queue_tokens=10_000)
    scheduler.start()
    first = await hold(a_model, a)
    queued_a = a.submit([req(1), req(2)], far())
    with pytest.raises(Overloaded, match="queue holds 2/2"):
        a.submit([req(3)], far())
    queued_b = b.submit([req(4), req(5)], far())  # b's own bound: a's full queue does not count
    b.close("model 'b' is being unloaded")
    with pytest.raises(ShuttingDown, match="model 'b' is being unloaded"):
        b.submit([req(6)], far())
    assert a_model.gate is not None
    a_model.gate.set()
    done = await asyncio.gather(first, *(item.future for item in [*queued_a, *queued_b]))
    assert [d.output for d in done[1:]] == [2, 4, 8, 10]  # b's queued items are still computed after close
    assert (await a.submit([req(7)], far())[0].future).output == 14


async def test_a_lanes_drain_and_aclose_answer_only_its_own_items_and_the_others_run_on(shared):
    scheduler, lane, log = shared()
    a_model, a = lane("a")
    b_model, b = lane("b", max_batch_size=1)
    scheduler.start()
    first = await hold(a_model, a)
    a_items = a.submit([req(1), req(2)], far())
    b_model.gate.clear()
    b_items = [b.submit([req(i)], far())[0] for i in (10, 11, 12)]
    a.close("model 'a' is being unloaded")
    draining = asyncio.create_task(a.drain(10))
    await asyncio.sleep(0.05)
    assert not draining.done(), "a's items are not done: its drain must wait"
    a_model.gate.set()
    # a's items run (a had the least model time... or b's gated batch goes first and holds the thread:
    # either way a's drain ends once a's own items are answered, whatever b still holds).
    b_model.gate.set()
    assert await draining
    assert [(await item.future).output for item in a_items] == [2, 4]
    await first
    # aclose of a lane with items queued: only its own fail, the other lane's are answered.
    b_model.gate.clear()
    held_b = b.submit([req(20)], far())[0]
    assert await asyncio.to_thread(b_model.started.wait, 10)
    c_model, c = lane("c")
    c_items = c.submit([req(30), req(31)], far())
    more_b = [b.submit([req(i)], far())[0] for i in (21, 22)]
    await c.aclose(join_timeout=10)
    for item in c_items:
        with pytest.raises(ShuttingDown):
            await item.future
    assert not c.running and b.running
    with pytest.raises(ShuttingDown):
        c.submit([req(32)], far())
    b_model.gate.set()
    assert [(await item.future).output for item in [*b_items, held_b, *more_b]] == [20, 22, 24, 40, 42, 44]
    assert all(batch[0] < 30 for batch in log.batches("c")) and not log.batches("c")


async def test_a_lane_closed_while_its_batch_runs_waits_for_it_and_fails_it_after_join_timeout(shared):
    scheduler, lane, _ = shared()
    a_model, a = lane("a")
    _, b = lane("b")
    scheduler.start()
    stuck = await hold(a_model, a)
    await a.aclose(join_timeout=0.05)  # the forward is still held: its caller gets an answer anyway
    with pytest.raises(ShuttingDown, match="unloading"):
        await stuck
    a_model.gate.set()
    assert (await b.submit([req(3)], far())[0].future).output == 6  # the loop outlived the stuck batch


async def test_setup_work_runs_on_the_asked_thread_between_batches(shared):
    scheduler, lane, log = shared(workers=2)
    a_model, a = lane("a", max_batch_size=1)
    scheduler.start()
    first = await hold(a_model, a)  # alone: wide, on the lead
    queued = [a.submit([req(i)], far())[0] for i in range(3)]
    names: list[str] = []

    def task(name: str) -> str:
        names.append(threading.current_thread().name)
        log.add("task", name)
        return name

    lead = [asyncio.wrap_future(scheduler.run_on(0, lambda n=n: task(n))) for n in ("t1", "t2")]
    a_model.gate.set()
    assert await asyncio.gather(*lead) == ["t1", "t2"]
    await asyncio.gather(first, *(item.future for item in queued))
    assert set(names) == {"model-runner-0"}
    lead_entries = [e for e in log.entries if e[0] == "task" or e[1] == [-1]]
    assert lead_entries[0] == ("a", [-1]) and lead_entries[1] == ("task", "t1")
    follower = await asyncio.wrap_future(scheduler.run_on(1, lambda: threading.current_thread().name))
    assert follower == "model-runner-1"

    def boom() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        await asyncio.wrap_future(scheduler.run_on(0, boom))
    assert (await a.submit([req(5)], far())[0].future).output == 10  # the loop lives on


async def test_setup_work_alternates_with_batches_on_one_thread(shared):
    scheduler, lane, log = shared()
    a_model, a = lane("a", max_batch_size=1)
    scheduler.start()
    first = await hold(a_model, a)
    queued = [a.submit([req(i)], far())[0] for i in range(3)]
    tasks = [asyncio.wrap_future(scheduler.run_on(0, lambda n=n: log.add("task", n))) for n in range(2)]
    a_model.gate.set()
    await asyncio.gather(first, *tasks, *(item.future for item in queued))
    assert log.entries == [("a", [-1]), ("task", 0), ("a", [0]), ("task", 1), ("a", [1]), ("a", [2])]


async def test_a_lone_call_across_lanes_runs_wide_on_the_lead(shared):
    scheduler, lane, _ = shared(workers=2)
    widths: list[tuple[str, bool]] = []

    def lane_with_widths(name: str) -> Batcher[int]:
        model, batcher = lane(name)
        batcher._lane.runner = FunctionRunner(model, lambda wide: widths.append(
            (threading.current_thread().name, wide)))
        return batcher

    a, b = lane_with_widths("a"), lane_with_widths("b")
    scheduler.start()
    assert (await a.submit([req(1)], far())[0].future).output == 2
    assert (await b.submit([req(2)], far())[0].future).output == 4
    assert widths == [("model-runner-0", True)] * 2


@pytest.mark.parametrize("workers", [1, 2])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40),
                              st.sampled_from(["keep", "cancel", "expire", "unload"])), min_size=1, max_size=30))
def test_every_item_of_every_lane_gets_exactly_one_outcome(workers, ops):
    async def scenario() -> None:
        threads = ModelThreads(workers)
        threads.start()
        scheduler: Scheduler[int] = Scheduler(threads)
        log = Log()
        models = [LaneModel(str(n), log) for n in range(3)]
        lanes = [Batcher(FunctionRunner(m), BatchLimits(max_batch_tokens=64, max_batch_size=4), threads,
                         scheduler=scheduler, name=m.name) for m in models]
        scheduler.start()
        for m in models:
            m.gate.clear()
        items = []
        unloads = []
        for i, (n, length, fate) in enumerate(ops):
            if not lanes[n].accepting:
                continue
            deadline = time.monotonic() + (0.0 if fate == "expire" else 30)
            [item] = lanes[n].submit([req(i, length=length)], deadline)
            if fate == "cancel":
                lanes[n].cancel([item])
            if fate == "unload":
                lanes[n].close("unloading")
                unloads.append(asyncio.create_task(lanes[n].aclose(join_timeout=10)))
            items.append((n, i, item, fate))
        for m in models:
            m.gate.set()
        await asyncio.wait_for(asyncio.gather(*unloads, *(it.future for _, _, it, _ in items),
                                              return_exceptions=True), 10)
        seen = {name: [p for b in log.batches(name) for p in b] for name in "012"}
        for name, payloads in seen.items():
            assert len(payloads) == len(set(payloads)), f"lane {name}: an item was computed twice"
        for n, i, item, fate in items:
            assert item.future.done()
            assert all(i not in payloads for name, payloads in seen.items() if name != str(n)), "ran on another lane"
            if item.future.cancelled():
                continue
            exc = item.future.exception()
            if exc is None:
                assert item.future.result().output == 2 * i and i in seen[str(n)]
            else:
                assert isinstance(exc, ServiceError)
                if fate == "expire" and i not in seen[str(n)]:
                    assert isinstance(exc, DeadlineExceeded | ShuttingDown)
        await scheduler.aclose()
        threads.close()

    asyncio.run(scenario())


async def test_a_lane_idle_for_a_while_cannot_save_up_model_time(shared):
    scheduler, lane, log = shared()
    a_model, a = lane("a", max_batch_size=1)
    _, b = lane("b", max_batch_size=1)
    scheduler.start()
    for i in range(10):  # a runs alone for a while: b, idle, gets no credit for it
        await a.submit([req(i)], far())[0].future
    first = await hold(a_model, a)
    items = [x.submit([req(i)], far())[0] for i in range(5) for x in (a, b)]
    a_model.gate.set()
    await asyncio.gather(first, *(item.future for item in items))
    order = [what for what, _ in log.entries[11:]]
    assert order[:4] in (["b", "a", "b", "a"], ["a", "b", "a", "b"]), order  # not b's five first


class PipelinedModel:
    """A pipelined fake runner (launch, then finish): answers payload * 2 (+ `offset`); records launches
    and finishes in the shared log, so how many batches were in flight at once is exact."""

    def __init__(self, name: str, log: Log, offset: int = 0, pipelined: bool = True) -> None:
        self.name, self.log, self.offset, self.pipelined = name, log, offset, pipelined

    def set_wide(self, wide: bool) -> None:
        pass

    def execute(self, payloads: list[int]) -> tuple[list[object], float]:
        self.log.add(self.name, list(payloads))
        return [p * 2 + self.offset for p in payloads], 0.001

    def launch(self, payloads: list[int]) -> Any:
        self.log.add(self.name, list(payloads))
        self.log.add("task", ("launch", self.name))
        return _Launched(list(payloads))

    def finish(self, launched: Any) -> tuple[list[object], float]:
        self.log.add("task", ("finish", self.name))
        return [p * 2 + self.offset for p in launched.payloads], 0.001


class _Launched:
    failed = False

    def __init__(self, payloads: list[int]) -> None:
        self.payloads = payloads


@pytest.mark.parametrize("mixed", [False, True], ids=["both-pipelined", "one-pipelined"])
async def test_pipelined_lanes_overlap_across_models_and_answer_each_its_own(shared, mixed: bool):
    scheduler, lane, log = shared()
    gate_model, gate = lane("gate")  # holds the thread while the others queue
    runners = {"a": PipelinedModel("a", log, 0), "b": PipelinedModel("b", log, 1000, pipelined=not mixed)}
    lanes = {name: Batcher(r, BatchLimits(max_batch_size=2), scheduler.threads, scheduler=scheduler, name=name)
             for name, r in runners.items()}
    scheduler.start()
    first = await hold(gate_model, gate)
    items = [(name, i, lanes[name].submit([req(i)], far())[0]) for i in range(8) for name in ("a", "b")]
    gate_model.gate.set()
    await first
    for name, i, item in items:
        assert (await item.future).output == 2 * i + (1000 if name == "b" else 0)
    launches = [detail for what, detail in log.entries if what == "task"]
    in_flight = most = 0
    for event, _ in launches:
        in_flight += 1 if event == "launch" else -1
        most = max(most, in_flight)
    assert most == 2 if not mixed else most <= 2  # the next model's batch launched before the last finished
    assert {name for _, name in launches if name == "b"} == (set() if mixed else {"b"})
