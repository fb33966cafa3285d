"""The floor of gRPC in Python at concurrency 1, with none of the service: what a bare server costs a
grpc.aio caller above the handler's own wait. The bar the service's concurrency-1 target is held to.

    python -m bench.grpc_floor [--rounds 6] [--calls 1500] [--wait-ms 0 9] [--servers aio sync]

`FloorServer` is the other floor (bench/doors_bench.py's): a bare server of either kind answering
fixed bytes per method, at once, with no work at all.

Each server is a generic handler returning a 128 KiB bytes payload (the size of 128 x 256 float32
hidden states) in a fresh process on 127.0.0.1; `aio` is a grpc.aio server whose handler awaits a
worker thread, `sync` a `grpc.server` with a thread pool whose handler waits on a worker thread. The
worker sleeps `wait-ms` (GIL released, as a forward), which stands for the model. The caller is one
grpc.aio client in this process, one call in flight. Prints per server and wait the p50 of the round
trip above the wait, per round and the median of the rounds, and the sleep's own overshoot (subtract
it). Rounds alternate the servers' order. Bounded: rounds x servers x waits x calls.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from service import event_loop

PAYLOAD = b"\0" * (128 * 1024)
REQUEST = b"\1" * 600  # about a serialized 128-token request
METHOD = "/floor.Floor/Call"


AIO_KINDS = ("aio", "aio-hop", "aio-anext", "aio-read", "uvloop")


def _identity(data: bytes) -> bytes:
    return data


def _handler(behaviour: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "floor.Floor", {"Call": grpc.unary_unary_rpc_method_handler(behaviour, _identity, _identity)})


def _work(wait_s: float) -> bytes:
    if wait_s:
        time.sleep(wait_s)
    return PAYLOAD


async def _serve_aio(wait_s: float, ports: Any) -> None:
    pool = ThreadPoolExecutor(1)

    async def call(request: bytes, context: Any) -> bytes:
        return await asyncio.wrap_future(pool.submit(_work, wait_s))

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(call),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _serve_sync(wait_s: float, ports: Any) -> None:
    pool = ThreadPoolExecutor(1)

    def call(request: bytes, context: Any) -> bytes:
        return pool.submit(_work, wait_s).result()

    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_handler(call),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _serve(kind: str, wait_s: float, ports: Any) -> None:
    if kind == "aio":
        asyncio.run(_serve_aio(wait_s, ports))
    else:
        _serve_sync(wait_s, ports)


def _answers_handlers(answers: dict[str, bytes], behaviour: Any, stream: bool = False
                      ) -> list[grpc.GenericRpcHandler]:
    """One generic handler per service of `answers` ("/pkg.Service/Method" -> response bytes); `stream`:
    each served as a client-streaming method (callers still make unary calls)."""
    services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    make = grpc.stream_unary_rpc_method_handler if stream else grpc.unary_unary_rpc_method_handler
    for path, payload in answers.items():
        service, method = path.lstrip("/").split("/")
        services.setdefault(service, {})[method] = make(behaviour(payload), _identity, _identity)
    return [grpc.method_handlers_generic_handler(name, methods) for name, methods in services.items()]


async def _answer_aio(answers: dict[str, bytes], ports: Any, kind: str) -> None:
    """`kind`: "aio", "aio-hop", or "aio-anext" / "aio-read", a unary call served as a client-streaming method
    that reads its one message from the request iterator / with `context.read()` (what the service's bounded
    wait for the message does, service/doors/message_wait.py)."""
    pool = ThreadPoolExecutor(1)

    def behaviour(payload: bytes) -> Any:
        async def call(request: bytes, context: Any) -> bytes:
            return payload

        async def call_hop(request: bytes, context: Any) -> bytes:
            return await asyncio.wrap_future(pool.submit(_identity, payload))

        async def call_anext(requests: Any, context: Any) -> bytes:
            await anext(requests)
            return payload

        async def call_read(requests: Any, context: Any) -> bytes:
            await context.read()
            return payload
        return {"aio": call, "aio-hop": call_hop, "aio-anext": call_anext, "aio-read": call_read}[kind]

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(_answers_handlers(answers, behaviour, stream=kind in ("aio-anext", "aio-read")))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _answer_sync(answers: dict[str, bytes], ports: Any, threads: int) -> None:
    def behaviour(payload: bytes) -> Any:
        def call(request: bytes, context: Any) -> bytes:
            return payload
        return call

    server = grpc.server(ThreadPoolExecutor(threads))
    server.add_generic_rpc_handlers(_answers_handlers(answers, behaviour))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _answer(kind: str, answers: dict[str, bytes], ports: Any, threads: int) -> None:
    if kind == "uvloop":
        event_loop.run(_answer_aio(answers, ports, "aio"), "uvloop")
    elif kind in AIO_KINDS:
        asyncio.run(_answer_aio(answers, ports, kind))
    else:
        _answer_sync(answers, ports, threads)


class FloorServer:
    """A bare gRPC server in a fresh process on 127.0.0.1 that answers each method of `answers`
    ("/pkg.Service/Method" -> response bytes) with its bytes at once, doing nothing else: what Python
    gRPC alone costs per call. `kind` "aio" is a grpc.aio server; "aio-hop" the same whose handler
    awaits the bytes from a worker thread (the hand-off every service call makes to its model thread,
    one per call here); "aio-anext" and "aio-read" serve each method as client-streaming (`_answer_aio`);
    "uvloop" is "aio" on uvloop's event loop (the service's default, service/event_loop.py); "sync" a
    `grpc.server` whose handlers run on a pool of `threads`. `stop()` kills it."""

    def __init__(self, kind: str, answers: dict[str, bytes], *, threads: int = 8, timeout: float = 60.0) -> None:
        if kind not in (*AIO_KINDS, "sync"):
            raise ValueError(f"kind must be one of {', '.join(AIO_KINDS)} or sync; got {kind!r}")
        context = mp.get_context("spawn")
        ports: Any = context.Queue()
        self.kind = kind
        self.proc = context.Process(target=_answer, args=(kind, answers, ports, threads), daemon=True)
        self.proc.start()
        try:
            self.target = f"127.0.0.1:{ports.get(timeout=timeout)}"
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


async def _p50_ms(port: int, calls: int, warmup: int = 50) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)
        for _ in range(warmup):
            await call(REQUEST, timeout=10)
        seconds = []
        for _ in range(calls):
            started = time.perf_counter()
            await call(REQUEST, timeout=10)
            seconds.append(time.perf_counter() - started)
    return 1e3 * statistics.median(seconds)


def measure(kind: str, wait_ms: float, calls: int) -> float:
    """p50 round trip in ms above `wait_ms`, against a fresh server of `kind` ("aio" or "sync")."""
    ports: Any = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(kind, wait_ms / 1e3, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        return asyncio.run(_p50_ms(port, calls)) - wait_ms
    finally:
        server.kill()
        server.join()


def sleep_overshoot_ms(wait_ms: float, count: int = 300) -> float:
    """The p50 of how much longer than `wait_ms` a sleep of it takes on this machine."""
    over = []
    for _ in range(count if wait_ms else 0):
        started = time.perf_counter()
        time.sleep(wait_ms / 1e3)
        over.append(1e3 * (time.perf_counter() - started) - wait_ms)
    return statistics.median(over) if over else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1500, help="measured calls per round and server")
    parser.add_argument("--wait-ms", type=float, nargs="+", default=[0.0, 9.0])
    parser.add_argument("--servers", nargs="+", choices=["aio", "sync"], default=["aio", "sync"])
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 50 and 1 <= args.calls <= 100_000):
        parser.error("rounds must be in 1..50 and calls in 1..100000")
    print("| server | wait ms | p50 above the wait, ms (median of rounds) | rounds | sleep overshoot ms |")
    print("|---|---:|---:|---|---:|")
    for wait_ms in args.wait_ms:
        results: dict[str, list[float]] = {kind: [] for kind in args.servers}
        for round_ in range(args.rounds):
            for kind in args.servers if round_ % 2 == 0 else args.servers[::-1]:
                results[kind].append(measure(kind, wait_ms, args.calls))
        overshoot = sleep_overshoot_ms(wait_ms)
        for kind, values in results.items():
            rounds = ", ".join(f"{v:.2f}" for v in values)
            print(f"| {kind} | {wait_ms:g} | {statistics.median(values):.2f} | {rounds} | {overshoot:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
