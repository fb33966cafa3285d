"""What a thread's work costs right after the thread slept (issue 42), in process, on this machine.

    python -m bench.wake_cost [--gaps 0 0.2 1 5] [--calls 400] [--json PATH]

Before each call the caller sleeps `gap` milliseconds (0: none), the idle time a call finds between the
previous caller's and its own. Then, per gap, two ways to do the same work:
- `inline`: the caller runs it itself (a naive server runs its forward on the thread that read the request);
- `hand-off`: the caller gives it to a worker thread blocked on a queue and waits for its answer, as the
  service's event loop hands a batch to its model thread and waits for the result (two threads woken a call).
The work (`--work`, all three by default): `forward`, one forward of bench/doors_bench.py's edge model (one
sequence of 16 tokens, `Runner.execute`, one intra-op thread); `plan`, the event loop's own Python of one such
call before its batch (the Encode request parsed, decoded and planned: a few hundred lines of the service's
code and many small objects); `python`, a fixed pure-Python loop (little code, no memory), to tell the code a
call touches from the machine.

Per gap and way: the work's CPU on the thread that ran it and the call's wall time, medians over `calls`
calls, and both against gap 0. A ratio well above 1 at a gap says that the machine makes work after idle
time dearer (caches and predictors cold, a virtual CPU descheduled while it was idle), so every thread that
sleeps between calls pays it: the model thread of a service that is not kept busy, and a CPU-per-call ratio
against a one-thread server measures that too. Bounded: gaps x ways x works x calls, each gap at most 10 ms,
`calls` at most 5,000.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from bench.doors_bench import TOKENS, build_edge_bundle, machine
from client.messages import EncodeOptions, build_request
from proto.attention.v1 import attention_pb2 as pb
from service.config import ServiceConfig
from service.doors.attention_wire import NAMES, encode_ask, response_bytes
from service.jobs import Job
from service.metrics import Metrics
from service.plan import plan
from service.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
MAX_GAP_MS, MAX_CALLS = 10.0, 5000
PYTHON_STEPS = 20_000
WORKS = ("forward", "plan", "python")


@dataclass(frozen=True)
class Row:
    work: str
    way: str
    gap_ms: float
    calls: int
    work_cpu_us: float  # median CPU of the work on the thread that ran it
    call_us: float  # median wall time of the call: the work, plus the hand-off's two wake-ups


def edge_runner(directory: Path) -> tuple[Runner, ServiceConfig]:
    """The service's runner on the edge model (loaded here, fp32, one intra-op thread), and its config."""
    bundle = build_edge_bundle(directory)
    config = ServiceConfig(model=str(bundle), device="cpu", precision="fp32", torch_threads=1, model_workers=1,
                           metrics_port=-1, http_port=-1)
    runner = Runner(config, str(bundle), Metrics(CollectorRegistry()), workers=1)
    runner.load()
    return runner, config


def forward_work(runner: Runner) -> Callable[[], None]:
    """One forward of one 16-token sequence through `runner`."""
    jobs = [Job(np.arange(TOKENS, dtype=np.int64), None)]

    def run() -> None:
        runner.set_wide(True)  # per thread: whichever thread runs it gets one intra-op thread
        runner.execute(jobs)

    return run


def plan_work(runner: Runner, config: ServiceConfig) -> Callable[[], None]:
    """The event loop's own Python of one call before its batch: an Encode request of 16 token ids parsed,
    decoded (attention_wire.encode_ask) and planned (service/plan.py), as the gRPC door does it."""
    spec = runner.spec
    assert spec is not None
    raw = build_request([np.arange(TOKENS, dtype=np.int64) % spec.vocab_size], EncodeOptions(),
                        request_id="wake-cost").SerializeToString()

    def run() -> None:
        plan(encode_ask(pb.EncodeRequest.FromString(raw), spec, config), spec, config, NAMES, response_bytes)

    return run


def python_work() -> None:
    total = 0
    for step in range(PYTHON_STEPS):
        total += step
    assert total > 0


class Worker:
    """A thread blocked on its inbox between calls, as a model thread waits for its next batch."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[float] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="wake-cost-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        torch.set_num_threads(1)  # OpenMP keeps it per thread
        while (work := self._inbox.get()) is not None:
            started = time.thread_time()
            work()
            self._outbox.put(time.thread_time() - started)

    def run(self, work: Callable[[], None]) -> float:
        self._inbox.put(work)
        return self._outbox.get()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)


def measure(work_name: str, work: Callable[[], None], gaps: Sequence[float], calls: int) -> list[Row]:
    worker = Worker()
    rows = []
    try:
        for _ in range(20):  # warm: the first calls load code and allocate
            work()
            worker.run(work)
        for gap in gaps:
            for way in ("inline", "hand-off"):
                cpu, wall = [], []
                for _ in range(calls):
                    if gap:
                        time.sleep(gap / 1e3)
                    started, cpu_started = time.perf_counter(), time.thread_time()
                    if way == "inline":
                        work()
                        cpu.append(time.thread_time() - cpu_started)
                    else:
                        cpu.append(worker.run(work))
                    wall.append(time.perf_counter() - started)
                rows.append(Row(work_name, way, gap, calls, 1e6 * statistics.median(cpu),
                                1e6 * statistics.median(wall)))
    finally:
        worker.stop()
    return rows


def table(rows: Sequence[Row]) -> str:
    base = {(r.work, r.way): r for r in rows if r.gap_ms == 0}
    lines = ["| work | way | gap ms | work CPU us | x gap 0 | call us | x gap 0 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        zero = base.get((r.work, r.way))
        cpu_x = f"{r.work_cpu_us / zero.work_cpu_us:.2f}" if zero else ""
        call_x = f"{r.call_us / zero.call_us:.2f}" if zero else ""
        lines.append(f"| {r.work} | {r.way} | {r.gap_ms:g} | {r.work_cpu_us:.0f} | {cpu_x} | {r.call_us:.0f} "
                     f"| {call_x} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.2, 1.0, 5.0], help="idle ms before a call")
    parser.add_argument("--calls", type=int, default=400, help="calls per gap, way and work")
    parser.add_argument("--work", choices=WORKS, nargs="+", default=list(WORKS))
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "wake_cost.json")
    args = parser.parse_args(argv)
    if not all(0 <= gap <= MAX_GAP_MS for gap in args.gaps):
        parser.error(f"--gaps must be in [0, {MAX_GAP_MS:g}] ms")
    if not 1 <= args.calls <= MAX_CALLS:
        parser.error(f"--calls must be in 1..{MAX_CALLS}")
    torch.set_num_threads(1)
    began = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wake-cost-") as tmp:
        runner, config = edge_runner(Path(tmp))
        works = {"forward": forward_work(runner), "plan": plan_work(runner, config), "python": python_work}
        works = {name: work for name, work in works.items() if name in args.work}
        for name, work in works.items():
            rows += measure(name, work, args.gaps, args.calls)
    print(table(rows))
    ended = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    info: dict[str, Any] = machine()
    print(f"\n{began} .. {ended}, {info.get('cpu', platform.processor())}, {info.get('cores')} cores; "
          f"JSON: {args.json}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"began": began, "ended": ended, "machine": info, "calls": args.calls,
                                     "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
