"""The KServe v2 front door against attention.v1 on one server: the same closed-loop load (one call in
flight per caller, one sequence of `--length` random ids per call, hidden states back in fp32) through
`ModelInfer` and through `Encode`, in alternating slices, so this shared machine's drift falls on
both alike. It stands in for perf_analyzer where that cannot run (glibc < 2.38, bench/RESULTS.md).

    python -m bench.kserve_bench [--concurrency 1 16 64] [--seconds 10] [--warmup 2] [--rounds 2]
                                 [--length 128] [--bundle DIR] [--json OUT]

The v1 side is `client.load.run_load` (what `python -m client bench` runs). The v2 side sends
`ModelInferRequest`s serialized up front over one grpc.aio channel, as the v1 side does, so the two
differ only in the server's front door (tritonclient's own `infer()` builds each request per call and
would add client CPU to the comparison). Bounded: rounds x concurrencies x 2 x (warmup + seconds),
plus a server start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as v2

from client.load import run_load
from model.default import ensure_default_bundle
from tests.support.server_process import ServerProcess

INFER = "/inference.GRPCInferenceService/ModelInfer"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
POOL = 256


def v2_requests(model: str, vocab: int, length: int, count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, (1, length), dtype=np.int64)
        request = v2.ModelInferRequest(model_name=model, raw_input_contents=[ids.tobytes()], outputs=[
            v2.ModelInferRequest.InferRequestedOutputTensor(name="last_hidden_state")])
        request.inputs.add(name="input_ids", datatype="INT64", shape=[1, length])
        out.append(request.SerializeToString())
    return out


async def v2_load(target: str, *, concurrency: int, seconds: float, warmup: float, length: int) -> dict[str, Any]:
    """Closed-loop ModelInfer load; seq/s, latency percentiles (ms) and the server's batch size."""
    async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
        config = await _served_config(channel)
        pool = v2_requests(config.name, int(config.parameters["vocab_size"].string_value), length, POOL)
        infer = channel.unary_unary(INFER)
        latencies: list[float] = []
        batch_sizes: list[int] = []
        errors = 0
        start = time.perf_counter()
        measure_from, end = start + warmup, start + warmup + seconds

        async def caller(index: int) -> None:
            nonlocal errors
            i = index
            while (now := time.perf_counter()) < end:
                try:
                    raw = await infer(pool[i % POOL], timeout=30)
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                finally:
                    i += concurrency
                if now >= measure_from:
                    latencies.append(time.perf_counter() - now)
                    batch_sizes.append(v2.ModelInferResponse.FromString(raw).parameters["batch_size"].int64_param)

        await asyncio.gather(*(caller(k) for k in range(concurrency)))
    lat = np.asarray(latencies) * 1e3
    return {"sequences_per_s": len(latencies) / seconds, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "batch_size": float(np.mean(batch_sizes)), "errors": errors}


async def v1_load(target: str, *, concurrency: int, seconds: float, warmup: float, length: int) -> dict[str, Any]:
    report = await run_load(target, concurrency=concurrency, duration_s=seconds, warmup_s=warmup,
                            lengths=(length, length))
    return {"sequences_per_s": report.sequences_per_s, "p50_ms": report.latency_ms["p50"],
            "p99_ms": report.latency_ms["p99"], "batch_size": report.server["batch_size"],
            "errors": sum(report.errors.values())}


async def _served_config(channel: grpc.aio.Channel) -> Any:
    """The served model's config; its name from ModelStatistics (an empty name asks for every model)."""
    stats = v2.ModelStatisticsResponse.FromString(await channel.unary_unary(
        "/inference.GRPCInferenceService/ModelStatistics")(v2.ModelStatisticsRequest().SerializeToString(),
                                                           timeout=10))
    request = v2.ModelConfigRequest(name=stats.model_stats[0].name)
    response = v2.ModelConfigResponse.FromString(await channel.unary_unary(
        "/inference.GRPCInferenceService/ModelConfig")(request.SerializeToString(), timeout=10))
    return response.config


async def run(target: str, *, concurrencies: list[int], seconds: float, warmup: float, rounds: int,
              length: int) -> list[dict[str, Any]]:
    rows = []
    for r in range(rounds):
        for c in concurrencies:
            sides = [("v1", v1_load), ("v2", v2_load)]
            if r % 2:
                sides.reverse()  # alternate which goes first
            for name, load in sides:
                result = await load(target, concurrency=c, seconds=seconds, warmup=warmup, length=length)
                rows.append({"round": r, "concurrency": c, "door": name, **result})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | door | round | seq/s | p50 ms | p99 ms | batch size | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda x: (x["concurrency"], x["door"], x["round"])):
        lines.append(f"| {row['concurrency']} | {row['door']} | {row['round']} | {row['sequences_per_s']:.1f} | "
                     f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['batch_size']:.2f} | {row['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kserve_bench", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--bundle", default="", help="model bundle (default: the built-in reference model)")
    p.add_argument("--json", default="", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not (0 < args.seconds <= 120 and 0 <= args.warmup <= 60 and 1 <= args.rounds <= 10):
        p.error("--seconds in (0, 120], --warmup in [0, 60], --rounds in 1..10")
    cache = Path(tempfile.gettempdir()) / "attention-bench-cache"  # the other benchmarks' cache
    bundle = Path(args.bundle) if args.bundle else ensure_default_bundle(cache)
    server = ServerProcess(bundle)
    try:
        rows = asyncio.run(run(server.target, concurrencies=args.concurrency, seconds=args.seconds,
                               warmup=args.warmup, rounds=args.rounds, length=args.length))
    finally:
        server.stop()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
