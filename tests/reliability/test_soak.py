"""A bounded soak (RELIABILITY.md M-01..M-03): steady mixed load with faults, sampled for growth in
memory, file descriptors, threads and asyncio tasks over its second half; and a positive control
with the leaking model that the same detector must catch (if it does not, the soak is broken).

The server runs in this process so that its asyncio tasks can be counted; RSS, fds and threads
are read from /proc/self. Slopes are least-squares fits over the second half, 5% outliers trimmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from model import faults
from proto.attention.v1.codec import SERVICE_NAME
from tests.support.helpers import Running, ids_request
from tests.support.reliability_helpers import (
    Admissions,
    assert_ledger_balanced,
    fault_state,  # noqa: F401  (a fixture, used by name)
    wait_for,
)

pytestmark = [pytest.mark.soak, pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")]

RSS_SLOPE_MB_PER_MIN = 8.0  # the leak control grows ~10x faster than this
RSS_SPREAD_MB = 30.0


def _status_field(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{name} not in /proc/self/status")


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    tasks: list[int] = field(default_factory=list)

    def take(self, started: float) -> None:
        self.t.append(time.monotonic() - started)
        self.rss_mb.append(_status_field("VmRSS") / 1024)
        self.fds.append(len(os.listdir("/proc/self/fd")))
        self.threads.append(_status_field("Threads"))
        self.tasks.append(len(asyncio.all_tasks()))


def trimmed(t: list[float], y: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The points, less the 5% farthest from a first least-squares line (RELIABILITY.md M-01)."""
    ts, ys = np.array(t), np.array(y, float)
    a, b = np.polyfit(ts, ys, 1)
    keep = np.argsort(np.abs(ys - (a * ts + b)))[: max(3, int(len(ys) * 0.95))]
    return ts[keep], ys[keep]


def slope_per_min(t: list[float], y: list[float]) -> float:
    """Least-squares slope (per minute) of the trimmed points."""
    ts, ys = trimmed(t, y)
    return float(np.polyfit(ts, ys, 1)[0] * 60)


@dataclass
class Growth:
    rss_slope: float
    rss_spread: float
    fds: int
    threads: int
    tasks: int

    @property
    def problems(self) -> list[str]:
        found = []
        if self.rss_slope >= RSS_SLOPE_MB_PER_MIN:
            found.append(f"RSS grows {self.rss_slope:.1f} MB/min")
        if self.rss_spread >= RSS_SPREAD_MB:
            found.append(f"RSS max - mean {self.rss_spread:.1f} MB")
        for name in ("fds", "threads", "tasks"):
            if getattr(self, name) > 2:
                found.append(f"{name} rose by {getattr(self, name)}")
        return found


def growth(samples: Samples) -> Growth:
    half = len(samples.t) // 2
    t, rss = samples.t[half:], samples.rss_mb[half:]
    first, second = slice(0, half), slice(half, None)
    # Max - mean of the trimmed points too, as M-01 says: a spike shorter than 5% of the half (0.8 s) is
    # not growth. Two full-suite runs saw one, of 47 and 65 MB, gone again within that time.
    kept_t, kept = trimmed(t, rss)
    slope = slope_per_min(t, rss)
    if slope < 0:
        # Falling: memory handed back to the OS, which is not the burst the spread looks for (a full-suite
        # run fell 70 MB within the half, slope -268 MB/min: max - mean 34 MB). Judge it about the trend.
        kept = kept - np.polyval(np.polyfit(kept_t, kept, 1), kept_t)
    return Growth(
        rss_slope=slope,
        rss_spread=float(kept.max() - kept.mean()),
        fds=max(samples.fds[second]) - max(samples.fds[first]),
        threads=max(samples.threads[second]) - max(samples.threads[first]),
        tasks=max(samples.tasks[second]) - max(samples.tasks[first]),
    )


@contextlib.contextmanager
def logging_like_production() -> Iterator[None]:
    """pytest's log capture keeps every record, with its traceback and the frames (and tensors) that
    holds, until the test ends: a leak of the test, not of the server. For the soak, records are
    formatted and thrown away instead, as a production stderr handler would."""
    root = logging.getLogger()
    capturing = [h for h in root.handlers if type(h).__name__ == "LogCaptureHandler"]
    with open(os.devnull, "w") as devnull:
        sink = logging.StreamHandler(devnull)
        sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for handler in capturing:
            root.removeHandler(handler)
        root.addHandler(sink)
        try:
            yield
        finally:
            root.removeHandler(sink)
            for handler in capturing:
                root.addHandler(handler)


