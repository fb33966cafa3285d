"""The HTTP door beside the gRPC door of one running service: calls/s and server CPU per call for the
same pooled-embedding call of one 16-token sequence of ids, through OpenAI's /v1/embeddings (floats, and
`openai-base64`: `encoding_format` base64), TEI's /embed (aiohttp clients, keep-alive) and attention.v1
Encode over gRPC (grpc.aio), interleaved in one run.

    python -m bench.http_door [--rounds 2] [--calls 400] [--concurrency 1 16] [--bundle DIR]

The server is one `python -m service` process (tests/support/server_process.py) serving the TINY
model (a bundle made here, seed 0, unless --bundle), so the door's own cost is what differs. Server CPU
is the process's user+system time (/proc) over the round, divided by calls. Bounded: rounds x doors x
concurrencies x calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DOORS = ("grpc", "openai", "openai-base64", "tei")
IDS = [list(range(5, 21))]  # one 16-token sequence, as bench/doors_bench.py sends


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(door: str, ports: dict[str, int], calls: int, concurrency: int) -> float:
    import aiohttp
    import grpc

    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1 import attention_pb2_grpc
    from proto.attention.v1.codec import to_tensor

    if door == "grpc":
        request = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(np.asarray(IDS[0], np.int64)))],
                                   output=pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MEAN,
                                                           normalize=True))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)

            async def one_grpc() -> None:
                await stub.Encode(request, timeout=30)

            return await _run(one_grpc, calls, concurrency)
    path, body = ("/embed", {"inputs": IDS}) if door == "tei" else ("/v1/embeddings", {"model": "tiny", "input": IDS})
    if door == "openai-base64":
        body["encoding_format"] = "base64"
    url = f"http://127.0.0.1:{ports['http_port']}{path}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one_http() -> None:
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        return await _run(one_http, calls, concurrency)


async def _run(one: Any, calls: int, concurrency: int) -> float:
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    parser.add_argument("--bundle", default="")
    args = parser.parse_args(argv)
    from tests.support.server_process import ServerProcess

    with tempfile.TemporaryDirectory(prefix="http-door-bench-") as tmp:
        bundle = Path(args.bundle) if args.bundle else _tiny(Path(tmp) / "tiny")
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        # --openai-token-ids: the same ids through every door (the seeded model takes no text).
        server = ServerProcess(bundle, "--metrics-port", "-1", "--log-level", "warning", "--openai-token-ids",
                               directory=Path(tmp) / "srv")
        try:
            results: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for door in args.doors:  # warm every path once
                asyncio.run(_load(door, server.ports, 20, 2))
            for r in range(args.rounds):
                order = args.doors if r % 2 == 0 else args.doors[::-1]
                for c in args.concurrency:
                    for door in order:
                        before = _cpu_s(server.pid)
                        seconds = asyncio.run(_load(door, server.ports, args.calls, c))
                        cpu = _cpu_s(server.pid) - before
                        results.setdefault((door, c), []).append((args.calls / seconds, cpu / args.calls * 1e3))
        finally:
            server.kill()
    print("| door | concurrency | calls/s | server CPU ms/call | calls/s per round |")
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        for door in args.doors:
            rows = results[(door, c)]
            print(f"| {door} | {c} | {statistics.median(x[0] for x in rows):.0f} | "
                  f"{statistics.median(x[1] for x in rows):.3f} | {', '.join(f'{x[0]:.0f}' for x in rows)} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


def _tiny(path: Path) -> Path:
    from model.bundle import save_bundle
    from model.config import TINY
    from model.encoder import Encoder

    save_bundle(Encoder(TINY).init_weights(0), path, name="tiny", version="1", source="seed:0")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
