"""The service against its own ceiling, measured in one run on one machine (`make bench`).

1. The ceiling: the bundle called in process (no gRPC), at its best batch size, with the threads and
   precision the server uses: fixed-length batches, and length-sorted batches of the mixed workload at
   the best token budget. Also the batch-1 latency, the bar for concurrency 1. The search runs once;
   then each load run's bar is measured again right before and right after it, with the CPU that bar
   cost a sequence (this process's, all threads: measured, not taken as every core), and the target
   rows run `--rounds` times (this shared machine's forward time drifts by +-30% between minutes).
2. The service: `python -m service` in a subprocess on 127.0.0.1, under closed-loop load from this
   process (client/load.py: grpc.aio callers, one call in flight each, requests serialized up front),
   at several concurrencies, fixed and mixed lengths, batching on and off, fp32 (and bf16 with --bf16).
3. The naive unbatched server (bench/naive_server.py: grpc.aio, one forward per call on one worker
   thread, the same bundle, precision and threads) beside each batching-on arm, under the same load
   at the same concurrencies, lengths and rounds, run in turn with the service (who goes first
   alternates by round; each run bracketed by the bar), so that drift falls on both (`--no-naive`
   leaves it out).
4. A table with the ratios the performance issues set as targets (service / ceiling and service /
   naive; at the highest concurrency the server's whole CPU a sequence, all its threads, against the
   bar's), JSON, and two plots.

Bounded: every load run has a fixed duration; the whole default run takes about 13 minutes on 2 cores
(`--quick`: about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.naive_server import NaiveProcess
from client.load import BenchReport, run_load
from model.bundle import load_bundle
from model.default import ensure_default_bundle
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
FIXED, MIXED = (128, 128), (16, 256)


@dataclass(frozen=True)
class Ceiling:
    precision: str
    fixed_seq_s: float
    fixed_best_batch: int
    fixed_best_workers: int
    mixed_seq_s: float
    mixed_best_budget: int
    mixed_best_workers: int
    batch1_ms_fixed: float
    batch1_ms_mixed: float


def _time(fn: Any, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def strata(sorted_values: list[int], k: int) -> list[int]:
    """`k` values of a sorted sample, one at the middle of each of `k` equal strata: their median and
    mean are the sample's (every `len // k`-th value from the first would sit half a stride low; for
    the mixed lengths that put the concurrency-1 bar about 7 tokens short)."""
    if not 1 <= k <= len(sorted_values):
        raise ValueError(f"k must be in 1..{len(sorted_values)}; got {k}")
    step = len(sorted_values) / k
    return [sorted_values[int((i + 0.5) * step)] for i in range(k)]


class InProcess:
    """The bundle called in process (no gRPC): the ceiling. `search()` finds the best batch size (fixed
    lengths), token budget (length-sorted mixed lengths) and number of workers (1, or the server's:
    that many threads running batches side by side with `threads / workers` intra-op threads each,
    as the server's model workers do) once; `measure()` then re-measures just the bar for one load
    run, so it can be taken right before and right after that run. Batch-1 latency runs alone with all
    `threads`, as the server's lone batches do."""

    def __init__(self, bundle: Path, precision: str, max_batch_size: int, threads: int, workers: int,
                 seed: int = 0) -> None:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.precision = precision
        self._module = load_bundle(bundle, dtype=dtype).module
        rng = np.random.default_rng(seed)
        self._ids = torch.from_numpy(rng.integers(0, 8192, (max_batch_size, MIXED[1])))
        self._max_batch_size = max_batch_size
        self._mixed = sorted(int(n) for n in rng.integers(MIXED[0], MIXED[1] + 1, 256))
        self._workers = sorted({1, workers})
        narrow = max(1, threads // workers)
        self._pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(narrow,))
        self.best_batch, self.best_budget, self.fixed_workers, self.mixed_workers = 16, 1024, 1, 1
        # The CPU (all of this process's threads) a sequence cost in the last `measure` above concurrency 1:
        # what the server's CPU a sequence is set against (issue 42), measured, not taken as every core.
        self.cpu_ms_per_seq = math.nan

    def close(self) -> None:
        self._pool.shutdown()

    def forward(self, lengths: list[int]) -> None:
        B, T = len(lengths), max(lengths)
        with torch.inference_mode():
            self._module(self._ids[:B, :T].contiguous(), None, torch.tensor(lengths), False, [])[0].float().cpu()

    def _seq_s(self, batches: list[list[int]], workers: int, reps: int) -> float:
        """Sequences/s of running `batches`, in turn on this thread (workers 1), or taken in turn by
        `workers` threads side by side."""
        if workers == 1:
            def run() -> None:
                for batch in batches:
                    self.forward(batch)
        else:
            def run() -> None:
                list(self._pool.map(self.forward, batches))
        return sum(map(len, batches)) / _time(run, reps)

    def _fixed(self, batch: int, workers: int) -> list[list[int]]:
        return [[FIXED[0]] * batch] * (2 * workers)

    def _sorted_batches(self, budget: int) -> list[list[int]]:
        batches: list[list[int]] = [[]]
        for n in self._mixed:  # ascending: each batch pads to its last (longest) item
            if batches[-1] and ((len(batches[-1]) + 1) * n > budget or len(batches[-1]) == self._max_batch_size):
                batches.append([])
            batches[-1].append(n)
        return batches

    def search(self) -> Ceiling:
        fixed = {(b, w): self._seq_s(self._fixed(b, w), w, reps=3 if b > 8 else 5)
                 for w in self._workers for b in (1, 4, 8, 16, 32, 64) if b <= self._max_batch_size}
        self.best_batch, self.fixed_workers = max(fixed, key=fixed.__getitem__)
        mixed = {(budget, w): self._seq_s(self._sorted_batches(budget), w, reps=1)
                 for w in self._workers for budget in (1024, 2048, 4096, 8192)}
        self.best_budget, self.mixed_workers = max(mixed, key=mixed.__getitem__)
        return Ceiling(self.precision, fixed[self.best_batch, self.fixed_workers], self.best_batch,
                       self.fixed_workers, mixed[self.best_budget, self.mixed_workers], self.best_budget,
                       self.mixed_workers, 1e3 / fixed[1, 1], self.measure(MIXED, 1))

    def measure(self, lengths: tuple[int, int], concurrency: int) -> float:
        """The bar for one load run: batch-1 latency in ms at concurrency 1, else sequences/s (and the CPU
        that cost, `cpu_ms_per_seq`).

        At concurrency 1 it is the median of single forwards over the load's lengths (for mixed
        lengths, one at the middle of each of 16 equal strata of the sorted sample), as the service's
        p50 is a median over its calls: p50 against p50."""
        self.cpu_ms_per_seq = math.nan
        if concurrency == 1:
            sample = [FIXED[0]] * 8 if lengths == FIXED else strata(self._mixed, 16)
            self.forward([sample[len(sample) // 2]])  # warm-up
            seconds = []
            for _ in range(3):
                for n in sample:
                    started = time.perf_counter()
                    self.forward([n])
                    seconds.append(time.perf_counter() - started)
            return 1e3 * float(np.median(seconds))
        if lengths == FIXED:
            batches, workers, reps = self._fixed(self.best_batch, self.fixed_workers), self.fixed_workers, 5
        else:
            batches, workers, reps = self._sorted_batches(self.best_budget), self.mixed_workers, 1
        cpu = time.process_time()
        seq_s = self._seq_s(batches, workers, reps)
        # `_time` runs the batches reps + 1 times (one warm-up); this process runs nothing else meanwhile.
        self.cpu_ms_per_seq = 1e3 * (time.process_time() - cpu) / ((reps + 1) * sum(map(len, batches)))
        return seq_s


def run_one(target: str, concurrency: int, lengths: tuple[int, int], duration: float, warmup: float,
            stream: bool = False) -> BenchReport:
    return asyncio.run(run_load(target, concurrency=concurrency, duration_s=duration, warmup_s=warmup,
                                lengths=lengths, seed=concurrency, pool_size=512, stream=stream))


CPU_KINDS = ("model", "loop", "other")


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a /proc .../stat file (a process's or one thread's), in clock ticks (10 ms)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (those that have exited too), to the
    nanosecond: its CPU-time clock (`clock_getcpuclockid`). A few calls of a tiny model cost less than one of
    /proc's clock ticks; where the clock is refused, /proc/PID/stat's ticks."""
    clock = ctypes.c_int()
    if _LIBC is not None and _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        return time.clock_gettime(clock.value)
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of process `pid`'s live threads by kind ({} without Linux's /proc): `model`, the
    threads named model-runner* in the OS and those they started, OpenMP's among them
    (service/batching/threads.py); `loop`, the main thread, which runs the event loop; `other`, the rest
    (gRPC's poller and timers, the metrics server)."""
    cpu = dict.fromkeys(CPU_KINDS, 0.0)
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            comm, seconds = (task / "comm").read_text().strip(), stat_cpu_s(task / "stat")
        except OSError:
            continue  # the thread ended meanwhile
        kind = "loop" if task.name == str(pid) else "model" if comm.startswith("model-runner") else "other"
        cpu[kind] += seconds
    return cpu


def cpu_split(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float] | None:
    """Cores (CPU s/s) each kind of thread used between two `thread_cpu_s` readings `seconds` apart."""
    if not before or not after:
        return None
    return {kind: max(0.0, after[kind] - before[kind]) / seconds for kind in CPU_KINDS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--bf16", action="store_true", help="also run the server and the ceiling in bf16")
    parser.add_argument("--quick", action="store_true",
                        help="3 s runs, concurrency 1 and 64, one round, no batching-off arm")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads for the ceiling and the server (0 = the server's default)")
    parser.add_argument("--stream", action="store_true",
                        help="callers send over one EncodeStream per connection instead of unary Encode calls")
    parser.add_argument("--workers", type=int, default=0,
                        help="the server's model workers (0 = what it measures at warm-up); the ceiling tries 1 "
                             "and this (0: the CPU default, 2 on 2+ threads)")
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for the server (repeat)")
    parser.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True,
                        help="run the naive unbatched server (bench/naive_server.py) beside the service, in turn")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each target row (batching on, lowest and highest concurrency); medians count")
    args = parser.parse_args(argv)
    load_start = _load_average()  # this machine is shared: say how busy it was
    if args.quick:
        args.duration, args.warmup, args.concurrency, args.rounds = 3.0, 1.0, [1, 64], 1
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = ensure_default_bundle(Path(tempfile.gettempdir()) / "attention-bench-cache")
    max_batch_size = 64

    from service.device import default_threads, default_workers

    threads = args.threads or default_threads()
    # The ceiling's side-by-side count, besides 1: the server's if it is given more, else the CPU default.
    workers = args.workers if args.workers > 1 else default_workers("cpu", threads)
    torch.set_num_threads(threads)
    precisions = ["fp32", "bf16"] if args.bf16 else ["fp32"]
    arms = [(p, True) for p in precisions] + ([] if args.quick else [("fp32", False)])
    # This machine is shared: the same forward varies by +-30% from one minute to the next. So the bar of
    # every load run is measured in process right before and right after it (the mean counts), and the
    # target rows (batching on, the lowest and highest concurrency) run --rounds times: read the medians.
    roofs: dict[str, InProcess] = {}
    searched: list[Ceiling] = []
    results: list[dict[str, Any]] = []
    chosen: list[dict[str, Any]] = []  # per arm: the service's worker split and budget, from its ModelInfo
    for precision, batching in arms:
        if precision not in roofs:
            print(f"ceiling search {precision} ...", flush=True)
            roofs[precision] = InProcess(bundle, precision, max_batch_size, threads, workers)
            searched.append(roofs[precision].search())
            print(f"  {searched[-1]}", flush=True)
        roof, ceiling = roofs[precision], next(c for c in searched if c.precision == precision)
        # The service as it serves: its worker split and batch budget are what it measures at warm-up,
        # unless --workers or a --server-flag sets them; the precision is the arm's.
        flags = ["--precision", precision, "--max-batch-size", str(max_batch_size if batching else 1),
                 "--torch-threads", str(threads), *(["--model-workers", str(args.workers)] if args.workers else []),
                 *args.server_flag]
        server = ServerProcess(bundle, *flags, "--log-level", "warning", pinned=False)
        chosen.append({"precision": precision, "batching": batching, **served_choices(server.target)})
        print(f"  service {precision} batching={'on' if batching else 'off'}: {_choices(chosen[-1])}", flush=True)
        naive = None
        try:
            if batching and args.naive:  # the same model, precision and threads, one forward per call
                naive = NaiveProcess(bundle, "--precision", precision, "--torch-threads", str(threads))
            for lengths in (FIXED, MIXED):
                for concurrency in args.concurrency:
                    if not batching and concurrency == 1:
                        continue  # the same as batching on at concurrency 1
                    target = batching and concurrency in (min(args.concurrency), max(args.concurrency))
                    for round_ in range(args.rounds if target else 1):
                        # The service and the naive server in turn, the first of them alternating by round,
                        # each run bracketed by the bar: drift between minutes falls on both alike.
                        order = [("service", server.target, args.stream)]
                        if naive is not None:
                            order.append(("naive", naive.target, False))  # it has no EncodeStream
                        if round_ % 2:
                            order.reverse()
                        bars = [roof.measure(lengths, concurrency)]
                        bar_cpu = [roof.cpu_ms_per_seq]
                        for arm, address, stream in order:
                            ours = arm == "service"  # its threads are told apart by name (thread_cpu_s)
                            cpu_before, started = thread_cpu_s(server.pid) if ours else {}, time.monotonic()
                            report = run_one(address, concurrency, lengths, args.duration, args.warmup, stream)
                            cpu = cpu_split(cpu_before, thread_cpu_s(server.pid) if ours else {},
                                            time.monotonic() - started)
                            bars.append(roof.measure(lengths, concurrency))
                            bar_cpu.append(roof.cpu_ms_per_seq)
                            row = _row(arm, precision, batching and arm == "service", lengths, round_, bars[-2:],
                                       ceiling, report, cpu, bar_cpu[-2:])
                            results.append(row)
                            print(_line(row), flush=True)
        finally:
            if naive is not None:
                naive.stop()
            server.stop()
    for roof in roofs.values():
        roof.close()

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "workers": workers, "served": chosen,
            "calls": "EncodeStream" if args.stream else "unary Encode",
            "command": " ".join(["python -m bench.service_bench", *(argv if argv is not None else sys.argv[1:])]),
            "load_start": load_start, "load_end": _load_average()}
    payload = {"meta": meta, "ceilings": [vars(c) for c in searched], "runs": results}
    (args.out / "service_bench.json").write_text(json.dumps(payload, indent=1))
    table = markdown(meta, searched, results)
    (args.out / "service_bench.md").write_text(table)
    plot(results, args.out)
    print(table)
    return 0


def served_choices(target: str) -> dict[str, Any]:
    """What a running service chose at warm-up (GetModelInfo): its precision, worker split and batch budget."""
    import grpc

    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1 import attention_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        info = attention_pb2_grpc.AttentionServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    budget = info.batch_budget
    return {"precision": info.precision, "precision_reason": info.precision_reason,
            "model_workers": budget.model_workers, "workers_reason": budget.workers_reason,
            "max_batch_tokens": budget.max_batch_tokens, "batch_reason": budget.reason}


def _choices(served: dict[str, Any]) -> str:
    def source(reason: str) -> str:
        return "configured" if reason == "configured" else "measured" if reason.startswith("measured") else "default"

    return (f"{served['model_workers']} model workers ({source(served['workers_reason'])}), max_batch_tokens "
            f"{served['max_batch_tokens']} ({source(served['batch_reason'])})")


def _row(arm: str, precision: str, batching: bool, lengths: tuple[int, int], round_: int, bar: list[float],
         ceiling: Ceiling, report: BenchReport, server_cpu: dict[str, float] | None = None,
         bar_cpu: list[float] | None = None) -> dict[str, Any]:
    """One load run: its bar is the mean of the in-process measurements right before and after it (at
    concurrency 1, its throughput is set against the search's best batch; the bar is batch-1 ms).
    `server_cpu`: the service's cores by kind of thread over the run, warm-up included (`cpu_split`);
    `bar_cpu`: the CPU ms a sequence of those two measurements (NaN at concurrency 1)."""
    measured = [ms for ms in bar_cpu or [] if not math.isnan(ms)]
    concurrency, mean = report.concurrency, (bar[0] + bar[1]) / 2
    best = ceiling.fixed_seq_s if lengths == FIXED else ceiling.mixed_seq_s
    best1 = ceiling.batch1_ms_fixed if lengths == FIXED else ceiling.batch1_ms_mixed
    roof_seq_s = best if concurrency == 1 else mean
    return {"arm": arm, "precision": precision, "batching": batching, "lengths": list(lengths), "round": round_,
            "bar": list(bar), "ceiling_seq_s": roof_seq_s, "ratio": report.sequences_per_s / roof_seq_s,
            "batch1_ms": mean if concurrency == 1 else best1, "server_cpu": server_cpu,
            "bar_cpu_ms_per_seq": float(np.mean(measured)) if measured else None,
            **report.to_dict(samples=True)}


def _line(row: dict[str, Any]) -> str:
    lat, srv = row["latency_ms"], row["server"]
    return (f"  {row['arm']} {row['precision']} batching={'on' if row['batching'] else 'off'} lengths={row['lengths']} "
            f"c={row['concurrency']}: {row['sequences_per_s']:.1f} seq/s ({row['ratio']:.2f} of ceiling), "
            f"p50 {lat['p50']:.1f} p99 {lat['p99']:.1f} ms, batch {srv['batch_size']:.1f}, "
            f"padding {srv['padding_ratio']:.2f}, errors {row['errors'] or 0}")


def _load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def markdown(meta: dict[str, Any], ceilings: list[Ceiling], results: list[dict[str, Any]]) -> str:
    said = ", ".join(f"{when} {' '.join(f'{x:.2f}' for x in meta[f'load_{when}'])}" for when in ("start", "end")
                     if meta.get(f"load_{when}") is not None)
    served = "; ".join(f"{s['precision']} batching {'on' if s['batching'] else 'off'}: {_choices(s)}"
                       for s in meta.get("served", ()))
    lines = [f"Run {meta['date']} on {meta['machine']}; torch {meta['torch']}, {meta['threads']} threads; "
             f"the service as it chose at warm-up: {served or 'not recorded'}; the ceiling tried 1 and "
             f"{meta['workers']} workers; load over {meta['calls']} (the naive server: unary Encode); "
             f"load average {said or 'unknown'}; `{meta['command']}`", "",
             "The ceiling search (in process, once per precision, at the start):", "",
             "| precision | fixed 128 seq/s (best batch, workers) | mixed 16..256 seq/s (best budget, workers) "
             "| batch-1 ms fixed / mixed |",
             "|---|---|---|---|"]
    for c in ceilings:
        lines.append(f"| {c.precision} | {c.fixed_seq_s:.1f} ({c.fixed_best_batch}, {c.fixed_best_workers}) | "
                     f"{c.mixed_seq_s:.1f} ({c.mixed_best_budget}, {c.mixed_best_workers}) | "
                     f"{c.batch1_ms_fixed:.2f} / {c.batch1_ms_mixed:.2f} |")
    lines += _against(results)
    lines += ["", "Every run below has its bar measured in process right before and right after it (seq/s; "
              "batch-1 ms at concurrency 1); `of ceiling` is against their mean (at concurrency 1, against the "
              "search's best). `naive` is bench/naive_server.py, run in turn with the service.", "",
              "| server | precision | batching | lengths | conc. | seq/s | tokens/s | bar before / after | of ceiling "
              "| p50 ms | p90 ms | p99 ms | p99/p50 | queue ms | compute ms | batch | padding | errors "
              "| loadgen CPU s/s | server CPU s/s: model / loop / other |",
              "|" + "---|" * 20]
    for r in results:
        lat, srv = r["latency_ms"], r["server"]
        unit = " ms" if r["concurrency"] == 1 else ""
        lines.append(
            f"| {r.get('arm', 'service')} | {r['precision']} | {'on' if r['batching'] else 'off'} | "
            f"{_span(r['lengths'])} | {r['concurrency']} | "
            f"{r['sequences_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['bar'][0]:.1f} / {r['bar'][1]:.1f}{unit} | "
            f"{r['ratio']:.2f} | {lat['p50']:.1f} | {lat['p90']:.1f} | {lat['p99']:.1f} | "
            f"{lat['p99'] / lat['p50']:.2f} | "
            f"{srv['queue_ms']:.1f} | {srv['compute_ms']:.1f} | {srv['batch_size']:.1f} | "
            f"{srv['padding_ratio']:.2f} | {sum(r['errors'].values())} | {r['client_cpu']:.2f} | "
            f"{_cores(r.get('server_cpu'))} |")
    naive = {(r["precision"], tuple(r["lengths"]), r["concurrency"], r["round"]): r
             for r in results if r.get("arm") == "naive"}
    lines += ["", "Targets (issue 32): medians over the rounds, each round against its own bar and its own naive run:"]
    for key, rows in _target_rows(results).items():
        precision, lengths, concurrency = key
        name = f"{precision} {'fixed' if lengths == FIXED else 'mixed'} c{concurrency}"
        if concurrency == 1:
            over = [r["latency_ms"]["p50"] - r["batch1_ms"] for r in rows]
            compute = [r["server"]["compute_ms"] for r in rows]
            line = (f"- {name}: p50 minus in-process batch-1 latency {_median_of(over, '+.2f')} ms"
                    + (" (target <= +1.0 ms)" if lengths == FIXED else "")
                    + f"; server-side compute {_median_of(compute, '.2f')} ms, in-process batch-1 "
                    f"{_median_of([r['batch1_ms'] for r in rows], '.2f')} ms")
            paired = [(r, naive.get((*key, r["round"]))) for r in rows]
            of_naive = [r["latency_ms"]["p50"] / n["latency_ms"]["p50"] for r, n in paired if n is not None]
            if of_naive:
                line += (f"; p50 over the naive server's {_median_of(of_naive, '.2f')}"
                         + (" (target <= 1.00)" if lengths != FIXED else ""))
            lines.append(line)
        else:
            line = (f"- {name}: throughput {_median_of([r['ratio'] for r in rows], '.2f')} of the ceiling "
                    f"(target >= 0.95); p99/p50 "
                    f"{_median_of([r['latency_ms']['p99'] / r['latency_ms']['p50'] for r in rows], '.2f')}")
            split = [r["server_cpu"] for r in rows if r.get("server_cpu")]
            if split:  # where the machine went, which the ceiling has all for the model
                model, loop, other = (float(np.median([c[kind] for c in split])) for kind in CPU_KINDS)
                loadgen = float(np.median([r["client_cpu"] for r in rows]))
                line += (f"; CPU s/s (medians): the model threads {model:.2f}, the event loop {loop:.2f}, the rest "
                         f"of the server {other:.2f}, the load generator {loadgen:.2f}")
            paired = [(1e3 * sum(r["server_cpu"].values()) / r["sequences_per_s"], r["bar_cpu_ms_per_seq"])
                      for r in rows if r.get("server_cpu") and r.get("bar_cpu_ms_per_seq")]
            if paired:  # a CPU ratio: the load generator's share of the machine does not enter it
                line += (f"; CPU a sequence, the whole server against the forward in process (measured beside each "
                         f"run): {_median_of([ours for ours, _ in paired], '.2f')} ms against "
                         f"{_median_of([bar for _, bar in paired], '.2f')} ms, "
                         f"{_median_of([ours / bar for ours, bar in paired], '.2f')}x (issue 42's target <= 1.10)")
            lines.append(line)
    return "\n".join(lines) + "\n"


def _cores(cpu: dict[str, float] | None) -> str:
    return " / ".join(f"{cpu[kind]:.2f}" for kind in CPU_KINDS) if cpu else "-"


def _span(lengths: list[int]) -> str:
    low, high = lengths
    return f"{low}..{high}" if low != high else str(low)


def _against(results: list[dict[str, Any]]) -> list[str]:
    """The summary: the service (batching on) against its in-process ceiling and against the naive server,
    per precision, lengths and concurrency; medians over the rounds of ratios taken within each round."""
    pairs: dict[tuple[str, tuple[int, int], int], list[tuple[dict[str, Any], dict[str, Any] | None]]] = {}
    naive = {(r["precision"], tuple(r["lengths"]), r["concurrency"], r["round"]): r
             for r in results if r.get("arm") == "naive"}
    for r in results:
        if r.get("arm", "service") == "service" and r["batching"]:
            key = (r["precision"], tuple(r["lengths"]), r["concurrency"])
            pairs.setdefault(key, []).append((r, naive.get((*key, r["round"]))))
    if not pairs:
        return []
    lines = ["", "The service against its in-process ceiling and against the naive unbatched server "
             "(bench/naive_server.py), each run in turn with the other in the same round: seq/s at concurrency "
             "above 1, p50 ms at 1 (the ceiling there is the in-process batch-1 forward; `service / ceiling` is "
             "seq/s over seq/s, or p50 over batch-1 ms, so above 1 is better above concurrency 1 and below 1 "
             "is better at 1, likewise `service / naive`). Medians over the rounds; each ratio taken within "
             "its round:", "",
             "| precision | lengths | conc. | service | naive | ceiling | service / ceiling | service / naive |",
             "|---|---|---|---|---|---|---|---|"]
    def value(r: dict[str, Any]) -> float:
        return float(r["latency_ms"]["p50"] if r["concurrency"] == 1 else r["sequences_per_s"])

    def roof(r: dict[str, Any]) -> float:
        return float(r["batch1_ms"] if r["concurrency"] == 1 else r["ceiling_seq_s"])

    for (precision, lengths, concurrency), rows in pairs.items():
        service = [value(s) for s, _ in rows]
        ceiling = [roof(s) for s, _ in rows]
        of_ceiling = [value(s) / roof(s) for s, _ in rows]
        matched = [(s, n) for s, n in rows if n is not None]
        unit = " ms" if concurrency == 1 else ""
        if matched:
            naive_cell = _median_of([value(n) for _, n in matched], ".1f") + unit
            of_naive = _median_of([value(s) / value(n) for s, n in matched], ".2f")
        else:
            naive_cell = of_naive = "-"
        lines.append(f"| {precision} | {_span(list(lengths))} | {concurrency} | {_median_of(service, '.1f')}{unit} | "
                     f"{naive_cell} | {_median_of(ceiling, '.1f')}{unit} | {_median_of(of_ceiling, '.2f')} | "
                     f"{of_naive} |")
    return lines


def _target_rows(results: list[dict[str, Any]]) -> dict[tuple[str, tuple[int, int], int], list[dict[str, Any]]]:
    """Rows of the service's target runs (batching on; the lowest and highest concurrency), grouped by arm."""
    if not results:
        return {}
    low, high = min(r["concurrency"] for r in results), max(r["concurrency"] for r in results)
    groups: dict[tuple[str, tuple[int, int], int], list[dict[str, Any]]] = {}
    for r in results:
        if r.get("arm", "service") == "service" and r["batching"] and r["concurrency"] in (low, high):
            groups.setdefault((r["precision"], tuple(r["lengths"]), r["concurrency"]), []).append(r)
    return groups


def _median_of(values: list[float], fmt: str) -> str:
    """'median (each, ...)' or just the value when there is one."""
    each = ", ".join(format(v, fmt) for v in values)
    return format(float(np.median(values)), fmt) + (f" ({each})" if len(values) > 1 else "")


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    arms = sorted({_arm(r) for r in results})
    for arm in arms:
        server, precision, batching, lengths = arm
        rows = [r for r in results if _arm(r) == arm]
        levels = sorted({r["concurrency"] for r in rows})
        label = f"{_label(server, precision, batching)} {lengths[0]}..{lengths[1]}"
        ax.plot(levels, [np.median([r["sequences_per_s"] for r in rows if r["concurrency"] == c]) for c in levels],
                marker="o", label=label)
        if batching and server == "service":
            bars = [r["ceiling_seq_s"] for r in rows if r["concurrency"] > 1]
            ax.axhline(float(np.median(bars or [rows[0]["ceiling_seq_s"]])), linestyle=":", linewidth=1,
                       color=ax.lines[-1].get_color())
    ax.set(xscale="log", xlabel="concurrency (closed loop)", ylabel="sequences / s",
           title="Throughput vs concurrency (medians; dotted: in-process ceiling)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["concurrency"] != max(x["concurrency"] for x in results) or r["round"] or not r.get("samples_ms"):
            continue
        samples = np.sort(np.asarray(r["samples_ms"]))
        ax.plot(samples, np.arange(1, len(samples) + 1) / len(samples),
                label=f"{_label(r.get('arm', 'service'), r['precision'], r['batching'])} "
                      f"{r['lengths'][0]}..{r['lengths'][1]}")
    ax.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of calls", title="Latency CDF at the top concurrency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=120)
    plt.close(fig)


def _arm(r: dict[str, Any]) -> tuple[str, str, bool, tuple[int, int]]:
    return r.get("arm", "service"), r["precision"], r["batching"], tuple(r["lengths"])


def _label(server: str, precision: str, batching: bool) -> str:
    if server != "service":
        return f"{server} {precision}"
    return f"{precision} {'batching' if batching else 'no batching'}"


if __name__ == "__main__":
    sys.exit(main())
