"""The edge alone (issue 22): the service with a model that costs nothing, against bare Python gRPC
answering the same bytes, under the same load generator, in one run (`make bench-doors`).

    python -m bench.doors_bench [--concurrency 1 16 64 256] [--connections 1 4] [--rounds 3] [--seconds 3]
                               [--server-flag=--model-workers=1 ...] [--base-source DIR [--base-flag F ...]]
                               [--profile] [--json PATH]

Variants, each a fresh process per round on 127.0.0.1:
- `service`: `python -m service` (tests/support/server_process.py) serving a 1-layer, d_model 32 bundle
  (`EDGE_MODEL`: its forward is a fraction of a millisecond) with `ISOLATE_FLAGS` (one intra-op thread,
  one model worker), then the `--server-flag`s (which win: `--server-flag=--torch-threads=0
  --server-flag=--model-workers=0` measures the CPU defaults). With two intra-op threads OpenMP's
  pool spins between a tiny model's batches and costs more CPU per call than the whole edge
  (bench/RESULTS.md, issue 22): on a GPU that pool idles, so it is kept out of the edge's figures;
- `base` (with `--base-source`): the same from another checkout (e.g. `git worktree add ../base main`),
  with `--base-flag`s, so before and after are measured in the same run;
- `floor-aio` / `floor-sync`: a bare grpc.aio server / a sync `grpc.server` (bench/grpc_floor.py
  `FloorServer`) answering GetModelInfo and Encode with the bytes the service answered, doing no work;
  `floor-aio-hop` (asked for with `--floors`): floor-aio whose handler gets its bytes from a worker
  thread, the hand-off the service makes to its model thread; `floor-aio-anext` and `floor-aio-read`: each
  method served as client-streaming, its one message read from the request iterator or with
  `context.read()` (service/doors/message_wait.py's two ways of bounding the wait for it); `floor-uvloop`:
  floor-aio on uvloop's event loop, the loop the service runs on by default (service/event_loop.py);
The load is client/load.py's closed loop (`run_load`): one sequence of 16 token ids per call, hidden
states back in float32, `c` callers over `min(k, c)` connections for each concurrency and connection
count. Rounds interleave the variants (order rotated per point and round), so the machine's drift
falls on all alike. Per point and variant: calls/s, p50/p99, and CPU per call: the server (all
threads of its process and of any process under it, and its main thread, the event loop, from /proc,
warm-up calls included; with `--server-flag=--edge-processes=N` that main thread is the model
process's, and the edge processes count in the server's total) and the load generator (this process,
measured calls). `ratio` is the service's calls/s over floor-aio's, per round.

`--profile` adds one slice per profiled concurrency (64 by default) with py-spy sampling the service
process (`py-spy record --native`, non-idle samples only, so the counts are CPU), and splits its
samples into event loop, gRPC core, parsing/validation, batcher handoff, metrics, response building,
model and other (`PROFILE_BUCKETS`: the first frame from the innermost outwards that matches).

Bounded: rounds x points x variants x (warm-up + seconds), calls capped per slice by `--max-calls`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.ab import cpu_s
from bench.grpc_floor import FloorServer
from client.load import GET_MODEL_INFO, run_load
from client.load_calls import ENCODE
from client.messages import EncodeOptions, build_request
from model.bundle import save_bundle
from model.config import EncoderConfig
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2 as pb
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
EDGE_MODEL = EncoderConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, vocab_size=100, max_length=64)
TOKENS = 16
# The floors have no stream limit; the service's default (256 a connection) refuses some calls of 256
# callers on one connection (a caller's next call can open before its last stream is released).
ISOLATE_FLAGS = ("--torch-threads", "1", "--model-workers", "1", "--max-concurrent-streams", "1024")
FLOORS = ("floor-aio", "floor-sync", "floor-aio-hop", "floor-aio-anext", "floor-aio-read", "floor-uvloop")
MAX_SECONDS = 60.0

@dataclass(frozen=True)
class Slice:
    """One variant under one load (concurrency, connections) in one round."""

    variant: str
    concurrency: int
    connections: int
    round: int
    calls: int  # measured
    ok: int
    errors: dict[str, int]
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms: float  # per call, all the server's threads
    loop_cpu_ms: float  # per call, the server's main thread (its event loop)
    client_cpu_ms: float  # per measured call, the load generator


@dataclass
class Report:
    """What `run` measured: every slice, the medians per point and variant, and the profile."""

    settings: dict[str, Any]
    slices: list[Slice] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)

    def points(self) -> list[tuple[int, int]]:
        return sorted({(s.concurrency, s.connections) for s in self.slices})

    def summary(self) -> list[dict[str, Any]]:
        """Per point and variant: medians over rounds, and the ratio to floor-aio (median of rounds)."""
        rows = []
        for c, k in self.points():
            here = [s for s in self.slices if (s.concurrency, s.connections) == (c, k)]
            floor = {s.round: s.calls_per_s for s in here if s.variant == "floor-aio"}
            for variant in dict.fromkeys(s.variant for s in here):
                mine = [s for s in here if s.variant == variant]
                ratios = [s.calls_per_s / floor[s.round] for s in mine if floor.get(s.round)]
                rows.append({
                    "variant": variant, "concurrency": c, "connections": k, "rounds": len(mine),
                    "calls_per_s": _median(s.calls_per_s for s in mine),
                    "calls_per_s_rounds": [round(s.calls_per_s, 1) for s in mine],
                    "p50_ms": _median(s.p50_ms for s in mine), "p99_ms": _median(s.p99_ms for s in mine),
                    "server_cpu_ms": _median(s.server_cpu_ms for s in mine),
                    "loop_cpu_ms": _median(s.loop_cpu_ms for s in mine),
                    "client_cpu_ms": _median(s.client_cpu_ms for s in mine),
                    "ratio_to_floor_aio": _median(ratios) if ratios else None,
                    "ok": sum(s.ok for s in mine), "calls": sum(s.calls for s in mine),
                    "errors": dict(sum((Counter(s.errors) for s in mine), Counter())),
                })
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "summary": self.summary(),
                "slices": [vars(s) for s in self.slices], "profile": self.profile}

    def format(self) -> str:
        lines = ["| callers | conns | variant | calls/s (median) | rounds | / floor-aio | p50 ms | p99 ms | "
                 "server CPU ms/call | event loop ms/call | load gen CPU ms/call | errors |",
                 "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.summary():
            ratio = "" if r["ratio_to_floor_aio"] is None else f"{r['ratio_to_floor_aio']:.2f}"
            errors = ", ".join(f"{code} {n}" for code, n in sorted(r["errors"].items())) or "none"
            lines.append(
                f"| {r['concurrency']} | {r['connections']} | {r['variant']} | {r['calls_per_s']:,.0f} | "
                f"{', '.join(f'{x:.0f}' for x in r['calls_per_s_rounds'])} | {ratio} | {r['p50_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {r['server_cpu_ms']:.3f} | {r['loop_cpu_ms']:.3f} | "
                f"{r['client_cpu_ms']:.3f} | {errors} |")
        for variant, prof in self.profile.items():
            lines += ["", f"Profile of {variant}: {prof['calls']} calls in {prof['seconds']:g} s "
                      f"({prof['calls_per_s']:,.0f} calls/s under the profilers), "
                      f"{prof['cpu_ms_per_call']:.3f} ms CPU per call", "", "| thread | CPU ms/call |", "|---|---:|"]
            lines += [f"| {name} | {ms:.3f} |" for name, ms in prof["threads_cpu_ms_per_call"].items()]
            for tool in ("pyspy", "perf"):
                for group, shares in prof.get(tool, {}).items():
                    lines += ["", f"{tool}, {group}: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())]
        return "\n".join(lines)


def _median(values: Any) -> float:
    return float(np.median(list(values)))


def build_edge_bundle(directory: Path) -> Path:
    """The trivial bundle (`EDGE_MODEL`, seed 0) under `directory`."""
    path = directory / "edge"
    save_bundle(Encoder(EDGE_MODEL).init_weights(0), path, name="edge", version="1", source="seed:0")
    return path


def service_answers(target: str) -> dict[str, bytes]:
    """The bytes the service answers to GetModelInfo and to one 16-token Encode: what the floors send."""
    request = build_request([np.arange(TOKENS, dtype=np.int64) % EDGE_MODEL.vocab_size], EncodeOptions(),
                            request_id="bench-0")
    with grpc.insecure_channel(target) as channel:
        info = channel.unary_unary(GET_MODEL_INFO)(pb.GetModelInfoRequest().SerializeToString(), timeout=30)
        encoded = channel.unary_unary(ENCODE)(request.SerializeToString(), timeout=30)
    return {GET_MODEL_INFO: info, ENCODE: encoded}


class Variants:
    """The servers of one round: started together, stopped together."""

    def __init__(self, names: Sequence[str], bundle: Path, flags: dict[str, list[str]], sources: dict[str, Path],
                 answers: dict[str, bytes] | None) -> None:
        self.servers: dict[str, ServerProcess | FloorServer] = {}
        try:
            for name in names:
                if name in FLOORS:
                    assert answers is not None
                    self.servers[name] = FloorServer(name.removeprefix("floor-"), answers)
                else:
                    self.servers[name] = ServerProcess(bundle, "--log-level", "warning", *ISOLATE_FLAGS, *flags[name],
                                                       source=sources[name], timeout=300)
            for server in self.servers.values():
                warm(server.target)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def warm(target: str) -> None:
    """An unmeasured load on a fresh server: TorchScript specialises the forward to the calls' shapes
    over its first runs (a second or more of CPU, which would land in the first slice)."""
    for concurrency in (1, 16):
        asyncio.run(run_load(target, concurrency=concurrency, duration_s=0.5, lengths=(TOKENS, TOKENS), timeout=30))


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """`bench.ab.cpu_s` over `pid` and every process under it (a server that runs its edge in several
    processes), and the CPU seconds of `pid`'s main thread."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier and child not in tree]
        tree.update(frontier)
    total, loop = cpu_s(pid)
    for other in tree - {pid}:
        with contextlib.suppress(OSError):
            total += cpu_s(other)[0]
    return total, loop


