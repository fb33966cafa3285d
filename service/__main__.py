"""`python -m service` (the `attention-service` command): parse the config, then serve until SIGTERM.

Help and configuration errors come before torch is imported (they must not wait for it); the serving
mode is chosen here: one process (service/server.py) or edge processes (service/multiproc/host.py), and the
event loop it runs on (service/event_loop.py).
So is OpenMP's spin (`openmp_defaults`), which libgomp reads once, when torch loads it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

from service import event_loop
from service.config import ServiceConfig

# How long an OpenMP thread that has finished its share of a parallel region spins for the next one before it
# sleeps: libgomp's default (300,000 iterations) keeps a wide forward's second thread busy for milliseconds
# after the forward, taking that core from the event loop, the other model worker and any other process. A
# forward's own regions follow each other within microseconds, well inside 10,000 (docs/performance.md;
# bench/RESULTS.md: server CPU a call -13 to -31% at concurrency 1, throughput equal or better, latency unchanged).
OPENMP_SPINCOUNT = "10000"


def openmp_defaults(env: MutableMapping[str, str]) -> None:
    """`GOMP_SPINCOUNT` in `env` (this process's environment, before torch is imported), unless the operator
    has set it or `OMP_WAIT_POLICY` (whose own spin it would override)."""
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT


def main(argv: list[str] | None = None) -> int:
    try:
        config = ServiceConfig.from_args(argv)
    except ValueError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    openmp_defaults(os.environ)
    if config.edge_processes:
        from service.multiproc.host import serve_with_edges

        return event_loop.run(serve_with_edges(config), config.event_loop)
    from prometheus_client import CollectorRegistry

    from service.server import serve

    return event_loop.run(serve(config, CollectorRegistry()), config.event_loop)


if __name__ == "__main__":
    sys.exit(main())
