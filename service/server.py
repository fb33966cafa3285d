"""The serving process: `build_server(config, registry) -> (server, port)` kept apart from `serve()`.

Start-up: listen at once (liveness `""` SERVING), load and warm the model in a thread, then report
the AttentionService SERVING (readiness). Shutdown (SIGTERM): readiness NOT_SERVING, keep serving
for `drain_delay_s`, refuse new calls with UNAVAILABLE, give accepted calls `drain_grace_s` to
finish (what cannot finish is answered UNAVAILABLE "shutting down" just before the grace ends),
then stop the model thread and exit 0. A second signal stops at once. The last log line is the
call ledger (started = handled by code; queue empty).

Security (service/security.py): with `tls_cert`/`tls_key` the gRPC port speaks TLS only (mutual
TLS with `tls_client_ca`); `health_port` then serves plaintext health checks for probes. With
tokens configured, the auth interceptor is outermost, so an unauthenticated call runs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from model.default import ensure_default_bundle
from proto.attention.v1.wire import SERVICE_NAME
from service.batching import Batcher, BatchLimits, ModelThreads
from service.config import ServiceConfig
from service.device import default_batch_tokens, default_threads, default_workers, is_cuda
from service.edge import Edge, Serving
from service.fault_hooks import FaultHooks
from service.grpc_metrics import MetricsInterceptor
from service.jobs import Job, ModelSpec
from service.kserve import SERVICE_NAME as KSERVE_NAME
from service.kserve import KServeServicer
from service.metrics import Metrics
from service.runner import Runner
from service.security import AuthInterceptor, TokenChecker, load_tokens, server_credentials
from service.servicer import AttentionServicer

log = logging.getLogger(__name__)


def grpc_options(config: ServiceConfig) -> list[tuple[str, Any]]:
    def ms(seconds: float) -> int:
        return int(seconds * 1000) if seconds > 0 else 2**31 - 1  # INT_MAX: no limit

    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second process must fail to bind, not silently share the port
        # Accept the keepalive pings our client sends (every 30 s, also when idle).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # Connection limits. Without a stream limit one connection can open streams without bound (a
        # burst of 20,000 header-only streams made other connections' calls fail CANCELLED); without
        # an age limit a call whose message never completes and that has no deadline is never
        # answered (grpcio reads the message before any handler runs, so only the connection can end it).
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
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


def model_workers(config: ServiceConfig) -> int:
    """How many model threads run batches (service/device.py has the defaults)."""
    workers = config.model_workers or default_workers(config.device, config.torch_threads or default_threads())
    if workers > 1 and is_cuda(config.device):
        raise ValueError("model_workers > 1 is for CPUs; on cuda one worker pipelines its batches")
    return workers


def batch_limits(config: ServiceConfig, spec: ModelSpec) -> BatchLimits:
    """The batcher's limits, from the config and the loaded model: computed once, before it starts."""
    tokens = config.max_batch_tokens or default_batch_tokens(config.device)
    if spec.max_length > tokens:
        if config.max_batch_tokens:
            raise ValueError(f"max_batch_tokens ({tokens}) is below the model's max_length ({spec.max_length}): "
                             "a longest sequence could never be batched")
        tokens = spec.max_length  # the device's default budget is for the reference model; one sequence must fit
    return BatchLimits(
        max_batch_tokens=tokens, max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms,
        max_age_ms=config.max_age_ms, max_queue_tokens=config.max_queue_tokens,
        max_queue_requests=config.max_queue_requests,
    )


