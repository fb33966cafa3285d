"""The gRPC side of a serving process: the server options, and the server with every front door
(attention.v1, KServe v2, health, reflection) behind the metrics and auth interceptors.

Kept apart from service/server.py so that an edge process (service/multiproc/) builds the same
server without importing the model stack (torch).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from proto.attention.v1.codec import SERVICE_NAME
from service.config import ServiceConfig
from service.doors.attention_v1 import AttentionServicer
from service.doors.calls import Calls, Serving
from service.doors.grpc_metrics import MetricsInterceptor
from service.doors.kserve_v2 import SERVICE_NAME as KSERVE_NAME
from service.doors.kserve_v2 import KServeServicer
from service.doors.message_wait import MessageWaitInterceptor
from service.doors.security import AuthInterceptor, TokenChecker, load_tokens, server_credentials
from service.metrics import Metrics

log = logging.getLogger(__name__)


def grpc_options(config: ServiceConfig, *, reuse_port: bool = False) -> list[tuple[str, Any]]:
    """The gRPC server's options. `reuse_port` only for the edge processes of one service, which share
    its port on purpose (service/multiproc/); otherwise a second process must fail to bind."""
    def ms(seconds: float) -> int:
        return int(seconds * 1000) if seconds > 0 else 2**31 - 1  # INT_MAX: no limit

    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),  # a second process must fail to bind, not silently share
        # Accept the keepalive pings our client sends (every 30 s, also when idle).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # Connection limits. Without a stream limit one connection can open streams without bound (a
        # burst of 20,000 header-only streams made other connections' calls fail CANCELLED). A unary
        # call whose message never completes is bounded by message_wait.py; a stream that waits for
        # its next message is bounded by the connection's age.
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        # grpc core's default, said out loud: a stream counts against the limit until the server has
        # released it, not only while it is open on the wire. That bounds what a peer that resets its
        # streams at once can pile up (HTTP/2 "rapid reset"), and it is also why a client that keeps
        # more calls than the limit open gets REFUSED_STREAM: grpcio counts wire streams and opens the
        # next one before the server has released the last (600 calls on one connection at a limit of
        # 256: 57% UNAVAILABLE; at 1024: none; docs/limits.md).
        ("grpc.http.overload_protection", 1),
        ("grpc.max_connection_idle_ms", ms(config.max_connection_idle_s)),
        ("grpc.max_connection_age_ms", ms(config.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", ms(config.max_connection_age_grace_s)),
        ("grpc.keepalive_time_ms", ms(config.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(config.keepalive_timeout_s)),
        # chttp2's own timeout for an unanswered ping (internal.h; 1 min by default), which is what
        # closes the connection of a peer that stopped answering: the same bound as keepalive's.
        ("grpc.http2.ping_timeout_ms", ms(config.keepalive_timeout_s)),
        ("grpc.http2.max_pings_without_data", 0),  # keep probing during a long call that sends nothing
    ]


@dataclass
class Front:
    """A bound (not started) gRPC server with every front door."""

    grpc: grpc.aio.Server
    port: int
    servicer: AttentionServicer
    kserve: KServeServicer
    tokens: int  # bearer tokens configured
    tls: bool


def build_front(config: ServiceConfig, edge: Calls, metrics: Metrics, health_servicer: health.aio.HealthServicer,
                workers: int, *, reuse_port: bool = False) -> Front:
    """The gRPC server bound to config.host:config.port. Raises RuntimeError "Failed to bind" when the
    port is taken (so_reuseport 0: no silent sharing)."""
    servicer = AttentionServicer(edge, metrics)
    # The KServe v2 front door: the same edge (admission, batcher, outcome), error table and metrics.
    kserve = KServeServicer(edge, metrics, workers)
    doors = [SERVICE_NAME, KSERVE_NAME]
    # Outer to inner: auth (below), metrics, the bounded wait for a unary call's message.
    interceptors: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor(metrics, doors),
                                                       MessageWaitInterceptor(config.default_timeout_s)]
    tokens = load_tokens(config)
    if tokens:
        # Outermost: nothing else runs for an unauthenticated call.
        interceptors.insert(0, AuthInterceptor(TokenChecker(tokens), metrics))
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(config, reuse_port=reuse_port))
    server.add_generic_rpc_handlers((servicer.rpc_handler(), kserve.rpc_handler()))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        names = (SERVICE_NAME, KSERVE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    address = f"{config.host}:{config.port}"
    credentials = server_credentials(config)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if tokens and credentials is None:
        log.warning("bearer tokens over plaintext: anyone on the path can read them; configure TLS")
    return Front(server, port, servicer, kserve, len(tokens), credentials is not None)


def ledger(registry: CollectorRegistry) -> dict[str, Any]:
    """The call ledger of both front doors (AttentionService, KServe v2) from the metrics: every
    started call handled, by code, and what the queue still holds. Read at exit, and by tests."""
    started = 0.0
    handled: dict[str, float] = {}
    dropped: dict[str, float] = {}
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.labels.get("grpc_service") in (SERVICE_NAME, KSERVE_NAME):
                if sample.name == "grpc_server_started_total":
                    started += sample.value
                elif sample.name == "grpc_server_handled_total":
                    code = sample.labels["grpc_code"]
                    handled[code] = handled.get(code, 0) + sample.value
            elif sample.name == "attention_dropped_total":
                dropped[sample.labels["reason"]] = sample.value
            elif sample.name in ("attention_queue_depth", "attention_batch_size_sum"):
                values[sample.name] = sample.value
    return {"started": int(started), "handled": {k: int(v) for k, v in handled.items() if v},
            "dropped": {k: int(v) for k, v in dropped.items() if v},
            "queue_depth": int(values.get("attention_queue_depth", 0)),
            "batched_sequences": int(values.get("attention_batch_size_sum", 0))}


class GrpcFront:
    """The drain's view of a gRPC server (service/process.py `Front`), in this process or an edge process.

    Its listener closes and its connections get GOAWAY as soon as the drain refuses new calls (so that
    streaming callers reopen their streams on another replica at once); calls already accepted have the
    grace to finish, and the batcher answers what is left just before it ends."""

    def __init__(self, server: grpc.aio.Server, serving: Serving) -> None:
        self._server = server
        self._serving = serving
        self._stopping: asyncio.Task[None] | None = None

    def announce(self, grace: float) -> None:
        self._serving.stopping = True  # readiness off (Serving.ready); calls are still served until refuse()

    def refuse(self) -> None:
        self._serving.draining = True

    def close(self, grace: float) -> None:
        self._stopping = asyncio.create_task(self._server.stop(grace))

    async def closed(self, margin: float) -> None:
        assert self._stopping is not None, "closed() before close(). This is a bug."
        await self._stopping
