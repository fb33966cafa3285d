"""The pipelined model loop (service/batching/batcher.py) over the runner's two halves (service/runner.py).

A real Runner on the tiny TorchScript bundles and a real Batcher. On CPU, `pipeline=on` makes
`launch` run the forward and `finish` do the rest, which drives the whole pipelined control flow:
two batches in flight, failures falling back to `execute`, shutdown. Every batch is submitted in
one `submit` call (admitted under one lock), so what the model thread sees is exact, not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model import faults
from service.batching import Batcher, BatchLimits, Done, ModelThreads, Request
from service.config import ServiceConfig
from service.errors import DeadlineExceeded, ModelFailure, NonFiniteOutput, OutOfMemory, ShuttingDown
from service.jobs import POOL_CLS, POOL_MEAN, Job, Output
from service.runner import InFlight, Runner
from tests.support import helpers

D_MODEL = 32  # TINY


class Observed:
    """RunnerObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.forwards: list[tuple[str, float]] = []
        self.nonfinite = 0
        self.retries = 0
        self.splits: list[str] = []

    def on_forward(self, precision: str, seconds: float) -> None:
        self.forwards.append((precision, seconds))

    def on_nonfinite(self, precision: str, count: int) -> None:
        self.nonfinite += count

    def on_fp32_retry(self, count: int) -> None:
        self.retries += count

    def on_split(self, reason: str) -> None:
        self.splits.append(reason)


class Spy:
    """Wraps a runner: logs launch/finish/execute (and, via `watch`, deliveries) in call order.

    `finish_gate` cleared holds every finish; `fail` names launches whose device work fails inside the
    runner, in its launch or its finish half."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.log: list[tuple[str, int]] = []
        self.finish_gate = threading.Event()
        self.finish_gate.set()
        self.finish_entered = threading.Event()
        self.fail: dict[int, str] = {}  # launch number -> "launch" | "finish"
        self._numbers = itertools.count()
        self._launched: dict[int, int] = {}  # id(in-flight batch) -> its launch number

    @property
    def pipelined(self) -> bool:
        return self.runner.pipelined

    def set_wide(self, wide: bool) -> None:
        self.runner.set_wide(wide)

    def launch(self, jobs: list[Job]) -> InFlight:
        n = next(self._numbers)
        self.log.append(("launch", n))
        with self._failing("_enqueue", self.fail.get(n) == "launch"):
            in_flight = self.runner.launch(jobs)
        self._launched[id(in_flight)] = n
        return in_flight

    def finish(self, in_flight: InFlight) -> Any:
        n = self._launched.pop(id(in_flight))
        self.log.append(("finish", n))
        self.finish_entered.set()
        assert self.finish_gate.wait(30), "the test never opened the finish gate"
        with self._failing("_collect", self.fail.get(n) == "finish"):
            return self.runner.finish(in_flight)

    @contextlib.contextmanager
    def _failing(self, method: str, fail: bool) -> Iterator[None]:
        """While inside, the runner's `method` raises once (as a device error would)."""
        if not fail:
            yield
            return
        real = getattr(self.runner, method)

        def once(*args: Any) -> Any:
            setattr(self.runner, method, real)
            raise RuntimeError(f"injected failure in {method}")

        setattr(self.runner, method, once)
        try:
            yield
        finally:
            setattr(self.runner, method, real)

    def execute(self, jobs: list[Job]) -> Any:
        self.log.append(("execute", next(self._numbers)))
        return self.runner.execute(jobs)

    def watch(self, batcher: Batcher[Job]) -> None:
        """Log each batch delivered: its outcomes are ready and about to go to the event loop (so the
        entry is there before any of the batch's futures resolves)."""
        scheduler = batcher.scheduler
        outcomes = scheduler._outcomes

        def delivering(work: Any, *args: Any) -> Any:
            result = outcomes(work, *args)
            self.log.append(("deliver", len(work.items)))
            return result

        scheduler._outcomes = delivering  # type: ignore[method-assign]

    def max_in_flight(self) -> int:
        """Most batches started (launch or execute) and not yet delivered at any one time. (Counts a
        launch that failed and its `execute` as two: not for tests with failures.)"""
        depth = most = 0
        for event, _ in self.log:
            depth += {"launch": 1, "execute": 1, "deliver": -1}.get(event, 0)
            most = max(most, depth)
        return most


