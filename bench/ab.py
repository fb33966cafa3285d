"""A/B two server variants under the same load, in alternating slices, so that this shared machine's
drift (+-30% between minutes) falls on both alike; the per-round ratio B/A and its median count.

    python -m bench.ab [--lengths 128 128] [--concurrency 64] [--rounds 8] [--seconds 4]
                       [--a-flag F ...] [--b-flag F ...] [--a-source DIR] [--b-source DIR]
                       [--a-prelude CODE] [--b-prelude CODE] [--keep-servers]

A variant is server flags (`--a-flag=--max-batch-tokens=4096`), a source tree (`--a-source`: another
checkout, e.g. `git worktree add ../old HEAD~1`) and Python run in the server process before it
starts (`--b-prelude 'import service.batching.choice as w; w.AGE_POWER = 0'`, for experiments that have no
flag). Every round starts a fresh server of each variant (in alternating order) and runs one slice on
each, alternating which goes first: two processes of the same code differ here by up to 6% for as
long as they live (A/A runs with one pair of servers kept for 8 rounds gave B/A 1.057, 1.049 and
0.978, see bench/RESULTS.md), so a pair kept for the whole run would bias the ratio by as much.
Even with fresh servers an 8-round median is good to about +-7% on this machine. Each side also
reports the server's CPU per call (warm-up included), all threads and the event loop's alone, from
/proc: a per-call cost moves those where it drowns in the throughput's noise.
`--keep-servers` keeps one pair (faster; for effects well above that). The idle server costs nothing.
Bounded: rounds x (2 x (seconds + 1) + two start-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.service_bench import _choices as describe
from bench.service_bench import served_choices
from client.load import run_load
from model.default import ensure_default_bundle
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def start(model: Path, source: Path, prelude: str, flags: list[str], timeout: float = 300) -> ServerProcess:
    return ServerProcess(model, "--metrics-port", "-1", "--log-level", "warning", *flags, timeout=timeout, pinned=False,
                         prelude=prelude or "pass", source=source)


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process `pid` and of its main thread, the event loop's."""
    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def default_bundle(source: Path) -> Path:
    """The built-in reference bundle as `source`'s code scripts it: model.pt holds the model's code, so a
    variant whose model/ differs must not run the other's bundle (the cache is keyed by that code)."""
    cache = Path(tempfile.gettempdir()) / "attention-bench-cache"
    if source.resolve() == ROOT:
        return ensure_default_bundle(cache)
    code = f"from model.default import ensure_default_bundle as e; print(e({str(cache)!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=source, env={**os.environ, "PYTHONPATH": str(source)},
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def stop(sides: dict[str, ServerProcess]) -> None:
    for server in sides.values():
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[128, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per slice (1 s warm-up)")
    parser.add_argument("--model", type=Path, default=None, help="bundle (default: the built-in reference)")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-flag", action="append", default=[], help="server flag (repeat)")
        parser.add_argument(f"--{side}-source", type=Path, default=ROOT, help="source tree to run")
        parser.add_argument(f"--{side}-prelude", default="", help="Python run in the server before it starts")
    parser.add_argument("--keep-servers", action="store_true",
                        help="one server per variant for all rounds rather than a fresh pair each round")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 50 and 0 < args.seconds <= 60):
        parser.error("--rounds must be in 1..50 and --seconds in (0, 60]")
    models = {side: args.model or default_bundle(getattr(args, f"{side}_source")) for side in ("a", "b")}

    def start_side(side: str) -> ServerProcess:
        return start(models[side], getattr(args, f"{side}_source"), getattr(args, f"{side}_prelude"),
                     getattr(args, f"{side}_flag"))

    rows: dict[str, list[tuple[float, float, float, float, float]]] = {"a": [], "b": []}
    sides: dict[str, ServerProcess] = {}
    try:
        for round_ in range(args.rounds):
            order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
            for side in order:
                if side not in sides:
                    sides[side] = start_side(side)
                    served = served_choices(sides[side].target)
                    print(f"round {round_} {side.upper()}: {describe(served)}", flush=True)
                    for key in ("workers_reason", "batch_reason"):
                        if served[key].startswith("measured"):
                            print(f"  {served[key]}", flush=True)
            for side in order:
                server = sides[side]
                cpu_before = cpu_s(server.pid)
                r = asyncio.run(run_load(server.target, concurrency=args.concurrency, duration_s=args.seconds,
                                         warmup_s=1.0, lengths=tuple(args.lengths), seed=round_, pool_size=512))
                calls = r.requests + r.warmup_requests
                cpu_after = cpu_s(server.pid)
                cpu, loop = (1e3 * (cpu_after[i] - cpu_before[i]) / calls for i in (0, 1))
                rows[side].append((r.sequences_per_s, r.latency_ms["p50"], r.latency_ms["p99"], cpu, loop))
            if not args.keep_servers:
                stop(sides)
                sides = {}
    finally:
        stop(sides)
    for side in ("a", "b"):
        a = np.asarray(rows[side])
        print(f"{side.upper()}: seq/s {' '.join(f'{x:.1f}' for x in a[:, 0])}; median {np.median(a[:, 0]):.1f}, "
              f"p99/p50 {np.median(a[:, 2] / a[:, 1]):.2f}; server CPU ms/call {np.median(a[:, 3]):.2f}, "
              f"event loop {np.median(a[:, 4]):.3f}")
    ratio = np.asarray(rows["b"])[:, 0] / np.asarray(rows["a"])[:, 0]
    print(f"B/A seq/s per round: {' '.join(f'{x:.3f}' for x in ratio)}; median {np.median(ratio):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