class Server:
    """Everything one serving process holds. Build with `build_server`; `start()`, then `stop()`.

    The order is the dependencies' order: the model threads exist first; the runner loads and warms
    up on the lead thread; the batch limits follow from (config, loaded model); then the batcher
    starts with the runner, the limits and the threads, and the service reports SERVING."""

    def __init__(self, config: ServiceConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = Metrics(registry)
        self.metrics.queue_limit_tokens.set(config.max_queue_tokens)
        self.serving = Serving()
        self.health = health.aio.HealthServicer()
        self.hooks = FaultHooks.from_config(config)
        self.threads = ModelThreads(model_workers(config))
        edge = Edge(config, self.serving, self.metrics)
        self.servicer = AttentionServicer(edge, self.metrics)
        # The KServe v2 front door: the same edge (admission, batcher, outcome), error table and metrics.
        self.kserve = KServeServicer(edge, self.metrics, len(self.threads))
        doors = [SERVICE_NAME, KSERVE_NAME]
        interceptors: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor(self.metrics, doors)]
        tokens = load_tokens(config)
        if tokens:
            # Outermost: nothing else runs for an unauthenticated call.
            interceptors.insert(0, AuthInterceptor(TokenChecker(tokens), self.metrics))
        self.grpc = grpc.aio.server(interceptors=interceptors, options=grpc_options(config))
        self.grpc.add_generic_rpc_handlers((self.servicer.rpc_handler(), self.kserve.rpc_handler()))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        if config.reflection:
            names = (SERVICE_NAME, KSERVE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.grpc)
        self.health_grpc: grpc.aio.Server | None = None
        address = f"{config.host}:{config.port}"
        credentials = server_credentials(config)
        # Both raise RuntimeError "Failed to bind" when the port is taken (so_reuseport=0: no silent sharing).
        if credentials is None:
            self.port = self.grpc.add_insecure_port(address)
        else:
            self.port = self.grpc.add_secure_port(address, credentials)
        self.health_port = 0
        if config.health_port >= 0:
            self.health_grpc = grpc.aio.server(options=grpc_options(config))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_grpc)
            self.health_port = self.health_grpc.add_insecure_port(f"{config.host}:{config.health_port}")
        if self.hooks.armed:
            log.warning("fault hooks armed (test builds only): %s", self.hooks.armed)
        if tokens and credentials is None:
            log.warning("bearer tokens over plaintext: anyone on the path can read them; configure TLS")
        if credentials is not None and self.health_grpc is None:
            log.warning("TLS on and no plaintext health port: probes that cannot speak TLS will fail")
        log.info("gRPC port %d: %s; %s; reflection %s; health port %s", self.port,
                 ("mutual TLS" if config.tls_client_ca else "TLS") if credentials else "plaintext",
                 f"bearer tokens required ({len(tokens)} configured)" if tokens else "no token auth",
                 "on" if config.reflection else "off", self.health_port or "off")
        self.metrics_port = 0
        self._httpd: Any = None
        self._startup: asyncio.Task[None] | None = None

    @property
    def batcher(self) -> Batcher[Job]:
        """The batcher (it exists once the model is warm: after `ready()`)."""
        assert self.serving.batcher is not None, "the batcher starts once the model is warm. This is a bug."
        return self.serving.batcher

    async def start(self) -> None:
        """Listen, then load and warm the model in the background (see `ready()`)."""
        if self.config.metrics_port >= 0:
            # Before the gRPC ports start: a metrics port in use then stops start-up with nothing running
            # (an aio server left started would be torn down by its __del__ on a closed loop).
            host = self.config.metrics_host or self.config.host
            try:
                self._httpd, _ = start_http_server(self.config.metrics_port, host, registry=self.metrics.registry)
            except OSError as exc:
                raise OSError(f"metrics port {host}:{self.config.metrics_port}: {exc.strerror or exc}") from None
            self.metrics_port = self._httpd.server_port
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        if self.health_grpc is not None:
            await self.health_grpc.start()
        self.threads.start()
        self._startup = asyncio.create_task(self._load_and_warm())

    async def ready(self) -> None:
        """Wait until SERVING; raises if loading or warm-up failed."""
        assert self._startup is not None, "Server.start() was not called. This is a bug."
        await asyncio.shield(self._startup)

    async def _load_and_warm(self) -> None:
        config = self.config
        await self.hooks.pause("before_ready")
        bundle_dir = config.model or str(await asyncio.to_thread(ensure_default_bundle, config.bundle_cache_dir))
        runner = Runner(config, bundle_dir, self.metrics, len(self.threads))
        spec = await self.threads.call(runner.load)
        limits = batch_limits(config, spec)
        if config.warmup:
            await self.threads.call(lambda: runner.warmup(limits.max_batch_tokens, limits.max_batch_size))
        if len(config.entropy_baselines) not in (0, 1, spec.n_layers):
            raise ValueError(f"entropy_baseline has {len(config.entropy_baselines)} values; the model has "
                             f"{spec.n_layers} layers (give one value, or one per layer)")
        self.metrics.on_model(spec.n_layers, runner.diagnostics, config.entropy_baselines)
        if runner.diagnostics:
            log.info("attention health: sampling %g of batches", config.diagnostics_sample)
        batcher: Batcher[Job] = Batcher(self.hooks.runner(runner), limits, self.threads, observer=self.metrics,
                                        make_queue=self.hooks.queue(),
                                        after_batch=runner.after_batch if runner.diagnostics else None)
        batcher.start()
        self.serving.batcher, self.serving.spec = batcher, spec
        self.metrics.model_info.labels(spec.name, spec.version, spec.device, spec.precision).set(1)
        if not self.serving.draining:
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            self.metrics.ready.set(1)
        log.info("serving %s v%s on %s:%d (%s, %s)", spec.name, spec.version, config.host, self.port,
                 spec.device, spec.precision)
        if config.ready_file:
            _write_json(config.ready_file, {"port": self.port, "metrics_port": self.metrics_port,
                                            "health_port": self.health_port, "pid": os.getpid()})

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop. `grace` defaults to `drain_grace_s`; 0 stops at once.

        Returns within about `drain_delay_s + grace + 0.5 s`, whatever the model is doing.
        """
        grace = self.config.drain_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()  # readiness NOT_SERVING, liveness too
        self.metrics.ready.set(0)
        if grace > 0 and self.config.drain_delay_s > 0:
            await asyncio.sleep(self.config.drain_delay_s)
        self.serving.draining = True  # new calls that still reach a handler: UNAVAILABLE "shutting down"
        batcher = self.serving.batcher
        if batcher is not None:
            batcher.close()
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        await self.hooks.pause("in_shutdown")
        # The listener closes at once; accepted calls have `grace` to finish (the batcher keeps
        # running them). Just before grace ends we answer what is left ourselves, UNAVAILABLE
        # "shutting down", rather than let grpcio cancel the calls.
        stopping = asyncio.create_task(self.grpc.stop(grace))
        margin = min(0.25, grace / 5)
        if batcher is not None:
            await batcher.drain(grace - margin)
            # Stopping "at once" still lets a forward of a normal length end, rather than abandon it.
            await batcher.aclose(join_timeout=margin / 2 if grace > 0 else 0.5)
        self.threads.close()
        # The metrics thread notices a shutdown within its 0.5 s poll: let that overlap grpcio's stop.
        metrics_down = asyncio.to_thread(self._httpd.shutdown) if self._httpd is not None else asyncio.sleep(0)
        await asyncio.gather(stopping, metrics_down)
        if self.health_grpc is not None:
            await self.health_grpc.stop(None)
        if self._httpd is not None:
            self._httpd.server_close()


def build_server(config: ServiceConfig, registry: CollectorRegistry) -> tuple[Server, int]:
    """Build (not start) a server bound to config.host:config.port; returns it and the bound port."""
    server = Server(config, registry)
    return server, server.port


async def serve(config: ServiceConfig, registry: CollectorRegistry) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    try:
        server, port = build_server(config, registry)
    except (RuntimeError, ValueError, OSError) as exc:  # port taken, unreadable certificate or token file
        log.error("cannot start: %s", exc)
        return 1
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        await server.start()
    except OSError as exc:  # the metrics port taken; nothing has started yet
        log.error("cannot start: %s", exc)
        return 1
    log.info("listening on %s:%d, metrics on :%d; loading the model", config.host, port, server.metrics_port)
    waiter = asyncio.create_task(signals.get())
    assert server._startup is not None
    await asyncio.wait({waiter, server._startup}, return_when=asyncio.FIRST_COMPLETED)
    if server._startup.done() and not server._startup.cancelled() and server._startup.exception() is not None:
        log.error("start-up failed: %s", server._startup.exception())
        waiter.cancel()
        await server.stop(0)
        return 1
    signum = await waiter
    log.info("signal %d: draining for up to %.1f s", signum, config.drain_grace_s)
    stopping = asyncio.create_task(server.stop())
    second = asyncio.create_task(signals.get())
    await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        log.info("second signal: stopping now")
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        await server.stop(0)
    second.cancel()
    log.info("stopped; ledger %s", json.dumps(ledger(registry), sort_keys=True))
    for _ in range(20):  # a forward that outlived the grace gets 0.2 s more to end
        if not server.threads.alive:
            return 0
        await asyncio.sleep(0.01)
    # Finalizing the interpreter under a thread that is inside a TorchScript forward can abort the
    # process (std::terminate when the thread wakes), so a hung model must not turn exit 0 into SIGABRT.
    log.warning("the model thread is still in a forward; exiting without waiting for it")
    logging.shutdown()
    os._exit(0)


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


def _write_json(path: str, data: dict[str, Any]) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, target)