def make_runner(bundle: Path, **overrides: Any) -> Runner:
    """A loaded runner, on the CPU unless told (also where CUDA is available)."""
    runner = Runner(helpers.test_config(bundle, **{"device": "cpu", **overrides}), str(bundle), Observed())
    runner.load()
    return runner


def observed(runner: Runner) -> Observed:
    return runner._observer  # type: ignore[return-value]


@pytest.fixture
async def make_batcher():
    made: list[tuple[Batcher[Job], ModelThreads]] = []

    def make(runner: Runner | Spy, **limits: float) -> Batcher[Job]:
        merged: dict[str, Any] = {"max_batch_tokens": 256, "max_age_ms": 1e6, **limits}
        threads = ModelThreads()
        threads.start()
        batcher: Batcher[Job] = Batcher(runner, BatchLimits(**merged), threads)
        if isinstance(runner, Spy):
            runner.watch(batcher)
        batcher.start()
        made.append((batcher, threads))
        return batcher

    yield make
    for batcher, threads in made:
        await batcher.aclose(join_timeout=10)
        threads.close()


def ids_job(ids: Any, **fields: Any) -> Job:
    return Job(np.asarray(ids, np.int64), None, **fields)


def far() -> float:
    return time.monotonic() + 60


async def run_all(batcher: Batcher[Job], jobs: list[Job]) -> list[Any]:
    """Submit all jobs at once (one admission) and gather their outcomes."""
    items = batcher.submit([Request(job, job.length, job.key) for job in jobs], far())
    return await asyncio.gather(*(item.future for item in items), return_exceptions=True)


