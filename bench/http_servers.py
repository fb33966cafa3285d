"""Which HTTP server library the HTTP front door runs on: calls/s and server CPU per call for one
trivial JSON POST, each library in its own process on 127.0.0.1, the same client for all.

    python -m bench.http_servers [--rounds 3] [--calls 2000] [--concurrency 1 16] [--servers aiohttp starlette asgi]

The route is what an embeddings call costs a server above the model: read a JSON body of one short
text, parse it, answer a JSON list of 384 floats (MiniLM's pooled vector). The model's own time is the
same whatever the library, so it is left out; what differs between the libraries is measured.

- `aiohttp`: aiohttp.web (its C HTTP parser), an AppRunner + TCPSite in an asyncio loop;
- `starlette`: uvicorn (httptools parser) serving a Starlette app;
- `asgi`: uvicorn (httptools) serving a bare ASGI callable (the floor of the ASGI stack).

The client is one aiohttp ClientSession in this process with `concurrency` calls in flight over
keep-alive connections. Server CPU is the server process's user+system time (/proc) over the round,
divided by calls. Rounds alternate the servers' order; the table shows the median of the rounds.
Bounded: rounds x servers x concurrencies x calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

SERVERS = ("aiohttp", "starlette", "asgi")
VECTOR = [round(0.001 * i, 6) for i in range(384)]
BODY = json.dumps({"input": "The quick brown fox jumps over the lazy dog.", "model": "m"}).encode()


def _answer(raw: bytes) -> bytes:
    request = json.loads(raw)
    return json.dumps({"object": "list", "model": request["model"],
                       "data": [{"object": "embedding", "index": 0, "embedding": VECTOR}]}).encode()


def _serve_aiohttp(ports: Any) -> None:
    from aiohttp import web

    async def embed(request: web.Request) -> web.Response:
        return web.Response(body=_answer(await request.read()), content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/embeddings", embed)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


def _serve_uvicorn(app: Any, ports: Any) -> None:
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ports.put(sock.getsockname()[1])
    config = uvicorn.Config(app, http="httptools", loop="asyncio", access_log=False, log_level="warning",
                            lifespan="off")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def _serve_starlette(ports: Any) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def embed(request: Request) -> Response:
        return Response(_answer(await request.body()), media_type="application/json")

    _serve_uvicorn(Starlette(routes=[Route("/v1/embeddings", embed, methods=["POST"])]), ports)


def _serve_asgi(ports: Any) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        out = _answer(body)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    _serve_uvicorn(app, ports)


_TARGETS = {"aiohttp": _serve_aiohttp, "starlette": _serve_starlette, "asgi": _serve_asgi}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, calls: int, concurrency: int) -> float:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/embeddings"
    left = calls
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                    assert r.status == 200, r.status
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(min(concurrency, 8))))  # warm the connections
        left = calls
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def measure(server: str, calls: int, concurrency: int) -> tuple[float, float]:
    """(calls/s, server CPU ms per call) of one round against a fresh server process."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    process = ctx.Process(target=_TARGETS[server], args=(ports,), daemon=True)
    process.start()
    try:
        port = ports.get(timeout=60)
        _wait_listening(port)
        asyncio.run(_load(port, min(calls, 50), concurrency))  # start-up and first-call costs out of the round
        assert process.pid is not None
        before = _cpu_s(process.pid)
        seconds = asyncio.run(_load(port, calls, concurrency))
        cpu = _cpu_s(process.pid) - before
        return calls / seconds, cpu / calls * 1e3
    finally:
        process.kill()
        process.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        order = args.servers if r % 2 == 0 else args.servers[::-1]
        for c in args.concurrency:
            for server in order:
                results.setdefault((server, c), []).append(measure(server, args.calls, c))
    print("| server | concurrency | calls/s | server CPU ms/call | calls/s per round |")
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        for server in args.servers:
            rows = results[(server, c)]
            rate = statistics.median(x[0] for x in rows)
            cpu = statistics.median(x[1] for x in rows)
            print(f"| {server} | {c} | {rate:.0f} | {cpu:.3f} | {', '.join(f'{x[0]:.0f}' for x in rows)} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
