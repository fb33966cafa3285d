"""`python -m tests.replica ARGS`: `python -m service ARGS`, plus SIGUSR1 / SIGUSR2 to set readiness
NOT_SERVING / SERVING, so that a test can take a live replica out of a balancer's rotation and bring it
back. The service itself has no such switch (an operator drains a replica with SIGTERM); this wrapper
only adds the two signal handlers to the real server that `serve()` builds."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

from grpc_health.v1 import health_pb2

from service import __main__ as service_main
from service import server as service_server
from service.servicer import SERVICE_NAME

_build_server = service_server.build_server


def build_server(config: Any, registry: Any) -> tuple[service_server.Server, int]:
    server, port = _build_server(config, registry)
    loop = asyncio.get_running_loop()

    def set_ready(status: int, ready: int) -> None:
        loop.create_task(server.health.set(SERVICE_NAME, status))
        server.metrics.ready.set(ready)

    loop.add_signal_handler(signal.SIGUSR1, set_ready, health_pb2.HealthCheckResponse.NOT_SERVING, 0)
    loop.add_signal_handler(signal.SIGUSR2, set_ready, health_pb2.HealthCheckResponse.SERVING, 1)
    return server, port


if __name__ == "__main__":
    service_server.build_server = build_server  # serve() looks it up at call time
    sys.exit(service_main.main())
