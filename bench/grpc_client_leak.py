"""Does grpcio's client side keep native memory for each cancelled or timed-out call? A minimal repro with
none of this project's code: a bare grpc.aio server (a generic handler: `Slow` sleeps until the caller gives
up, `Fast` answers at once) in one process, and each client variant in a fresh process of its own, which
makes `--calls` calls and prints its RSS before and after.

    python -m bench.grpc_client_leak [--calls 20000] [--warmup 2000] [--concurrency 16] [--variants ...]

Variants (`--variants`, all by default):
  aio-ok          grpc.aio, one channel, calls answered OK (the control)
  aio-deadline    grpc.aio, one channel, each call times out (`timeout=` 5 ms on Slow: DEADLINE_EXCEEDED)
  aio-cancel      grpc.aio, one channel, each call cancelled 0-5 ms after it starts (`call.cancel()`)
  aio-task        grpc.aio, one channel, the task awaiting each call cancelled 0-5 ms after it starts (what
                  `asyncio.wait_for`, a TaskGroup or a server's cancelled handler does to a caller)
  aio-shield      as aio-task, the call awaited through `asyncio.shield` and, on cancellation, the RPC alone
                  cancelled (grpc.aio's `Call._cancel`, not its invocation task): the workaround
  aio-recycle     as aio-deadline and aio-cancel alternately, on a fresh channel every `--recycle` calls
                  (the old one closed): the workaround, if the memory is the channel's
  sync-deadline   the sync client (grpc.insecure_channel, `stub(request, timeout=)`), one channel
  sync-cancel     the sync client, `stub.future(request)` cancelled 0-5 ms after it starts
  aio-mixed       aio-deadline and aio-cancel alternately on one channel (what aio-recycle recycles)

The RSS is read from /proc/self/statm after `gc.collect()` and glibc's `malloc_trim(0)`, so memory that the
allocator merely keeps on its free lists is not counted: what grows is held. The growth is taken between the
end of `--warmup` calls and the end of `--calls` more, and printed per call, with the Python heap's growth
in allocated blocks per call (`sys.getallocatedblocks()`): near 0 when what grows is native. Bounded: every
variant stops at `--calls` calls or `--max-seconds`, whichever comes first, and the printed count is the
calls made.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

SERVICE = "leak.Leak"
VARIANTS = ("aio-ok", "aio-deadline", "aio-cancel", "aio-task", "aio-shield", "aio-mixed", "aio-recycle",
            "sync-deadline", "sync-cancel")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _identity(data: bytes) -> bytes:
    return data


async def _serve(ports: Any) -> None:
    async def slow(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(60)  # the caller gives up first (deadline or cancel); grpc cancels this task
        return b""

    async def fast(request: bytes, context: Any) -> bytes:
        return b"ok"

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Slow": grpc.unary_unary_rpc_method_handler(slow, _identity, _identity),
        "Fast": grpc.unary_unary_rpc_method_handler(fast, _identity, _identity)}),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _server_main(ports: Any) -> None:
    asyncio.run(_serve(ports))


def rss_held_kb() -> float:
    """RSS after a full collection and glibc's malloc_trim: memory held, not merely kept by the allocator."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1024


async def _aio_calls(target: str, variant: str, count: int, concurrency: int, recycle: int, end: float,
                     rng: random.Random, codes: dict[str, int]) -> int:
    """`count` calls of `variant` with `concurrency` in flight, their status codes counted in `codes`; the
    number made before `end`."""
    made = 0

    async def one(channel: grpc.aio.Channel, n: int) -> str:
        kind = variant.removeprefix("aio-")
        if kind in ("mixed", "recycle"):
            kind = "deadline" if n % 2 else "cancel"
        if kind == "ok":
            await channel.unary_unary(f"/{SERVICE}/Fast")(b"x", timeout=10)
            return "OK"
        call = channel.unary_unary(f"/{SERVICE}/Slow")(b"x", timeout=0.005 if kind == "deadline" else 10)
        if kind in ("task", "shield"):
            return await _cancel_task(call, kind == "shield", rng.uniform(0, 0.005))
        if kind == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.005), call.cancel)
        try:
            await call
        except grpc.aio.AioRpcError as e:  # a cancelled call may also end as an AioRpcError CANCELLED
            return str(e.code().name)
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            return "CANCELLED"
        return "OK"

    per_channel = recycle if variant == "aio-recycle" else count
    while made < count and time.monotonic() < end:
        channel = grpc.aio.insecure_channel(target)
        try:
            todo = min(per_channel, count - made)
            queue = iter(range(made, made + todo))

            async def worker(channel: grpc.aio.Channel = channel, queue: Any = queue) -> int:
                done = 0
                for n in queue:
                    if time.monotonic() >= end:
                        break
                    code = await one(channel, n)
                    codes[code] = codes.get(code, 0) + 1
                    done += 1
                return done

            made += sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        finally:
            await channel.close()
    return made


