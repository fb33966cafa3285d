"""The CPU worker split chosen at warm-up (service/tuning.py measure_splits, choose_workers; service/engine.py
measure_choices): the splits are measured with their workers side by side on the model threads, the
served split and the budget follow the rules, the threads beyond the split end, and a configured
model_workers or max_batch_tokens wins, each on its own. What a measurement picks on this machine is
not asserted (timings belong in bench/RESULTS.md): only that the choice made is the one served and
reported."""

from __future__ import annotations

import functools
import threading

import pytest

from proto.attention.v1 import attention_pb2 as pb
from service import engine
from service.batching import ModelThreads
from service.config import ServiceConfig
from service.engine import worker_splits, workers_choice
from service.tuning import choose_workers, measure_splits
from tests.support.helpers import ids_request


def test_the_default_split_is_kept_unless_another_beats_it_by_the_margin():
    assert choose_workers({1: {512: 100.0, 1024: 105.0}, 2: {512: 100.0}}, default=2) == 2  # within 1.1x: a tie
    assert choose_workers({1: {512: 120.0}, 2: {512: 100.0, 1024: 90.0}}, default=2) == 1  # 1.2x the default's best
    assert choose_workers({1: {512: 80.0}, 2: {512: 100.0}}, default=2) == 2
    assert choose_workers({1: {512: 100.0}, 2: {512: 300.0}, 4: {512: 400.0}}, default=1) == 4  # the fastest better


def test_the_splits_measured_and_a_configured_count_winning():
    assert worker_splits(ServiceConfig(device="cpu", torch_threads=2)) == (1, 2)
    assert worker_splits(ServiceConfig(device="cpu", torch_threads=1)) == (1,)
    assert worker_splits(ServiceConfig(device="cpu", torch_threads=4, model_workers=3)) == (3,)
    curves = {1: {512: 500.0}, 2: {512: 100.0}}
    configured = workers_choice(ServiceConfig(device="cpu", torch_threads=2, model_workers=2), curves, 2)
    assert (configured.workers, configured.reason) == (2, "configured")
    measured = workers_choice(ServiceConfig(device="cpu", torch_threads=2), curves, 2)
    assert measured.workers == 1 and measured.reason.startswith("measured at warm-up, side by side")
    assert "1 x 2 thread(s) 500" in measured.reason and "2 x 1 thread(s) 100" in measured.reason
    off = workers_choice(ServiceConfig(device="cpu", torch_threads=2), {}, 2)
    assert off.workers == 2 and off.reason.startswith("device default")


def test_every_split_and_shape_is_run_with_its_workers_and_larger_shapes_stop_at_the_budget():
    calls: list[tuple[int, int, int]] = []
    measure_splits(lambda *args: calls.append(args), (1, 2), [(1, 128), (2, 128)], rounds=3, budget_s=60)
    assert calls[:4] == [(1, 1, 128), (2, 1, 128)] * 2  # the smallest twice on each split, for TorchScript
    assert calls[4:8] == [(1, 1, 128), (2, 1, 128), (1, 2, 128), (2, 2, 128)]  # then each once, ascending
    assert len(calls) == 8 + 3 * 4 and set(calls[8:]) == set(calls[4:8])  # then 3 interleaved rounds of all

    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def slow(workers: int, rows: int, seq: int) -> None:
        seen.append((rows, seq))
        stop.wait(0.03)  # every call over a quarter of a 0.1 s budget: the first shape is the last one

    curves = measure_splits(slow, (1, 2), [(1, 128), (2, 128), (4, 128)], budget_s=0.1)
    assert set(seen) == {(1, 128)} and set(curves) == {1, 2} and set(curves[2]) == {128}
    assert len(seen) == 4 + 2 + 2 * 2  # the first shape: twice outside the budget, once, then two rounds
    assert all(rate > 0 for curve in curves.values() for rate in curve.values())


def test_shrunk_threads_end_and_the_kept_ones_run():
    threads = ModelThreads(3)
    threads.start()
    dropped = threads._threads[1:]
    threads.shrink(1)
    for thread in dropped:
        thread.join(timeout=5)
    assert len(threads) == 1 and not any(t.is_alive() for t in dropped)
    assert threads.submit(0, lambda: 7).result(timeout=5) == 7
    with pytest.raises(ValueError, match="workers must be 1..1"):
        threads.shrink(2)
    threads.close()


async def test_a_measured_split_is_served_and_reported_in_model_info_and_metrics(start_server):
    s = await start_server(model_workers=0, max_batch_tokens=0, torch_threads=2)
    budget = (await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).batch_budget
    assert budget.model_workers in (1, 2) and budget.workers_reason.startswith("measured at warm-up, side by side")
    assert s.server.engine.workers == budget.model_workers  # what it says is what runs
    assert budget.compared_workers == 3 - budget.model_workers and len(budget.compared_tokens_per_second) >= 2
    assert budget.reason.startswith("measured at warm-up") and f"{budget.model_workers} worker(s)" in budget.reason
    assert set(budget.tokens_per_second) == set(budget.compared_tokens_per_second)  # the same shapes, both splits
    assert s.sample("attention_model_workers", {"source": "measured"}) == budget.model_workers
    assert s.sample("attention_batch_tokens_limit", {"source": "measured"}) == budget.max_batch_tokens
    response = await s.stub.Encode(ids_request([1, 2, 3], [4, 5]), timeout=10)
    assert len(response.outputs) == 2


async def test_one_worker_chosen_ends_the_other_thread(start_server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(engine, "choose_workers", functools.partial(choose_workers, gain=0.0))  # any split beats 2
    s = await start_server(model_workers=0, max_batch_tokens=0, torch_threads=2)
    budget = (await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).batch_budget
    assert (budget.model_workers, budget.compared_workers, s.server.engine.workers) == (1, 2, 1)
    assert "1 worker(s) side by side on 2 thread(s)" in budget.reason
    assert s.sample("attention_model_workers", {"source": "measured"}) == 1
    responses = [await s.stub.Encode(ids_request(list(range(1, n))), timeout=10) for n in (3, 9)]
    assert [len(r.outputs) for r in responses] == [1, 1]


async def test_a_configured_count_or_budget_wins_each_on_its_own(start_server):
    workers = await start_server(model_workers=1, max_batch_tokens=0, torch_threads=2)
    budget = (await workers.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).batch_budget
    assert (budget.model_workers, budget.workers_reason, budget.compared_workers) == (1, "configured", 0)
    assert budget.reason.startswith("measured at warm-up") and workers.server.engine.workers == 1
    assert workers.sample("attention_model_workers", {"source": "configured"}) == 1

    tokens = await start_server(model_workers=0, max_batch_tokens=1024, torch_threads=2)
    budget = (await tokens.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).batch_budget
    assert (budget.max_batch_tokens, budget.reason) == (1024, "configured")
    assert budget.workers_reason.startswith("measured") and budget.model_workers == tokens.server.engine.workers
    assert tokens.sample("attention_model_workers", {"source": "measured"}) == budget.model_workers

    off = await start_server(model_workers=0, max_batch_tokens=0, torch_threads=2, warmup=False)
    budget = (await off.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).batch_budget
    assert (budget.model_workers, off.server.engine.workers) == (2, 2) and budget.workers_reason.startswith("device")
    assert off.sample("attention_model_workers", {"source": "default"}) == 2
