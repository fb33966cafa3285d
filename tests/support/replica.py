"""A readiness switch for service processes in tests: `tests.support.server_process.ServerProcess(...,
prelude=READINESS_SWITCH)` runs `python -m service` with SIGUSR1 / SIGUSR2 setting readiness
NOT_SERVING / SERVING, so that a test can take a live replica out of a balancer's rotation and bring it
back. The service itself has no such switch (an operator drains a replica with SIGTERM); this only adds
two signal handlers to the real server that `serve()` builds."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from grpc_health.v1 import health_pb2

from proto.attention.v1.codec import SERVICE_NAME
from service import server as service_server

READINESS_SWITCH = "import tests.support.replica\ntests.support.replica.install()"


def install() -> None:
    build_server = service_server.build_server

    def build_with_switch(config: Any, registry: Any) -> tuple[service_server.Server, int]:
        server, port = build_server(config, registry)
        loop = asyncio.get_running_loop()

        def set_ready(status: int, ready: int) -> None:
            loop.create_task(server.health.set(SERVICE_NAME, status))
            server.metrics.ready.set(ready)

        loop.add_signal_handler(signal.SIGUSR1, set_ready, health_pb2.HealthCheckResponse.NOT_SERVING, 0)
        loop.add_signal_handler(signal.SIGUSR2, set_ready, health_pb2.HealthCheckResponse.SERVING, 1)
        return server, port

    service_server.build_server = build_with_switch  # serve() looks it up when it runs