async def soak(s: Running, *, warmup_s: float, measure_s: float, leak_every: int = 0,
               workers: int = 8) -> tuple[Samples, dict[str, int]]:
    """Closed-loop load from `workers` callers (faults, short deadlines, cancellations, bad input);
    samples every 0.2 s after the warm-up. `leak_every` > 0: one call in that many carries LEAK."""
    stop = asyncio.Event()
    codes: dict[str, int] = {}
    rng = np.random.default_rng(99)

    async def worker() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            ids = rng.integers(1, faults.LEAK, size=int(rng.integers(1, 65)))
            roll = rng.random()
            if leak_every and n % leak_every == 0:
                ids[0] = faults.LEAK
            elif roll < 0.05:
                ids[-1] = faults.RAISE
            elif roll < 0.10:
                ids[0] = faults.OOM_IF_BATCH_GT_1
            elif roll < 0.13:
                ids[0] = 100  # out of vocabulary
            timeout = 0.01 if rng.random() < 0.05 else 10.0
            call = s.stub.Encode(ids_request(ids), timeout=timeout)
            if rng.random() < 0.05:
                asyncio.get_running_loop().call_later(float(rng.uniform(0, 0.01)), call.cancel)
            try:
                await call
                code = "OK"
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            except asyncio.CancelledError:
                if not call.cancelled():
                    raise
                code = "CANCELLED"
            codes[code] = codes.get(code, 0) + 1

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    samples = Samples()
    try:
        await asyncio.sleep(warmup_s)
        started = time.monotonic()
        while time.monotonic() - started < measure_s:
            samples.take(started)
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return samples, codes


@pytest.mark.usefixtures("fault_state")
def settle_memory() -> None:
    """Return what earlier tests of this process freed to the OS before measuring: the soak reads the
    test process's own RSS, and a full suite (a converted MiniLM among it) left memory that glibc handed
    back in one step during the judged half (-445 MB/min, max - mean 38.5 MB about the trend)."""
    gc.collect()
    if (libc := ctypes.util.find_library("c")) is not None:
        ctypes.CDLL(libc).malloc_trim(0)


async def test_soak_shows_no_growth_and_the_books_balance(start_server, fault_bundle):
    settle_memory()
    s = await start_server(bundle=fault_bundle, max_batch_size=16)
    admissions = Admissions(s)
    baseline_tasks = len(asyncio.all_tasks())
    baseline_threads = threading.active_count()
    with logging_like_production():
        # 20 s of warm-up: with two model workers, each thread's malloc arena grows to its high-water mark
        # over the first half minute (8 s gave slopes of 7-10 MB/min, and 5 with MALLOC_ARENA_MAX=1; 20 s
        # gives 5-6, as one worker did after 8 s).
        samples, codes = await soak(s, warmup_s=20, measure_s=32)
    report = growth(samples)
    print(f"\nsoak: {sum(codes.values())} calls {codes}; {report}")
    assert not report.problems, report.problems
    assert codes.get("OK", 0) > 1000 and codes.get("INTERNAL", 0) > 10  # load and faults really ran

    book = await assert_ledger_balanced(s, admissions, timeout=15)  # M-03
    assert sum(book["handled"].values()) == sum(codes.values()) - _not_started(codes, book)
    series = sum(len(f.samples) for f in s.registry.collect())
    assert series < 400, series  # no label-cardinality leak
    await wait_for(lambda: len(asyncio.all_tasks()) <= baseline_tasks + 2, 5, "tasks back to baseline")
    assert threading.active_count() <= baseline_threads + 2
    assert s.sample("grpc_server_handled_total", {"grpc_type": "unary", "grpc_service": SERVICE_NAME,
                                                  "grpc_method": "Encode", "grpc_code": "UNKNOWN"}) == 0


def _not_started(codes: dict[str, int], book: dict[str, object]) -> int:
    """Calls the client cancelled (or timed out at 10 ms) before they reached the server."""
    started = book["started"]
    assert isinstance(started, int)
    gap = sum(codes.values()) - started
    assert 0 <= gap <= codes.get("CANCELLED", 0) + codes.get("DEADLINE_EXCEEDED", 0), (codes, book)
    return gap


@pytest.mark.usefixtures("fault_state")
async def test_soak_detector_catches_the_leaking_model(start_server, fault_bundle):
    """Positive control: 1 MiB leaked per forward with a LEAK call, one call in 100, must fail the same check."""
    settle_memory()
    s = await start_server(bundle=fault_bundle, max_batch_size=16)
    with logging_like_production():
        samples, codes = await soak(s, warmup_s=3, measure_s=14, leak_every=100)
    report = growth(samples)
    print(f"\nleak control: {sum(codes.values())} calls, {len(faults.LEAKED)} MiB leaked; {report}")
    assert len(faults.LEAKED) >= 10
    assert any("RSS grows" in p for p in report.problems), report


def test_the_detector_ignores_a_blip_and_a_fall_and_catches_a_step_up():
    # No server: the M-01 criteria on made-up samples (0.2 s apart, 32 s; the second half is judged).
    t = [i * 0.2 for i in range(160)]
    zeros = [0] * 160
    blip = [290.0] * 160
    blip[120] = 355.0  # one sample, 65 MB up, gone at the next
    step = [290.0] * 140 + [350.0] * 20  # the last 4 s stay 60 MB up
    fall = [360.0] * 80 + [360.0 - 70.0 * i / 80 for i in range(80)]  # 70 MB handed back over the half
    drop = [360.0] * 100 + [290.0] * 60  # ... or at once
    bursts = [290.0 + 40.0 * (i % 20 >= 18) - 0.4 * i for i in range(160)]  # falling, with 40 MB bursts
    assert growth(Samples(t, blip, zeros, zeros, zeros)).problems == []
    assert growth(Samples(t, step, zeros, zeros, zeros)).problems != []
    assert growth(Samples(t, fall, zeros, zeros, zeros)).problems == []
    assert growth(Samples(t, drop, zeros, zeros, zeros)).problems == []
    assert growth(Samples(t, bursts, zeros, zeros, zeros)).problems != []
