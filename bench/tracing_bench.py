"""What tracing costs per call, in process: the tracing layer's own work for one call, exactly as the service
does it (service/tracing.py: the call's span from a caller's traceparent, its decode, queue and encode
children, its end; one forward span per `--calls-per-batch` calls, linked to them), exported by the real
batch processor over OTLP/gRPC to a receiver in another process (tests/support/otlp_receiver.py, counting).

    python -m bench.tracing_bench [--calls 20000] [--calls-per-batch 1]

Reports, per call, the CPU the call's own thread spends (the event loop's share in the service) and the
process's CPU (that, plus the export thread's encoding and sending), the best of 3 runs; and the same loop
with tracing off (the tests for None that remain). The calls go in chunks of CHUNK, each flushed before
the next, so the export keeps up and no span is dropped. Bounded: 3 x 2 x `--calls` iterations.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from service.batching.types import Done
from service.config import ServiceConfig
from service.jobs import Output
from service.tracing import CallTrace, Tracing, build_tracing

HEADERS = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), ("user-agent", "bench"))
ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "attention.v1.AttentionService", "rpc.method": "Encode",
              "attention.door": "attention.v1", "attention.transport": "grpc", "attention.method": "Encode"}
DONE = [Done(Output(None, None, None, False), 0.001, 0.004, 8, 128)]
CHUNK = 256  # calls between flushes: 256 x 5 spans stay under the processor's queue of 2048


def one_call(tracing: Tracing | None) -> CallTrace | None:
    """What the service does for one call, tracing on or off (service/doors/rpc.py, service/doors/calls.py)."""
    trace = tracing.call("attention.v1.AttentionService/Encode", HEADERS, ATTRIBUTES) if tracing is not None else None
    if trace is not None:
        trace.run()
        trace.planned(1, 128, "embed")
        trace.admitted()
        trace.computed(DONE)
        trace.ran()
        trace.end("OK", "reference", {"rpc.grpc.status_code": 0})
    return trace


def run(tracing: Tracing | None, calls: int, per_batch: int) -> tuple[float, float]:
    """(the calls' thread's CPU µs per call, the process's CPU µs per call, export included)."""
    forwards = tracing.forwards("reference") if tracing is not None else None
    links: list[object] = []
    own = 0.0
    cpu = time.process_time()
    for start in range(0, calls, CHUNK):
        before = time.thread_time()
        for i in range(start, min(calls, start + CHUNK)):
            trace = one_call(tracing)
            if trace is not None:
                links.append(trace.link)
            if forwards is not None and (i + 1) % per_batch == 0:
                forwards.end(forwards.start(links, per_batch, 128, 128 * per_batch, True), 0)
                links = []
        own += time.thread_time() - before
        if tracing is not None:
            tracing.flush()  # the export thread's work (this thread waits)
    return own / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--calls-per-batch", type=int, default=1)
    args = parser.parse_args(argv)
    if not (1 <= args.calls <= 200_000 and 1 <= args.calls_per_batch <= 64):
        parser.error("--calls in 1..200000, --calls-per-batch in 1..64")
    receiver = subprocess.Popen([sys.executable, "-m", "tests.support.otlp_receiver"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    assert receiver.stdin is not None and receiver.stdout is not None
    try:
        port = int(receiver.stdout.readline())
        config = ServiceConfig(otlp_endpoint=f"http://127.0.0.1:{port}", otlp_export_delay_ms=100.0)
        tracing = build_tracing(config, "bench")
        assert tracing is not None
        on = [run(tracing, args.calls, args.calls_per_batch) for _ in range(3)]
        off = [run(None, args.calls, args.calls_per_batch) for _ in range(3)]
        tracing.shutdown()
    finally:
        out, _ = receiver.communicate("", timeout=60)
    expected = 3 * args.calls * (1 + 3) + 3 * (args.calls // args.calls_per_batch)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"{args.calls} calls x 3, a forward per {args.calls_per_batch} call(s); received: {out.strip()} "
          f"(sent {expected})")
    print(f"tracing on:  {min(f for f, _ in on):.1f} us/call of CPU on the calls' thread, "
          f"{min(c for _, c in on):.1f} us/call of process CPU (export included)")
    print(f"tracing off: {min(f for f, _ in off):.3f} us/call of CPU on the calls' thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
