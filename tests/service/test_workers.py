"""Several model workers (service/batching/batcher.py docstring, "Workers"): a batch that runs alone is
wide and runs on the lead; a backlog runs narrow batches side by side; only the lead runs setup calls;
a batch's side work (`after_batch`: attention health) runs after its answers, narrow, as if still running.

A fake `execute` with a gate holds the model threads, so what runs at once is exact, not timed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.batching import Batcher, BatchLimits, ModelThreads, Request
from service.errors import ShuttingDown
from tests.support.helpers import FunctionRunner, wait_for


class TwoLaneModel:
    """Records (thread, wide, payloads) per batch and the most batches that ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gates: dict[str, threading.Event] = {}  # a thread's own gate, in place of `gate`
        self.running = 0
        self.most_running = 0
        self.batches: list[tuple[str, bool, list[int]]] = []
        self._wide: dict[str, bool] = {}

    def set_wide(self, wide: bool) -> None:
        self._wide[threading.current_thread().name] = wide

    def __call__(self, payloads: list[int]) -> tuple[list[object], float]:
        name = threading.current_thread().name
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.batches.append((name, self._wide[name], list(payloads)))
        try:
            assert self.gates.get(name, self.gate).wait(10), "the test never opened the gate"
            return [p * 2 for p in payloads], 0.001
        finally:
            with self.lock:
                self.running -= 1

    async def until(self, running: int) -> None:
        """Wait (bounded) until `running` batches are inside the model."""
        end = time.monotonic() + 10
        while self.running != running:
            assert time.monotonic() < end, f"{self.running} batches running, expected {running}"
            await asyncio.sleep(0.005)


class Widths:
    """A BatchObserver that keeps the width each batch was reported with."""

    def __init__(self) -> None:
        self.reported: list[bool] = []

    def on_queue(self, sequences: int, tokens: int) -> None:
        pass

    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: object, wide: bool) -> None:
        self.reported.append(wide)

    def on_dropped(self, reason: str, count: int) -> None:
        pass


@pytest.fixture
async def two_workers():
    made: list[tuple[Batcher[int], ModelThreads]] = []

    def make(clock: Callable[[], float] = time.monotonic, after_batch: Any = None,
             **limits: float) -> tuple[TwoLaneModel, Batcher[int]]:
        model = TwoLaneModel()
        model.widths = Widths()  # type: ignore[attr-defined]
        threads = ModelThreads(2)
        threads.start()
        batcher: Batcher[int] = Batcher(FunctionRunner(model, model.set_wide), BatchLimits(**limits), threads,
                                        observer=model.widths, clock=clock,  # type: ignore[attr-defined]
                                        after_batch=after_batch)
        batcher.start()
        made.append((batcher, threads))
        return model, batcher

    yield make
    for batcher, threads in made:
        await batcher.aclose(join_timeout=10)
        threads.close()


def req(payload: int, length: int = 10) -> Request[int]:
    return Request(payload, length, "k")


def far() -> float:
    return time.monotonic() + 30


async def test_a_lone_batch_runs_wide_on_the_lead_and_nothing_starts_beside_it(two_workers):
    model, batcher = two_workers()
    first = batcher.submit([req(1)], far())[0]
    await model.until(1)
    later = [batcher.submit([req(i)], far())[0] for i in (2, 3)]
    await asyncio.sleep(0.05)  # a follower that wrongly started would be inside the model by now
    assert model.running == 1 and not any(item.future.done() for item in later)
    model.gate.set()
    results = await asyncio.gather(first.future, *(item.future for item in later))
    assert [r.output for r in results] == [2, 4, 6]
    assert model.batches == [("model-runner-0", True, [1]), ("model-runner-0", True, [2, 3])]
    assert model.most_running == 1
    assert model.widths.reported == [True, True]  # what attention_batches_total{width} counts


async def test_a_backlog_runs_narrow_batches_side_by_side(two_workers):
    model, batcher = two_workers(max_batch_size=2)
    items = batcher.submit([req(i) for i in range(6)], far())  # one call: a backlog at once
    await model.until(2)
    assert {(name, wide) for name, wide, _ in model.batches} == {("model-runner-0", False),
                                                                  ("model-runner-1", False)}
    model.gate.set()
    results = await asyncio.gather(*(item.future for item in items))
    assert [r.output for r in results] == [2 * i for i in range(6)]
    assert sorted(p for _, _, batch in model.batches for p in batch) == list(range(6))
    assert all(len(batch) <= 2 for _, _, batch in model.batches)
    assert model.most_running == 2
    assert model.widths.reported[:2] == [False, False]


async def test_only_the_lead_runs_setup_calls():
    threads = ModelThreads(2)
    threads.start()
    names = [await threads.call(lambda: threading.current_thread().name) for _ in range(5)]
    threads.close()
    assert names == ["model-runner-0"] * 5


async def test_aclose_fails_both_running_batches_when_their_forwards_hang(two_workers):
    model, batcher = two_workers(max_batch_size=1)
    items = batcher.submit([req(i) for i in range(3)], far())
    await model.until(2)
    await batcher.aclose(join_timeout=0.05)
    outcomes = await asyncio.gather(*(item.future for item in items), return_exceptions=True)
    assert all(isinstance(o, ShuttingDown) for o in outcomes), outcomes
    model.gate.set()  # the abandoned threads end; their late results are ignored
    await wait_for(lambda: not batcher.running, 2, "the abandoned loops to end")


