"""A bounded soak of `python -m service` on 127.0.0.1: steady closed-loop load for `--minutes`, the
server's RSS, fds, threads and asyncio tasks sampled once a second from inside it (bench/soak_probe.py,
in the service process and in each edge process), and the RSS slope after `--warmup-s` fitted per
minute. Issue 27: "find out whether the memory really grows".

    python -m bench.soak [--model default|faults] [--minutes 10] [--warmup-s 60] [--concurrency 16]
                         [--lengths 16:256] [--edge-processes N] [--connections N] [--leak-every N]
                         [--types] [--collect] [--tracemalloc FRAMES] [--keep DIR] [--json OUT]
                         [--server-flag=--max-batch-size=16 ...] [--env MALLOC_ARENA_MAX=2 ...]

`--model default` serves the built-in default model with random ids of uniform lengths (what
`client bench --concurrency 16 --lengths 16:256` sends); `--model faults` serves model/faults.py's
fault model with tests/reliability/test_soak.py's mix (5% RAISE, 5% split-and-retry OOM, 3% out of
vocabulary, 5% 10 ms deadlines, 5% cancelled within 10 ms; lengths 1..64). `--leak-every N` makes one
call in N carry the fault model's LEAK sentinel (1 MiB kept per call): the positive control, whose
slope this must show. Bounded: --minutes is at most 30, the load stops then, the server gets SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import to_tensor
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
MAX_MINUTES = 30.0
SITECUSTOMIZE = "import bench.soak_probe\nbench.soak_probe.start()\n"


def slope_mb_per_min(t: np.ndarray, rss_mb: np.ndarray) -> float:
    """Least-squares slope of the points less the 5% farthest from a first fit (RELIABILITY.md M-01)."""
    if len(t) < 3:
        return float("nan")
    a, b = np.polyfit(t, rss_mb, 1)
    keep = np.argsort(np.abs(rss_mb - (a * t + b)))[: max(3, int(len(t) * 0.95))]
    return float(np.polyfit(t[keep], rss_mb[keep], 1)[0] * 60)


def summarise(rows: list[dict[str, Any]], t0: float, warmup_s: float) -> dict[str, Any]:
    """One process's figures: the slope after the warm-up, per-minute high-water marks, and the ranges of
    fds, threads and tasks after the warm-up."""
    t = np.array([r["t"] - t0 for r in rows])
    rss = np.array([r["rss_kb"] / 1024 for r in rows])
    after = t >= warmup_s
    minutes = {}
    for m in range(int(t.max() // 60) + 1):
        inside = (t >= m * 60) & (t < (m + 1) * 60)
        if inside.any():
            minutes[m] = round(float(rss[inside].max()), 1)
    later = [r for r, keep in zip(rows, after, strict=True) if keep]

    def span(key: str) -> list[int]:
        values = [r[key] for r in later if r.get(key) is not None]
        return [min(values), max(values)] if values else []

    half = t >= warmup_s + (t.max() - warmup_s) / 2
    return {
        "samples": len(rows),
        "rss_mb_at_warmup_end": round(float(rss[after][0]), 1) if after.any() else None,
        "rss_mb_end": round(float(rss[-1]), 1),
        "rss_slope_mb_per_min_after_warmup": round(slope_mb_per_min(t[after], rss[after]), 2),
        "rss_slope_mb_per_min_second_half": round(slope_mb_per_min(t[half], rss[half]), 2),
        "rss_max_mb_per_minute": minutes,
        "fds": span("fds"), "threads": span("threads"), "tasks": span("tasks"),
        "heap_used_mb": [round(r["heap_used_kb"] / 1024, 1) for r in (later[0], later[-1])] if later and
        "heap_used_kb" in later[0] else None,
        "heap_free_mb": [round(r["heap_free_kb"] / 1024, 1) for r in (later[0], later[-1])] if later and
        "heap_free_kb" in later[0] else None,
        "mmapped_mb": [round(r["mmapped_kb"] / 1024, 1) for r in (later[0], later[-1])] if later and
        "mmapped_kb" in later[0] else None,
        "gc_objects": [r["gc_objects"] for r in later if "gc_objects" in r][:1] +
                      [r["gc_objects"] for r in later if "gc_objects" in r][-1:],
    }


def fault_call(rng: np.random.Generator, n: int, length: int, leak_every: int) -> tuple[np.ndarray, float, bool]:
    """The soak's fault mix (here and in tests/reliability/test_soak.py) for a caller's `n`th call: `length`
    token ids of model/faults.py's fault model carrying LEAK every `leak_every`th call, else RAISE (5%), an
    OOM on batches above one (5%) or an id out of the vocabulary (3%); then a 10 ms deadline for 5% (else
    10 s) and a cancellation within 10 ms for 5%. Returns (ids, timeout, cancel)."""
    from model import faults

    ids = rng.integers(1, faults.LEAK, size=length)
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
    return ids, timeout, bool(rng.random() < 0.05)


async def drive(target: str, *, model: str, seconds: float, concurrency: int, lengths: tuple[int, int],
                vocab: int, leak_every: int, seed: int, connections: int = 1) -> dict[str, int]:
    """Closed-loop Encode calls from `concurrency` callers, spread over `connections` gRPC connections,
    for `seconds`; the status codes counted."""
    from model import faults

    codes: dict[str, int] = {}
    leaked = [0]  # LEAK calls answered OK: each kept 1 MiB in the server (once per forward)
    end = time.monotonic() + seconds
    rng = np.random.default_rng(seed)
    # A local subchannel pool per channel: otherwise grpc shares one connection between channels (client/load.py).
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]
    try:
        stubs = [attention_pb2_grpc.AttentionServiceStub(channel) for channel in channels]

        async def caller(stub: attention_pb2_grpc.AttentionServiceStub) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                length = int(rng.integers(lengths[0], lengths[1] + 1))
                timeout = 30.0
                cancel = False
                if model == "faults":
                    ids, timeout, cancel = fault_call(rng, n, length, leak_every)
                else:
                    ids = rng.integers(0, vocab, size=length)
                request = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(ids.astype(np.int64)))])
                call = stub.Encode(request, timeout=timeout)
                if cancel:
                    asyncio.get_running_loop().call_later(float(rng.uniform(0, 0.01)), call.cancel)
                try:
                    await call
                    code = "OK"
                    if model == "faults" and ids[0] == faults.LEAK:
                        leaked[0] += 1
                except grpc.aio.AioRpcError as error:
                    code = error.code().name
                except asyncio.CancelledError:
                    if not call.cancelled():
                        raise
                    code = "CANCELLED"
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(caller(stubs[i % connections]) for i in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    if leak_every:
        codes["LEAK_OK (of OK)"] = leaked[0]
    return codes


def read_rows(directory: Path) -> dict[int, list[dict[str, Any]]]:
    rows = {}
    for path in sorted(directory.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        if lines:
            rows[int(path.stem)] = lines
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("default", "faults"), default="default")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--lengths", default="", help="LOW:HIGH (default 16:256, faults 1:64)")
    parser.add_argument("--edge-processes", type=int, default=0)
    parser.add_argument("--leak-every", type=int, default=0)
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--server-flag", action="append", default=[])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    parser.add_argument("--connections", type=int, default=0,
                        help="gRPC connections, callers spread over them (default: one per edge process, else 1)")
    parser.add_argument("--tracemalloc", type=int, default=0, help="frames; tracemalloc in the server (slow)")
    parser.add_argument("--types", action="store_true", help="write the gc objects' growth by type (diagnosis)")
    parser.add_argument("--collect", action="store_true", help="a full gc.collect() in the server once a minute, "
                        "recording what it freed (diagnosis)")
    parser.add_argument("--keep", default="", help="keep the probe files and server log in this directory")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {MAX_MINUTES:.0f}]")
    low, high = (int(n) for n in (args.lengths or ("1:64" if args.model == "faults" else "16:256")).split(":"))

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="soak-"))
    probe_dir, site_dir = work / "probe", work / "site"
    probe_dir.mkdir(parents=True, exist_ok=True)
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if args.model == "faults":
        from model.faults import build_fault_bundle

        bundle = work / "faults"
        if not bundle.exists():
            build_fault_bundle(bundle)
        flags = []
    else:
        from model.default import ensure_default_bundle
        from service.config import ServiceConfig

        bundle = ensure_default_bundle(ServiceConfig().bundle_cache_dir)  # where `--model ''` builds it
        flags = []
    if args.edge_processes:
        flags += ["--edge-processes", str(args.edge_processes)]
    flags += ["--log-level", "warning", *args.server_flag]
    env = {"PYTHONPATH": os.pathsep.join([str(site_dir), str(ROOT)]), "SOAK_PROBE_DIR": str(probe_dir)}
    env.update(dict(item.split("=", 1) for item in args.env))
    if args.tracemalloc:
        env["SOAK_TRACEMALLOC"] = str(args.tracemalloc)
    if args.types:
        env["SOAK_TYPES"] = "1"
    if args.collect:
        env["SOAK_COLLECT"] = "1"
    connections = args.connections or max(1, args.edge_processes)

    command = " ".join(["python -m bench.soak", *(argv if argv is not None else sys.argv[1:])])
    load1 = os.getloadavg()[0]
    server = ServerProcess(bundle, *flags, directory=work / "server", env=env, timeout=300)
    try:
        info = attention_pb2_grpc.AttentionServiceStub(grpc.insecure_channel(server.target))
        vocab = info.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
        t0 = time.time()
        print(f"soak: {command}: server pid {server.pid} on {server.target}, vocab {vocab}, "
              f"{args.minutes:g} min", flush=True)
        codes = asyncio.run(drive(server.target, model=args.model, seconds=args.minutes * 60,
                                  concurrency=args.concurrency, lengths=(low, high), vocab=vocab,
                                  leak_every=args.leak_every, seed=args.seed, connections=connections))
        load2 = os.getloadavg()
    finally:
        server.stop()
    rows = read_rows(probe_dir)
    main_pid = server.pid
    processes = {("service" if pid == main_pid else f"edge {pid}"): summarise(r, t0, args.warmup_s)
                 for pid, r in rows.items() if r[-1]["t"] > t0}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "command": command,
        "calls": sum(v for k, v in codes.items() if not k.startswith("LEAK")), "codes": codes,
        "load_average_start_1min": round(load1, 2),
        "load_average_end_1_5_15": [round(x, 2) for x in load2], "processes": processes,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
