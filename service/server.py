"""One serving process: `build_server(config, registry) -> (server, port)` kept apart from `serve()`.

Start-up: listen at once (liveness `""` SERVING), load and warm the model in the background
(service/engine.py), then report the AttentionService SERVING (readiness). Shutdown (SIGTERM): the
drain of service/process.py (`Lifecycle.drain`), then exit 0; a second signal stops at once. The last
log line is the call ledger (started = handled by code; queue empty).

With `edge_processes` > 0 `python -m service` runs service/multiproc/host.py instead (the choice is
service/__main__.py's); this module knows nothing of that mode.

Security (service/doors/security.py): with `tls_cert`/`tls_key` the gRPC port speaks TLS only (mutual
TLS with `tls_client_ca`); `health_port` then serves plaintext health checks for probes. With
tokens configured, the auth interceptor is outermost, so an unauthenticated call runs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer
from prometheus_client import CollectorRegistry

from service.batching import Batcher
from service.config import ServiceConfig
from service.doors.build import Doors, build_doors
from service.doors.calls import Calls, Model, Serving
from service.doors.grpc_server import GrpcFront
from service.doors.http.server import HttpDoor, HttpFront
from service.doors.ports import port_error
from service.engine import Engine
from service.errors import FailedPrecondition, InvalidInput, NotFound, shown
from service.fault_hooks import FaultHooks
from service.jobs import Job
from service.metrics import Metrics
from service.process import Fronts, Lifecycle, run, signal_queue

log = logging.getLogger(__name__)


class Server:
    """Everything one serving process holds. Build with `build_server`; `start()`, then `stop()`."""

    def __init__(self, config: ServiceConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = Metrics(registry)
        self.serving = Serving()
        self.lifecycle = Lifecycle(config, self.metrics, registry)
        self.health = self.lifecycle.health
        self.hooks = FaultHooks.from_config(config)
        tracing = self.lifecycle.tracing
        self.engine = Engine(config, self.metrics, self.hooks, tracing)
        self.threads = self.engine.threads
        # Every door over one call layer; the HTTP door (docs/http.md) on its own port, drained with gRPC.
        doors = build_doors(config, Calls(config, self.serving, self.metrics, tracing), self.health,
                            self.engine.workers)
        self.grpc, self.port = doors.grpc.server, doors.grpc.port
        self.http: HttpDoor | None = doors.http
        self.http_port = self.http.port if self.http is not None else 0
        self._front = Fronts(GrpcFront(self.grpc, self.serving),
                             HttpFront(self.http, self.serving) if self.http is not None else None)
        if self.hooks.armed:
            log.warning("fault hooks armed (test builds only): %s", self.hooks.armed)
        log_doors(config, doors, self.lifecycle.health_port)
        self._startup: asyncio.Task[None] | None = None

    @property
    def metrics_port(self) -> int:
        return self.lifecycle.metrics_port

    @property
    def health_port(self) -> int:
        return self.lifecycle.health_port

    @property
    def batcher(self) -> Batcher[Job]:
        """The batcher (it exists once the model is warm: after `ready()`)."""
        assert self.engine.batcher is not None, "the batcher starts once the model is warm. This is a bug."
        return self.engine.batcher

    async def start(self) -> None:
        """Listen, then load and warm the model in the background (see `ready()`)."""
        await self.lifecycle.open()
        await self.grpc.start()
        if self.http is not None:
            await self.http.start()
        self.engine.start()
        self._startup = asyncio.create_task(self._load_and_warm())

    async def ready(self) -> None:
        """Wait until SERVING; raises if loading or warm-up failed."""
        assert self._startup is not None, "Server.start() was not called. This is a bug."
        await asyncio.shield(self._startup)

    async def _load_and_warm(self) -> None:
        await self.engine.load()
        for name, loaded in self.engine.models.items():
            self.serving.add(Model(loaded.spec, loaded.admission, loaded.aliases, loaded.config),
                             default=name == self.engine.default)
        if self.config.model_control == "explicit":
            self.serving.repository = EngineRepository(self.engine, self.serving, self.health, self.config)
        await self.lifecycle.serving({"port": self.port, "http_port": self.http_port},
                                     [n for model in self.serving.models.values() for n in model.names])
        for spec in (m.spec for m in self.serving.models.values()):
            log.info("serving %s v%s on %s:%d (%s, %s)", spec.name, spec.version, self.config.host, self.port,
                     spec.device, spec.precision)

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop (service/process.py `Lifecycle.drain`). `grace` defaults to `drain_grace_s`;
        0 stops at once."""
        await self.lifecycle.drain(grace, self._front, self.engine, self._startup)


