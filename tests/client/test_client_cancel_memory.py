"""Cancelling `EncoderClient` calls does not grow the caller's native memory (client/calls.py), where a
plain grpc.aio call cancelled in flight keeps about 1 KB per call for good (grpc/grpc#43360; the numbers are
in bench/RESULTS.md). A bare grpc.aio server in a process of its own holds every Encode until the caller
cancels and counts the cancellations it sees; the caller runs in a fresh process, which prints the memory it
holds (RSS after gc and malloc_trim) per cancelled call, for the client and for a plain grpc.aio call."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = """
import asyncio, json
import grpc

started = {"client": 0, "grpc.aio": 0}
cancelled = {"client": 0, "grpc.aio": 0}

async def encode(request, context):
    kind = "grpc.aio" if request == b"x" else "client"
    started[kind] += 1
    try:
        await asyncio.sleep(120)  # until the caller cancels
    except asyncio.CancelledError:
        cancelled[kind] += 1
        raise
    return b""

async def count(request, context):
    return json.dumps({"started": started, "cancelled": cancelled}).encode()

async def main():
    ident = lambda b: b
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("attention.v1.AttentionService", {
            "Encode": grpc.unary_unary_rpc_method_handler(encode, ident, ident)}),
        grpc.method_handlers_generic_handler("test.Stats", {
            "Cancelled": grpc.unary_unary_rpc_method_handler(count, ident, ident)})))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""

CALLER = """
import asyncio, contextlib, ctypes, gc, json, os, sys
import grpc
import numpy as np
from client import EncoderClient

target, calls = sys.argv[1], int(sys.argv[2])
PAGE = os.sysconf("SC_PAGE_SIZE")

def held_kb():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1024

async def main():
    raw_channel = grpc.aio.insecure_channel(target)
    raw = raw_channel.unary_unary("/attention.v1.AttentionService/Encode")
    async with EncoderClient(target, timeout=60, retry=None) as client:
        async def cancelled(kind):
            if kind == "client":
                coro = client.encode([np.array([1, 2, 3])], pooling="mean", return_hidden=False)
            else:
                coro = raw(b"x", timeout=60)
            task = asyncio.ensure_future(coro)
            await asyncio.sleep(0.005)  # the call is in flight (most reach the server by then, fewer when busy)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled()

        async def run(kind, n):
            for _ in range(n // 16):
                await asyncio.gather(*(cancelled(kind) for _ in range(16)))

        out = {}
        for kind in ("client", "grpc.aio"):  # the client first: the plain calls' memory stays held
            await run(kind, 800)
            before = held_kb()
            await run(kind, calls)
            out[kind] = round((held_kb() - before) / calls, 3)
        out["sent"] = 800 + calls  # of each kind
        print(json.dumps(out), flush=True)
    await raw_channel.close()

asyncio.run(main())
"""


def test_cancelled_client_calls_keep_no_native_memory_and_reach_the_server() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert server.stdout is not None
        target = f"127.0.0.1:{server.stdout.readline().strip()}"
        caller = subprocess.run([sys.executable, "-c", CALLER, target, "4000"], capture_output=True, text=True,
                                cwd=ROOT, timeout=100)
        assert caller.returncode == 0, caller.stderr[-3000:]
        kb = json.loads(caller.stdout.splitlines()[-1])
        # The control: plain grpc.aio calls cancelled in flight keep memory (measured ~1 KB per call). If this
        # fails, grpcio has fixed grpc/grpc#43360 and client/calls.py's workaround may go.
        assert kb["grpc.aio"] > 0.4, kb
        assert kb["client"] < 0.15, kb
        # The RPCs were cancelled, not only the tasks: every call that reached the server ended there
        # cancelled, the client's as the plain ones. How many reach it before their cancel depends on the
        # machine's load (one cancelled before it arrived never starts): most on a quiet machine; at load 4-5
        # on 2 cores, 21% of the plain calls and 59% of the client's with a 2 ms wait. A tenth is the floor.
        import grpc

        with grpc.insecure_channel(target) as channel:
            count = channel.unary_unary("/test.Stats/Cancelled")
            end = time.monotonic() + 30
            while (seen := json.loads(count(b"", timeout=10)))["started"] != seen["cancelled"] and (
                    time.monotonic() < end):
                time.sleep(0.05)  # the last cancellations may still be on their way (polled, bounded)
        assert seen["started"] == seen["cancelled"], seen
        assert seen["started"]["client"] > kb["sent"] // 10 and seen["started"]["grpc.aio"] > kb["sent"] // 10, seen
    finally:
        server.kill()
        server.wait(10)
        assert server.stdout is not None
        server.stdout.close()