def mixed_jobs(n: int, seed: int) -> list[Job]:
    """Lengths 1..64 over all four computation kinds, attention layers asked out of order."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        length = int(rng.integers(1, 65))
        ids = rng.integers(0, 90, length)
        jobs.append([
            ids_job(ids),
            ids_job(ids, pooling=POOL_MEAN, return_hidden=False),
            ids_job(ids, attn_layers=(1, 0), heads_mean=True, pooling=POOL_CLS),
            Job(None, rng.standard_normal((length, D_MODEL)).astype(np.float32), causal=True),
        ][i % 4])
    return jobs


def by_key(jobs: list[Job]) -> list[list[Job]]:
    groups: dict[Any, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.key, []).append(job)
    return list(groups.values())


def assert_same_output(a: Output, b: Output) -> None:
    for name in ("hidden", "pooled", "attention"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
    assert a.fp32_rerun == b.fp32_rerun


def test_pipeline_setting(tiny_bundle: Path) -> None:
    assert ServiceConfig.from_args([], env={}).pipeline == "auto"
    assert ServiceConfig.from_args([], env={"ATTN_PIPELINE": "on"}).pipeline == "on"
    assert ServiceConfig.from_args(["--pipeline", "off"], env={"ATTN_PIPELINE": "on"}).pipeline == "off"
    with pytest.raises(ValueError, match=re.escape("pipeline must be one of auto|on|off")):
        ServiceConfig(pipeline="yes")
    assert not make_runner(tiny_bundle, pipeline="auto").pipelined  # off on CPU, where a forward is synchronous
    assert make_runner(tiny_bundle, pipeline="on").pipelined


async def test_pipelined_outputs_equal_unpipelined_for_mixed_lengths(tiny_bundle, reference_model, make_batcher):
    jobs = mixed_jobs(64, seed=0)
    results: dict[str, list[Any]] = {}
    for mode in ("off", "on"):
        spy = Spy(make_runner(tiny_bundle, pipeline=mode))
        results[mode] = await run_all(make_batcher(spy), jobs)
        assert all(isinstance(r, Done) for r in results[mode]), results[mode]
        launches = sum(event == "launch" for event, _ in spy.log)
        assert (launches > 0) == (mode == "on")
        assert spy.max_in_flight() == (2 if mode == "on" else 1), spy.log
        # One on_forward per forward, in both modes: here one per batch.
        assert len(observed(spy.runner).forwards) == sum(event == "deliver" for event, _ in spy.log)
    for job, off, on in zip(jobs, results["off"], results["on"], strict=True):
        assert (off.batch_size, off.padded_length) == (on.batch_size, on.padded_length)  # the same batches
        assert_same_output(off.output, on.output)
        if job.token_ids is None:
            continue
        hidden, attention = reference_model(job.token_ids, layers=(0, 1) if job.attn_layers else ())
        if job.return_hidden:
            np.testing.assert_allclose(on.output.hidden, hidden, atol=1e-5, rtol=0)
        if job.attn_layers:  # layers (1, 0): the order asked; heads averaged
            expected = attention[[1, 0]].mean(axis=1, keepdims=True)
            np.testing.assert_allclose(on.output.attention, expected, atol=1e-5, rtol=0)
            np.testing.assert_allclose(on.output.pooled, hidden[0], atol=1e-5, rtol=0)
        elif job.pooling == POOL_MEAN:
            np.testing.assert_allclose(on.output.pooled, hidden.mean(axis=0), atol=1e-5, rtol=0)


def test_a_pooled_only_batch_brings_back_no_hidden_states(tiny_bundle: Path, reference_model) -> None:
    # Pooling runs on the device, so a batch of pooled-only sequences copies B x D values back, not
    # B x T x D (on a GPU that copy is a good part of a large batch's time).
    runner = make_runner(tiny_bundle)
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 90, n) for n in (3, 17, 40)]  # padded to 40: the mean must skip the padding
    poolings = (POOL_MEAN, POOL_CLS, POOL_MEAN)
    jobs = [ids_job(x, pooling=pooling, return_hidden=False) for x, pooling in zip(ids, poolings, strict=True)]
    result = runner._forward(runner._module, jobs)
    assert result.hidden is None and result.pooled is not None and result.pooled.shape == (3, 2, D_MODEL)
    outputs, _ = runner.execute(jobs)
    for x, job, out in zip(ids, jobs, outputs, strict=True):
        assert isinstance(out, Output) and out.hidden is None
        hidden = reference_model(x)[0]
        expected = hidden.mean(axis=0) if job.pooling == POOL_MEAN else hidden[0]
        np.testing.assert_allclose(out.pooled, expected, atol=1e-5, rtol=0)


async def test_every_item_resolves_under_many_concurrent_submits(tiny_bundle, reference_model, make_batcher):
    spy = Spy(make_runner(tiny_bundle, pipeline="on"))
    batcher = make_batcher(spy, max_batch_tokens=512)
    rng = np.random.default_rng(1)
    checked = 0

    async def caller(i: int) -> None:
        nonlocal checked
        for call in range(6):
            seqs = [rng.integers(0, 90, int(rng.integers(1, 65))) for _ in range(int(rng.integers(1, 4)))]
            # Some calls with a deadline that may pass while queued, some cancelled at once.
            deadline = time.monotonic() + (0.002 if (i + call) % 5 == 0 else 60)
            jobs = [ids_job(s) for s in seqs]
            items = batcher.submit([Request(job, job.length, job.key) for job in jobs], deadline)
            if (i + call) % 7 == 0:
                batcher.cancel(items)
            outcomes = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
            for ids, item, outcome in zip(seqs, items, outcomes, strict=True):
                assert item.future.done()
                if isinstance(outcome, Done):
                    np.testing.assert_allclose(outcome.output.hidden, reference_model(ids)[0], atol=1e-5, rtol=0)
                    checked += 1
                else:
                    assert isinstance(outcome, DeadlineExceeded | asyncio.CancelledError), repr(outcome)
            await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(40))), 60)
    assert checked > 200
    assert spy.max_in_flight() == 2, "the load never had two batches in flight"
    assert await batcher.drain(5) and batcher.idle


async def test_a_fault_in_a_pipelined_batch_hits_only_the_bad_sequence(fault_bundle, reference_model, make_batcher):
    # 24 sequences of 16 tokens, 8 per batch (128-token budget): a RAISE in the first batch, an
    # OOM_IF_BATCH_GT_1 (fits alone) in the second, an OOM (never fits) in the third.
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 90, 16) for _ in range(24)]
    seqs[2][5], seqs[9][5], seqs[17][5] = faults.RAISE, faults.OOM_IF_BATCH_GT_1, faults.OOM
    spy = Spy(make_runner(fault_bundle, pipeline="on"))
    outcomes = await run_all(make_batcher(spy, max_batch_tokens=128), [ids_job(s) for s in seqs])
    for i, (ids, outcome) in enumerate(zip(seqs, outcomes, strict=True)):
        if i == 2:
            assert isinstance(outcome, ModelFailure) and not isinstance(outcome, NonFiniteOutput), repr(outcome)
        elif i == 17:
            assert isinstance(outcome, OutOfMemory), repr(outcome)
        else:
            assert isinstance(outcome, Done), (i, outcome)
            np.testing.assert_allclose(outcome.output.hidden, reference_model(ids)[0], atol=1e-5, rtol=0)
    # Each batch failed in launch, so nothing more was launched before it was finished; its finish took
    # the synchronous path from there (no second try of the whole batch): halves down to the bad sequence.
    assert [event for event, _ in spy.log] == ["launch", "finish", "deliver"] * 3, spy.log
    # Halves of 8, 4 and 2 for each bad batch: error (RAISE); oom (OOM_IF_BATCH_GT_1; OOM).
    assert sorted(observed(spy.runner).splits) == ["error"] * 3 + ["oom"] * 6, observed(spy.runner).splits


@pytest.mark.parametrize("where", ["launch", "finish"])
async def test_a_failed_half_of_a_pipelined_batch_is_answered_through_the_synchronous_path(
        tiny_bundle, reference_model, make_batcher, where):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 90, 16) for _ in range(24)]  # three batches of 8
    spy = Spy(make_runner(tiny_bundle, pipeline="on"))
    spy.fail = {0: where}
    outcomes = await run_all(make_batcher(spy, max_batch_tokens=128), [ids_job(s) for s in seqs])
    for ids, outcome in zip(seqs, outcomes, strict=True):
        assert isinstance(outcome, Done), repr(outcome)
        np.testing.assert_allclose(outcome.output.hidden, reference_model(ids)[0], atol=1e-5, rtol=0)
    events = [event for event, _ in spy.log]
    if where == "launch":  # nothing else is launched before the failed batch has been finished
        assert events[:4] == ["launch", "finish", "deliver", "launch"], events
    else:  # the next batch was launched already; the failed one is split in its turn
        assert events[:4] == ["launch", "launch", "finish", "deliver"], events
    assert "execute" not in events  # one fallback, in the runner
    assert observed(spy.runner).splits[:1] == ["error"]


async def test_nonfinite_rows_of_a_pipelined_batch_are_rerun_in_fp32(fault_bundle, reference_model, make_batcher):
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 90, 12) for _ in range(8)]
    seqs[3][0], seqs[5][0] = faults.NAN_ROW, faults.NAN_ALWAYS
    spy = Spy(make_runner(fault_bundle, pipeline="on", precision="bf16"))
    outcomes = await run_all(make_batcher(spy), [ids_job(s) for s in seqs])
    assert isinstance(outcomes[5], NonFiniteOutput)
    assert outcomes[3].output.fp32_rerun  # the fp32 re-run's result
    np.testing.assert_allclose(outcomes[3].output.hidden, reference_model(seqs[3])[0], atol=1e-5, rtol=0)
    for i in (0, 1, 2, 4, 6, 7):
        assert not outcomes[i].output.fp32_rerun and np.isfinite(outcomes[i].output.hidden).all()
    assert (observed(spy.runner).nonfinite, observed(spy.runner).retries) == (2, 2)
    assert [event for event, _ in spy.log] == ["launch", "finish", "deliver"]  # no fallback needed


@pytest.mark.parametrize("join_timeout", [None, 0.2], ids=["batches-finish", "batches-abandoned"])
async def test_shutdown_with_two_batches_in_flight_answers_everything(tiny_bundle, make_batcher, join_timeout):
    spy = Spy(make_runner(tiny_bundle, pipeline="on"))
    spy.finish_gate.clear()
    batcher = make_batcher(spy, max_batch_tokens=128)
    job = ids_job(np.arange(16))
    items = batcher.submit([Request(job, job.length, job.key) for _ in range(24)], far())
    assert await asyncio.to_thread(spy.finish_entered.wait, 10)
    assert spy.log == [("launch", 0), ("launch", 1), ("finish", 0)]  # third batch still queued
    assert not batcher.idle
    if join_timeout is None:  # the model comes back while aclose waits for it
        asyncio.get_running_loop().call_later(0.1, spy.finish_gate.set)
    await batcher.aclose(join_timeout=join_timeout)
    spy.finish_gate.set()
    outcomes = await asyncio.gather(*(item.future for item in items), return_exceptions=True)
    done = [o for o in outcomes if isinstance(o, Done)]
    queued = [o for o in outcomes if isinstance(o, ShuttingDown) and "aborted" not in str(o)]
    aborted = [o for o in outcomes if isinstance(o, ShuttingDown) and "aborted" in str(o)]
    assert len(queued) == 8
    assert (len(done), len(aborted)) == ((16, 0) if join_timeout is None else (0, 16))
    await helpers.wait_for(lambda: not batcher.running, 10, "the abandoned loop to end once its batches are done")
    assert batcher.idle
    assert sum(event == "launch" for event, _ in spy.log) == 2  # nothing launched after aclose


async def test_unpipelined_loop_delivers_each_batch_before_running_the_next(tiny_bundle, make_batcher):
    spy = Spy(make_runner(tiny_bundle))  # auto on CPU: not pipelined
    outcomes = await run_all(make_batcher(spy, max_batch_tokens=128), mixed_jobs(48, seed=5))
    assert all(isinstance(o, Done) for o in outcomes)
    events = [event for event, _ in spy.log]
    assert len(events) > 8 and events == ["execute", "deliver"] * (len(events) // 2)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_cuda_pinned_nonblocking_path_equals_cpu_fp32(tiny_bundle: Path) -> None:
    cpu = make_runner(tiny_bundle, device="cpu", precision="fp32")
    cuda = make_runner(tiny_bundle, device="cuda", precision="fp32")
    assert cuda.pipelined  # auto on CUDA
    batches = [group for seed in range(3) for group in by_key(mixed_jobs(32, seed))]  # one batch per kind
    cuda.execute(batches[0])  # warm: kernels chosen, pinned blocks cached
    # launch must never wait for the device, or the next batch's host work could not overlap.
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = [cuda.launch(jobs) for jobs in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [la.error for la in launched] == [None] * len(batches)  # launch keeps its exception for finish
    host = [t for la in launched if la.pending is not None
            for t in (la.pending.hidden, la.pending.pooled, la.pending.attention, la.pending.finite) if t is not None]
    assert all(la.pending is not None for la in launched) and all(t.is_pinned() for t in host)
    for jobs, handle in zip(batches, launched, strict=True):
        got, _ = cuda.finish(handle)
        want, _ = cpu.execute(jobs)
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, Output) and isinstance(w, Output)
            for name in ("hidden", "pooled", "attention"):
                x, y = getattr(g, name), getattr(w, name)
                assert (x is None) == (y is None)
                if x is not None:
                    np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4, err_msg=name)
    forwards = observed(cuda).forwards
    assert all(seconds > 0 for _, seconds in forwards)  # device time from the events


@pytest.mark.gpu
@gpu
async def test_cuda_pipelined_batcher_equals_cpu(tiny_bundle: Path, make_batcher: Callable[..., Any]) -> None:
    jobs = mixed_jobs(64, seed=6)
    cpu = await run_all(make_batcher(make_runner(tiny_bundle, device="cpu", precision="fp32")), jobs)
    spy = Spy(make_runner(tiny_bundle, device="cuda", precision="fp32"))
    cuda = await run_all(make_batcher(spy), jobs)
    assert spy.max_in_flight() == 2
    for a, b in zip(cpu, cuda, strict=True):
        assert isinstance(a, Done) and isinstance(b, Done)
        for name in ("hidden", "pooled", "attention"):
            x, y = getattr(a.output, name), getattr(b.output, name)
            if x is not None:
                np.testing.assert_allclose(y, x, atol=1e-4, rtol=1e-4, err_msg=name)