def one_slice(server: ServerProcess | FloorServer, variant: str, concurrency: int, connections: int, round_: int,
              seconds: float, warmup: float, max_calls: int | None) -> Slice:
    before = tree_cpu_s(server.pid)
    r = asyncio.run(run_load(server.target, concurrency=concurrency, connections=connections, duration_s=seconds,
                             max_requests=max_calls, warmup_s=warmup, lengths=(TOKENS, TOKENS), seed=round_,
                             pool_size=256, timeout=30))
    after = tree_cpu_s(server.pid)
    served = max(r.requests + r.warmup_requests, 1)
    return Slice(variant, concurrency, connections, round_, r.requests, r.ok, dict(r.errors), r.requests_per_s,
                 r.latency_ms["p50"], r.latency_ms["p99"], 1e3 * (after[0] - before[0]) / served,
                 1e3 * (after[1] - before[1]) / served, 1e3 * r.client_cpu_s / max(r.requests, 1))


# -- the profile ---------------------------------------------------------------------------------------------

# Where a Python-level sample (py-spy) goes: the innermost frame that matches one of these decides (a
# frame is "function (file:line)"). A sample whose innermost frame is asyncio's `Handle._run` ran in C
# code a callback called: grpc.aio's Cython (cygrpc) or asyncio's C task machinery (`perf` splits those).
PROFILE_BUCKETS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("metrics", r"prometheus_client/|service/metrics\.py|service/grpc_metrics\.py"),
    ("response building", r"^(fill_tensor|_response|encode_response|check_representable) |service/output_range\.py"),
    ("parsing/validation", r"service/plan\.py|^(parse|from_tensor|ask_of|encode_ask|_input) "),
    ("batcher handoff", r"service/batching/|^(Edge|Calls)\.compute "),
    ("handler glue", r"service/(edge|servicer|kserve|security)\.py|service/doors/"),
    ("model", r"service/runner\.py|torch/"),
    ("gRPC (Python)", r"grpc/"),
    ("event loop", r"asyncio/|selectors\.py"),
))
CALLBACK_LEAF = "gRPC core + asyncio C (callbacks)"
BUCKETS = (*(name for name, _ in PROFILE_BUCKETS), CALLBACK_LEAF, "other")