async def test_one_caller_in_turn_always_runs_wide_on_the_lead(two_workers):
    # Concurrency 1: each request follows the previous answer and runs alone, so with all the cores.
    model, batcher = two_workers()
    model.gate.set()
    for i in range(30):
        assert (await batcher.submit([req(i)], far())[0].future).output == 2 * i
    assert {(name, wide) for name, wide, _ in model.batches} == {("model-runner-0", True)}


async def test_one_caller_in_turn_never_wakes_the_follower(two_workers):
    # Each look at the queue reads the clock once, so the clock's callers are the threads that woke.
    looks: Counter[str] = Counter()

    def clock() -> float:
        looks[threading.current_thread().name] += 1
        return time.monotonic()

    model, batcher = two_workers(clock=clock)
    model.gate.set()
    await wait_for(lambda: looks["model-runner-0"] and looks["model-runner-1"], 10,
                   "both threads to look at the (empty) queue")  # both have started and are waiting
    before = looks["model-runner-1"]
    for i in range(30):
        assert (await batcher.submit([req(i)], far())[0].future).output == 2 * i
    assert looks["model-runner-1"] == before  # the lone calls were the lead's; the follower slept
    assert looks["model-runner-0"] >= 30


async def test_a_follower_wakes_for_a_lone_call_while_the_lead_runs_narrow(two_workers):
    model, batcher = two_workers(max_batch_size=1)
    follower = model.gates["model-runner-1"] = threading.Event()
    pair = batcher.submit([req(0), req(1)], far())  # two at once: both narrow, one each
    await model.until(2)
    follower.set()  # the follower's batch ends; the lead stays inside its narrow one
    done, _ = await asyncio.wait([item.future for item in pair], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    lone = batcher.submit([req(2)], far())[0]  # nothing else queued, and a narrow batch running
    assert (await asyncio.wait_for(lone.future, 10)).output == 4
    assert model.running == 1  # the lead is still held
    model.gate.set()
    assert sorted([(await item.future).output for item in pair]) == [0, 2]
    assert {(name, wide) for name, wide, _ in model.batches} == {("model-runner-0", False), ("model-runner-1", False)}
    assert [name for name, _, batch in model.batches if batch == [2]] == ["model-runner-1"]


async def test_side_work_runs_after_the_answers_narrow_and_a_lone_call_goes_to_the_follower(two_workers):
    """The sampled batch's callers are answered before its side work starts; meanwhile the lead counts as busy
    (narrow), so a lone call goes to the follower instead of waiting for the lead. Side work that fails is
    logged and the loop goes on; a batch without side work is retired as before (the next lone call is wide)."""
    side_gate, sides = threading.Event(), []

    def work(payloads: list[int]) -> None:
        sides.append((threading.current_thread().name, model._wide[threading.current_thread().name], payloads))
        if payloads == [4]:
            raise RuntimeError("side work failed")
        assert side_gate.wait(10), "the test never opened the side gate"

    def after_batch(payloads: list[int]) -> Callable[[], None] | None:
        return (lambda: work(payloads)) if payloads in ([1], [4]) else None

    model, batcher = two_workers(after_batch=after_batch)
    model.gate.set()
    assert (await asyncio.wait_for(batcher.submit([req(1)], far())[0].future, 10)).output == 2
    await wait_for(lambda: sides, 10, "the side work to start")
    assert not batcher.idle  # the batch still runs: its thread is busy
    assert (await asyncio.wait_for(batcher.submit([req(2)], far())[0].future, 10)).output == 4
    assert sides == [("model-runner-0", False, [1])]
    side_gate.set()
    await wait_for(lambda: batcher.idle, 10, "the side work to end")
    for i in (3, 4, 5):
        assert (await asyncio.wait_for(batcher.submit([req(i)], far())[0].future, 10)).output == 2 * i
        await wait_for(lambda: batcher.idle, 10, "the batch (and its side work) to end")
    assert model.batches == [("model-runner-0", True, [1]), ("model-runner-1", False, [2]),
                             ("model-runner-0", True, [3]), ("model-runner-0", True, [4]),
                             ("model-runner-0", True, [5])]
    assert [s[2] for s in sides] == [[1], [4]]


def _os_name() -> str:
    """The calling thread's name as the OS has it (Linux)."""
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_each_model_thread_carries_its_name_into_the_os_and_threads_it_starts_inherit_it():
    """As OpenMP's threads do: bench/service_bench.py counts their CPU as the model's by this name."""
    def started_thread_name() -> str:
        names: list[str] = []
        child = threading.Thread(target=lambda: names.append(_os_name()))
        child.start()
        child.join(10)
        return names[0]

    threads = ModelThreads(2)
    threads.start()
    try:
        names = [threads.submit(worker, _os_name).result(timeout=10) for worker in (0, 1)]
        inherited = threads.submit(1, started_thread_name).result(timeout=10)
    finally:
        threads.close()
    assert names == ["model-runner-0", "model-runner-1"]
    assert inherited == "model-runner-1"
    assert not _os_name().startswith("model-runner")  # the caller's own name is untouched
