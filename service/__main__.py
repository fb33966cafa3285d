"""`python -m service`: parse the config, then serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry

from service.config import ServiceConfig
from service.server import serve


def main(argv: list[str] | None = None) -> int:
    try:
        config = ServiceConfig.from_args(argv)
    except ValueError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config, CollectorRegistry()))


if __name__ == "__main__":
    sys.exit(main())