class EngineRepository:
    """Run-time load and unload (service/doors/calls.py `Repository`, `--model-control explicit`) over the engine,
    keeping the doors' registry and the per-model readiness (grpc.health, by each of a model's names) in step:
    a model is served once warm; one being unloaded leaves the registry first (its names are NOT_FOUND from then
    on), its accepted calls are answered, then its memory goes back."""

    def __init__(self, engine: Engine, serving: Serving, health: HealthServicer, config: ServiceConfig) -> None:
        self._engine = engine
        self._serving = serving
        self._health = health
        self._configured = {e.name: e for e in config.model_entries} if config.models else {}

    async def load(self, name: str, path: str, settings: Mapping[str, Any]) -> Model:
        configured = self._configured.get(name)
        if not path and configured is None:
            raise InvalidInput("parameters.path", f"required: model {name!r} was not configured at start-up "
                               "(a bundle or a Hugging Face folder on the server)")
        if configured is not None and not path:
            path, settings = configured.path, {**dict(configured.settings), "aliases": list(configured.aliases),
                                               **settings}
        loaded = await self._engine.load_model(name, path, settings)
        model = Model(loaded.spec, loaded.admission, loaded.aliases, loaded.config)
        self._serving.add(model)
        for n in model.names:
            await self._health.set(n, health_pb2.HealthCheckResponse.SERVING)
        return model

    async def unload(self, name: str, grace: float) -> None:
        model = self._serving.find(name)
        if model is None or name not in model.names:
            raise NotFound(f"model {shown(name)} is not served here; this service serves {self._serving.names()}")
        if model.spec.name == self._serving.default:
            raise FailedPrecondition(f"model {model.spec.name!r} is the default model (calls that name no model use "
                                     "it); it is not unloaded at run time")
        self._serving.remove(model.spec.name)
        for n in model.names:
            await self._health.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._engine.unload_model(model.spec.name, grace)


def log_doors(config: ServiceConfig, doors: Doors, health_port: int) -> None:
    grpc = doors.grpc
    if grpc.tls and health_port == 0:
        log.warning("TLS on and no plaintext health port: probes that cannot speak TLS will fail")
    log.info("gRPC port %d: %s; %s; reflection %s; health port %s", grpc.port,
             ("mutual TLS" if config.tls_client_ca else "TLS") if grpc.tls else "plaintext",
             f"bearer tokens required ({grpc.tokens} configured)" if grpc.tokens else "no token auth",
             "on" if config.reflection else "off", health_port or "off")
    if doors.http is not None:
        log.info("HTTP port %d: %s; bearer tokens as the gRPC port's", doors.http.port,
                 "TLS" if doors.http.tls else "plaintext")


def build_server(config: ServiceConfig, registry: CollectorRegistry) -> tuple[Server, int]:
    """Build (not start) a server bound to config.host:config.port; returns it and the bound port."""
    server = Server(config, registry)
    return server, server.port


async def serve(config: ServiceConfig, registry: CollectorRegistry) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    try:
        server, port = build_server(config, registry)
    except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
        log.error("cannot start: %s", bind_error(config, exc))
        return 1
    except (ValueError, OSError) as exc:  # unreadable certificate or token file
        log.error("cannot start: %s", exc)
        return 1
    signals = signal_queue()
    try:
        await server.start()
    except OSError as exc:  # the metrics port taken; nothing has started yet
        log.error("cannot start: %s", exc)
        await server.lifecycle.close_ports()
        return 1
    log.info("listening on %s:%d, metrics on %s; loading the model", config.host, port,
             f"{config.metrics_host or config.host}:{server.metrics_port}" if server.metrics_port else "(off)")
    assert server._startup is not None
    return await run(config, server._startup, signals, server.stop, server.engine, registry)


def bind_error(config: ServiceConfig, exc: BaseException) -> str:
    """grpcio's "Failed to bind to address ...; set GRPC_VERBOSITY=debug" as what it means and what to do
    (grpcio does not say why: a plain bind of the same address does)."""
    text = str(exc)
    if "Failed to bind" not in text:
        return text
    reason: str = "grpcio could not bind it"
    try:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((config.host, config.port))
    except OSError as error:
        reason = error.strerror or str(error)
    return port_error("gRPC", config.host, config.port, reason, "ATTN_PORT / --port")
