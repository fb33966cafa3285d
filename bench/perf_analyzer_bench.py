"""perf_analyzer 2.60.0 on the KServe v2 door beside `python -m client bench` on attention.v1, the same
load on one server: one sequence of `--length` random ids per call, `--requests` calls at each
concurrency (a fixed count, after a short unmeasured warm-up), hidden states and the mean-pooled vector
back in fp32 (perf_analyzer asks for every output the metadata lists; the server runs without the
attention output, so that is last_hidden_state and pooled; the client asks for the same with
`pooling="mean"`). The two generators alternate per round, so this shared machine's drift falls on both.

    python -m bench.perf_analyzer_bench [--concurrency 1 8] [--requests 400] [--rounds 2] [--length 128]
                                        [--bundle DIR] [--json OUT]

perf_analyzer runs through tests/support/perf_analyzer.py (the shared tool script; needs the package
mirrors the first time). Bounded: rounds x concurrencies x 2 x requests calls, plus a server start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from client.load import run_load
from model.default import ensure_default_bundle
from tests.support import perf_analyzer
from tests.support.server_process import ServerProcess


def perf_side(tool: Path, model: str, target: str, data: Path, work: Path, *, concurrency: int, requests: int,
              length: int) -> dict[str, Any]:
    result = perf_analyzer.run(tool, model, target, data, work / "pa.csv", length=length, concurrency=concurrency,
                               requests=requests, warmup=4 * concurrency, timeout=600)
    if result.returncode != 0 or not result.rows:
        raise RuntimeError(f"perf_analyzer failed (exit {result.returncode}):\n{result.output[-3000:]}")
    [row] = result.rows
    return {"sequences_per_s": row["Inferences/Second"], "p50_ms": row["p50 latency"] / 1e3,
            "p99_ms": row["p99 latency"] / 1e3, "queue_ms": row["Server Queue"] / 1e3,
            "compute_ms": row["Server Compute Infer"] / 1e3, "calls": result.request_count}


async def client_side(target: str, *, concurrency: int, requests: int, length: int) -> dict[str, Any]:
    report = await run_load(target, concurrency=concurrency, duration_s=None, max_requests=requests,
                            warmup_s=1.0, lengths=(length, length), pooling="mean")
    return {"sequences_per_s": report.sequences_per_s, "p50_ms": report.latency_ms["p50"],
            "p99_ms": report.latency_ms["p99"], "queue_ms": report.server["queue_ms"],
            "compute_ms": report.server["compute_ms"], "calls": report.ok}


def run(tool: Path, server: ServerProcess, model: str, vocab: int, work: Path, *, concurrencies: list[int],
        requests: int, rounds: int, length: int) -> list[dict[str, Any]]:
    data = perf_analyzer.ids_data(work / "ids.json", length=length, vocab=vocab, rows=64)
    rows = []
    for r in range(rounds):
        for c in concurrencies:
            sides = ["perf_analyzer (KServe v2)", "client bench (attention.v1)"]
            if r % 2:
                sides.reverse()
            for side in sides:
                if side.startswith("perf"):
                    result = perf_side(tool, model, server.target, data, work, concurrency=c, requests=requests,
                                       length=length)
                else:
                    result = asyncio.run(client_side(server.target, concurrency=c, requests=requests, length=length))
                rows.append({"round": r, "concurrency": c, "generator": side, **result})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | generator | round | calls | seq/s | p50 ms | p99 ms | server queue ms | "
             "server compute ms |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda x: (x["concurrency"], x["generator"], x["round"])):
        lines.append(f"| {row['concurrency']} | {row['generator']} | {row['round']} | {row['calls']} | "
                     f"{row['sequences_per_s']:.1f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
                     f"{row['queue_ms']:.2f} | {row['compute_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf_analyzer_bench", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--bundle", default="", help="model bundle (default: the built-in reference model)")
    p.add_argument("--json", default="", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not (10 <= args.requests <= 5000 and 1 <= args.rounds <= 10 and all(1 <= c <= 64 for c in args.concurrency)):
        p.error("--requests in 10..5000, --rounds in 1..10, --concurrency in 1..64")
    tool, why = perf_analyzer.prepare()
    if tool is None:
        p.error(why)
    cache = Path(tempfile.gettempdir()) / "attention-bench-cache"  # the other benchmarks' cache
    bundle = Path(args.bundle) if args.bundle else ensure_default_bundle(cache)
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-bench-") as tmp:
        work = Path(tmp)
        server = ServerProcess(bundle, "--no-allow-attention", directory=work / "server")
        try:
            import tritonclient.grpc as triton

            client = triton.InferenceServerClient(server.target)
            try:
                [stats] = client.get_inference_statistics("").model_stats
                vocab = int(client.get_model_config(stats.name).config.parameters["vocab_size"].string_value)
            finally:
                client.close()
            rows = run(tool, server, stats.name, vocab, work, concurrencies=args.concurrency,
                       requests=args.requests, rounds=args.rounds, length=args.length)
        finally:
            server.stop()
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
