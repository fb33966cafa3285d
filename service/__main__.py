"""`python -m service` (the `attention-service` command): parse the config, then serve until SIGTERM.

Help and configuration errors come before torch is imported (they must not wait for it); the serving
mode is chosen here: one process (service/server.py) or edge processes (service/multiproc/host.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from service.config import ServiceConfig


def main(argv: list[str] | None = None) -> int:
    try:
        config = ServiceConfig.from_args(argv)
    except ValueError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.edge_processes:
        from service.multiproc.host import serve_with_edges

        return asyncio.run(serve_with_edges(config))
    from prometheus_client import CollectorRegistry

    from service.server import serve

    return asyncio.run(serve(config, CollectorRegistry()))


if __name__ == "__main__":
    sys.exit(main())