def bucket_of(stack: Sequence[str]) -> str:
    """The bucket of one py-spy sample, `stack` ordered from the outermost frame to the innermost."""
    if stack and stack[-1].startswith("Handle._run "):
        return CALLBACK_LEAF
    for frame in reversed(stack):
        for name, pattern in PROFILE_BUCKETS:
            if pattern.search(frame):
                return name
    return "other"


def split_pyspy(raw: str) -> dict[str, Counter[str]]:
    """py-spy's raw output (with --threads) -> per thread name, samples per bucket."""
    threads: dict[str, Counter[str]] = {}
    for line in raw.splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        first, *frames = stack_text.split(";")
        thread = first.split("): ", 1)[1] if first.startswith("thread (") and "): " in first else "?"
        threads.setdefault(thread, Counter())[bucket_of(frames)] += int(count_text)
    return threads


def split_perf(script: str, main_tid: int) -> dict[str, Counter[str]]:
    """`perf script -F tid,ip,dso` -> samples per shared object, for the main thread and the others."""
    out: dict[str, Counter[str]] = {"event loop thread": Counter(), "other threads": Counter()}
    for line in script.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        dso = Path(parts[-1].strip("()")).name if parts[-1].startswith("(") else "?"
        dso = re.sub(r"\.cpython-\d+.*\.so$|\.so[.\d]*$", "", dso) or "?"
        out["event loop thread" if int(parts[0]) == main_tid else "other threads"][dso] += 1
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds) of every thread of `pid`, from /proc."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            threads[int(tid)] = (stat[stat.index("(") + 1: stat.rindex(")")],
                                 (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return threads


def _shares(counter: Counter[str], limit: int = 8) -> dict[str, float]:
    total = max(sum(counter.values()), 1)
    top = dict(counter.most_common(limit))
    rest = sum(counter.values()) - sum(top.values())
    return {**{k: v / total for k, v in top.items()}, **({"(rest)": rest / total} if rest else {})}


def profile_service(server: ServerProcess, concurrency: int, seconds: float, warmup: float) -> dict[str, Any]:
    """One slice with the service's CPU split three ways: per thread (/proc, exact), per Python
    bucket (py-spy, sampling without stopping the process, so Python frames only) and per shared
    object (perf, when the kernel lets it sample: native code, gRPC core's included)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    perf = shutil.which("perf")
    duration = max(1, round(seconds))
    with tempfile.TemporaryDirectory(prefix="edge-profile-") as tmp:
        spy_out, perf_out = Path(tmp) / "pyspy.txt", Path(tmp) / "perf.data"
        tools = [subprocess.Popen([spy, "record", "--pid", str(server.pid), "--rate", "100", "--duration",
                                   str(duration), "--format", "raw", "--threads", "--nonblocking",
                                   "--output", str(spy_out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
        if perf:
            tools.append(subprocess.Popen([perf, "record", "-F", "499", "-p", str(server.pid), "-o", str(perf_out),
                                           "--", "sleep", str(duration)], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT))
        try:
            time.sleep(0.5)  # the tools attach; the load outlasts their recording on both sides
            before, calls_before = thread_cpu(server.pid), server.started()
            r = asyncio.run(run_load(server.target, concurrency=concurrency, duration_s=duration + 1.0,
                                     warmup_s=warmup, lengths=(TOKENS, TOKENS), pool_size=256, timeout=30))
            after, calls = thread_cpu(server.pid), server.started() - calls_before
            logs = [tool.communicate(timeout=120)[0].decode(errors="replace") for tool in tools]
        finally:
            for tool in tools:
                if tool.poll() is None:
                    tool.kill()
                    tool.wait()
        result: dict[str, Any] = {"concurrency": concurrency, "seconds": duration + 1.0 + warmup,
                                  "calls": int(calls), "calls_per_s": r.requests_per_s}
        per_call = {tid: 1e3 * (after[tid][1] - before.get(tid, (name, 0.0))[1]) / max(calls, 1)
                    for tid, (name, _) in after.items()}
        if tools[0].returncode == 0 and spy_out.exists():
            raw = spy_out.read_text()
            names = dict(re.findall(r"^thread \((\d+)\): ([^;]+);", raw, re.M))
            result["pyspy"] = {thread: _shares(c) for thread, c in split_pyspy(raw).items()
                               if sum(c.values()) >= 5}
        else:
            names = {}
            result["pyspy_error"] = logs[0][-500:]
        result["threads_cpu_ms_per_call"] = {
            f"{names.get(str(tid), after[tid][0])} ({tid})": round(ms, 4)
            for tid, ms in sorted(per_call.items(), key=lambda kv: -kv[1]) if ms >= 0.005}
        result["cpu_ms_per_call"] = sum(per_call.values())
        if perf and tools[1].returncode == 0 and perf_out.exists():
            script = subprocess.run([perf, "script", "-i", str(perf_out), "-F", "tid,ip,dso"], capture_output=True,
                                    text=True, timeout=120).stdout
            result["perf"] = {group: _shares(c) for group, c in split_perf(script, server.pid).items()}
        elif perf:
            result["perf_error"] = logs[1][-500:]
    return result


# -- the run -------------------------------------------------------------------------------------------------


def run(*, concurrencies: Sequence[int], connections: Sequence[int], rounds: int, seconds: float, warmup: float,
        max_calls: int | None, variants: Sequence[str], flags: dict[str, list[str]], sources: dict[str, Path],
        profile: Sequence[int] = (), progress: bool = True) -> Report:
    points = sorted({(c, min(k, c)) for c in concurrencies for k in connections})
    report = Report(settings={
        "model": {"d_model": EDGE_MODEL.d_model, "n_layers": EDGE_MODEL.n_layers, "n_heads": EDGE_MODEL.n_heads,
                  "d_ff": EDGE_MODEL.d_ff}, "tokens_per_call": TOKENS, "points": points, "rounds": rounds,
        "seconds": seconds, "warmup_s": warmup, "max_calls": max_calls, "variants": list(variants),
        "flags": {k: [*ISOLATE_FLAGS, *v] for k, v in flags.items() if k in variants},
        "sources": {k: str(v) for k, v in sources.items() if k in variants},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(),
    })
    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        bundle = build_edge_bundle(Path(tmp))
        answers = None
        if any(v in FLOORS for v in variants):
            first = ServerProcess(bundle, "--log-level", "warning", *ISOLATE_FLAGS, timeout=300)
            try:
                answers = service_answers(first.target)
            finally:
                first.stop()
        for round_ in range(rounds):
            servers = Variants(variants, bundle, flags, sources, answers)
            try:
                for p, (c, k) in enumerate(points):
                    shift = (round_ + p) % len(variants)
                    for variant in [*variants[shift:], *variants[:shift]]:
                        s = one_slice(servers.servers[variant], variant, c, k, round_, seconds, warmup, max_calls)
                        report.slices.append(s)
                        if progress:
                            print(f"round {round_ + 1}/{rounds} c{c} x{k} {variant}: {s.calls_per_s:,.0f} calls/s, "
                                  f"server {s.server_cpu_ms:.3f} ms/call", file=sys.stderr, flush=True)
            finally:
                servers.stop()
        for c in profile:
            for variant in (v for v in variants if v not in FLOORS):
                one = Variants([variant], bundle, flags, sources, None)
                try:
                    server = one.servers[variant]
                    assert isinstance(server, ServerProcess)
                    report.profile[f"{variant} c{c}"] = profile_service(server, c, seconds, warmup)
                finally:
                    one.stop()
    report.settings["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report.settings["load_average_end"] = os.getloadavg()
    return report


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
            "load_average_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.doors_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 4],
                        help="connections the callers share (at most one per caller)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per slice")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds per slice (not measured)")
    parser.add_argument("--max-calls", type=int, default=None, help="measured calls per slice at most")
    parser.add_argument("--floors", nargs="*", choices=FLOORS, default=list(FLOORS[:2]),
                        help="floor-aio-hop: floor-aio whose handler awaits a worker thread; floor-aio-anext / "
                        "-read: served as client-streaming, the message read from the iterator / with read(); "
                        "floor-uvloop: floor-aio on uvloop (default: aio, sync)")
    parser.add_argument("--server-flag", action="append", default=[], help="a flag for the service (repeat)")
    parser.add_argument("--base-source", type=Path, default=None, help="another checkout, measured as `base`")
    parser.add_argument("--base-flag", action="append", default=[], help="a flag for the base service (repeat)")
    parser.add_argument("--profile", type=int, nargs="*", default=None, metavar="CALLERS",
                        help="profile the service(s) with py-spy at these concurrencies (bare: 64)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "doors_bench.json")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 20 and 0 < args.seconds <= MAX_SECONDS and 0 <= args.warmup <= MAX_SECONDS):
        parser.error(f"--rounds must be in 1..20, --seconds in (0, {MAX_SECONDS:g}], --warmup in [0, {MAX_SECONDS:g}]")
    if any(not 1 <= c <= 1024 for c in args.concurrency) or any(k < 1 for k in args.connections):
        parser.error("--concurrency must be in 1..1024 and --connections >= 1")
    variants = ["service", *(["base"] if args.base_source else []), *args.floors]
    flags = {"service": args.server_flag, "base": args.base_flag}
    sources = {"service": ROOT, "base": args.base_source or ROOT}
    profile = [] if args.profile is None else (args.profile or [64])
    report = run(concurrencies=args.concurrency, connections=args.connections, rounds=args.rounds,
                 seconds=args.seconds, warmup=args.warmup, max_calls=args.max_calls, variants=variants,
                 flags=flags, sources=sources, profile=profile)
    print(report.format())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report.to_dict(), indent=1))
    print(f"\n{report.settings['started']} .. {report.settings['ended']}, {report.settings['machine']['cpu']}, "
          f"{report.settings['machine']['cores']} cores, load average at start "
          f"{' '.join(f'{x:.2f}' for x in report.settings['machine']['load_average_start'])}, at end "
          f"{' '.join(f'{x:.2f}' for x in report.settings['load_average_end'])}; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