async def _cancel_task(call: Any, shield: bool, after_s: float) -> str:
    """Cancel the task awaiting `call` after `after_s`; with `shield`, the call is awaited through
    asyncio.shield and its RPC alone cancelled (grpc.aio's private Call._cancel: the invocation task and
    its batch run to completion)."""
    from grpc.aio._call import Call

    async def awaited() -> Any:
        if not shield:
            return await call
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            Call._cancel(call, "cancelled by the caller")
            raise

    task = asyncio.ensure_future(awaited())
    await asyncio.sleep(after_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "CANCELLED"
    except grpc.aio.AioRpcError as e:
        return str(e.code().name)
    return "OK"


def _sync_calls(channel: grpc.Channel, variant: str, count: int, concurrency: int, end: float,
                rng: random.Random, codes: dict[str, int]) -> int:
    slow = channel.unary_unary(f"/{SERVICE}/Slow")
    lock = threading.Lock()
    left = [count]

    def worker() -> int:
        done = 0
        while time.monotonic() < end:
            with lock:
                if left[0] == 0:
                    break
                left[0] -= 1
            if variant == "sync-deadline":
                try:
                    slow(b"x", timeout=0.005)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
            else:
                future = slow.future(b"x", timeout=10)
                time.sleep(rng.uniform(0, 0.005))
                code = "CANCELLED" if future.cancel() else "not cancelled"
            with lock:
                codes[code] = codes.get(code, 0) + 1
            done += 1
        return done

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(lambda _: worker(), range(concurrency)))


def client_main(target: str, variant: str, calls: int, warmup: int, concurrency: int, recycle: int,
                max_seconds: float) -> dict[str, Any]:
    """One variant in this (fresh) process: the RSS held after the warm-up and after the calls."""
    rng = random.Random(0)
    end = time.monotonic() + max_seconds
    codes: dict[str, int] = {}  # of all calls, warm-up included
    if variant.startswith("aio"):
        async def run(count: int) -> int:
            return await _aio_calls(target, variant, count, concurrency, recycle, end, rng, codes)

        loop = asyncio.new_event_loop()
        warm = loop.run_until_complete(run(warmup))
        before, blocks = rss_held_kb(), sys.getallocatedblocks()
        made = loop.run_until_complete(run(calls))
        after, blocks = rss_held_kb(), sys.getallocatedblocks() - blocks
        loop.close()
    else:
        with grpc.insecure_channel(target) as channel:
            warm = _sync_calls(channel, variant, warmup, concurrency, end, rng, codes)
            before, blocks = rss_held_kb(), sys.getallocatedblocks()
            made = _sync_calls(channel, variant, calls, concurrency, end, rng, codes)
            after, blocks = rss_held_kb(), sys.getallocatedblocks() - blocks
    return {"variant": variant, "warmup": warm, "calls": made, "rss_before_mb": round(before / 1024, 1),
            "rss_after_mb": round(after / 1024, 1), "kb_per_call": round((after - before) / max(made, 1), 3),
            "py_blocks_per_call": round(blocks / max(made, 1), 2), "codes": codes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--recycle", type=int, default=1000, help="aio-recycle: calls per channel")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per variant")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run one variant against this target
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(client_main(args.client, args.variants[0], args.calls, args.warmup, args.concurrency,
                                     args.recycle, args.max_seconds)), flush=True)
        return 0
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    try:
        target = f"127.0.0.1:{ports.get(timeout=60)}"
        print(f"grpcio {grpc.__version__}, python {sys.version.split()[0]}, server {target}", flush=True)
        for variant in args.variants:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.grpc_client_leak", "--client", target, "--variants", variant,
                 "--calls", str(args.calls), "--warmup", str(args.warmup), "--concurrency", str(args.concurrency),
                 "--recycle", str(args.recycle), "--max-seconds", str(args.max_seconds)],
                capture_output=True, text=True, timeout=args.max_seconds * 2 + 60, check=False)
            if proc.returncode != 0:
                print(f"{variant}: failed (exit {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
                continue
            r = json.loads(proc.stdout.splitlines()[-1])
            print(f"{r['variant']:14s} {r['calls']:6d} calls (after {r['warmup']} warm-up): RSS held "
                  f"{r['rss_before_mb']:.1f} -> {r['rss_after_mb']:.1f} MB, {r['kb_per_call']:+.3f} KB per call; "
                  f"Python heap {r['py_blocks_per_call']:+.2f} blocks per call; {r['codes']}", flush=True)
    finally:
        server.terminate()
        server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
