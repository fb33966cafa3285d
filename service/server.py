"""The serving process: `build_server(config, registry) -> (server, port)` kept apart from `serve()`.

Start-up: listen at once (liveness `""` SERVING), load and warm the model in a thread, then report
the AttentionService SERVING (readiness). Shutdown (SIGTERM): readiness NOT_SERVING, keep serving
for `drain_delay_s`, refuse new calls with UNAVAILABLE, give accepted calls `drain_grace_s` to
finish (what cannot finish is answered UNAVAILABLE "shutting down" just before the grace ends),
then stop the model thread and exit 0. A second signal stops at once. The last log line is the
call ledger (started = handled by code; queue empty).

`edge_processes` > 0 runs the gRPC side in that many edge processes instead (service/multiproc/);
this module is then the model's half (`start_model`), and `serve()` hands over at once.

Security (service/doors/security.py): with `tls_cert`/`tls_key` the gRPC port speaks TLS only (mutual
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
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from model.default import ensure_default_bundle
from proto.attention.v1.codec import SERVICE_NAME
from service.batching import Batcher, BatchLimits, ModelThreads
from service.config import ServiceConfig
from service.device import default_batch_tokens, default_threads, default_workers, is_cuda
from service.doors.calls import Calls, Serving
from service.doors.front import Front, build_front, grpc_options, ledger
from service.doors.http.door import HttpDoor
from service.fault_hooks import FaultHooks
from service.jobs import Job, ModelSpec
from service.metrics import Metrics
from service.runner import Runner

log = logging.getLogger(__name__)


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
        edge = Calls(config, self.serving, self.metrics)
        front = build_front(config, edge, self.metrics, self.health, len(self.threads))
        self.grpc, self.port = front.grpc, front.port
        self.servicer, self.kserve = front.servicer, front.kserve
        # The HTTP door (docs/http.md): the same edge, doors and metrics, on its own port.
        self.http: HttpDoor | None = None
        if config.http_port >= 0:
            self.http = HttpDoor(config, edge, self.metrics, front.servicer, front.kserve)
            log.info("HTTP port %d: %s, bearer tokens as the gRPC port's", self.http.port,
                     "TLS" if self.http.tls else "plaintext")
        self.http_port = self.http.port if self.http is not None else 0
        self._batcher: Batcher[Job] | None = None
        self.health_grpc: grpc.aio.Server | None = None
        self.health_port = 0
        if config.health_port >= 0:
            self.health_grpc, self.health_port = health_server(config, self.health)
        if self.hooks.armed:
            log.warning("fault hooks armed (test builds only): %s", self.hooks.armed)
        log_front(config, front, self.health_port)
        self.metrics_port = 0
        self._httpd: Any = None
        self._startup: asyncio.Task[None] | None = None

    @property
    def batcher(self) -> Batcher[Job]:
        """The batcher (it exists once the model is warm: after `ready()`)."""
        assert self._batcher is not None, "the batcher starts once the model is warm. This is a bug."
        return self._batcher

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
        if self.http is not None:
            await self.http.start()
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
        batcher, spec = await start_model(config, self.metrics, self.threads, self.hooks)
        self._batcher = batcher
        self.serving.batcher, self.serving.spec = batcher, spec
        if not self.serving.draining:
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            self.metrics.ready.set(1)
        log.info("serving %s v%s on %s:%d (%s, %s)", spec.name, spec.version, config.host, self.port,
                 spec.device, spec.precision)
        if config.ready_file:
            _write_json(config.ready_file, {"port": self.port, "metrics_port": self.metrics_port,
                                            "health_port": self.health_port, "http_port": self.http_port,
                                            "pid": os.getpid()})

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
        batcher = self._batcher
        if batcher is not None:
            batcher.close()
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        await self.hooks.pause("in_shutdown")
        # The listener closes at once; accepted calls have `grace` to finish (the batcher keeps
        # running them). Just before grace ends we answer what is left ourselves, UNAVAILABLE
        # "shutting down", rather than let grpcio cancel the calls.
        stopping = asyncio.create_task(self.grpc.stop(grace))
        http_stopping = asyncio.create_task(self.http.stop(grace) if self.http is not None else asyncio.sleep(0))
        margin = min(0.25, grace / 5)
        if batcher is not None:
            await batcher.drain(grace - margin)
            # Stopping "at once" still lets a forward of a normal length end, rather than abandon it.
            await batcher.aclose(join_timeout=margin / 2 if grace > 0 else 0.5)
        self.threads.close()
        # The metrics thread notices a shutdown within its 0.5 s poll: let that overlap grpcio's stop.
        metrics_down = asyncio.to_thread(self._httpd.shutdown) if self._httpd is not None else asyncio.sleep(0)
        await asyncio.gather(stopping, http_stopping, metrics_down)
        if self.health_grpc is not None:
            await self.health_grpc.stop(None)
        if self._httpd is not None:
            self._httpd.server_close()


async def start_model(config: ServiceConfig, metrics: Metrics, threads: ModelThreads,
                      hooks: FaultHooks) -> tuple[Batcher[Job], ModelSpec]:
    """Load and warm the model on the (started) model threads, then start the batcher that runs it."""
    await hooks.pause("before_ready")
    bundle_dir = config.model or str(await asyncio.to_thread(ensure_default_bundle, config.bundle_cache_dir))
    runner = Runner(config, bundle_dir, metrics, len(threads))
    spec = await threads.call(runner.load)
    limits = batch_limits(config, spec)
    if config.warmup:
        await threads.call(lambda: runner.warmup(limits.max_batch_tokens, limits.max_batch_size))
    if len(config.entropy_baselines) not in (0, 1, spec.n_layers):
        raise ValueError(f"entropy_baseline has {len(config.entropy_baselines)} values; the model has "
                         f"{spec.n_layers} layers (give one value, or one per layer)")
    metrics.on_model(spec.n_layers, runner.diagnostics, config.entropy_baselines)
    if runner.diagnostics:
        log.info("attention health: sampling %g of batches", config.diagnostics_sample)
    batcher: Batcher[Job] = Batcher(hooks.runner(runner), limits, threads, observer=metrics,
                                    make_queue=hooks.queue(),
                                    after_batch=runner.after_batch if runner.diagnostics else None)
    batcher.start()
    metrics.model_info.labels(spec.name, spec.version, spec.device, spec.precision).set(1)
    return batcher, spec


def health_server(config: ServiceConfig, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """The extra plaintext port serving only grpc.health.v1 (`health_port`), bound, not started."""
    server = grpc.aio.server(options=grpc_options(config))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, server.add_insecure_port(f"{config.host}:{config.health_port}")


def log_front(config: ServiceConfig, front: Front, health_port: int) -> None:
    if front.tls and health_port == 0:
        log.warning("TLS on and no plaintext health port: probes that cannot speak TLS will fail")
    log.info("gRPC port %d: %s; %s; reflection %s; health port %s", front.port,
             ("mutual TLS" if config.tls_client_ca else "TLS") if front.tls else "plaintext",
             f"bearer tokens required ({front.tokens} configured)" if front.tokens else "no token auth",
             "on" if config.reflection else "off", health_port or "off")


def build_server(config: ServiceConfig, registry: CollectorRegistry) -> tuple[Server, int]:
    """Build (not start) a server bound to config.host:config.port; returns it and the bound port."""
    server = Server(config, registry)
    return server, server.port


async def serve(config: ServiceConfig, registry: CollectorRegistry) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    if config.edge_processes:
        from service.multiproc.host import serve_with_edges  # the other mode; nothing of it loads in this one

        return await serve_with_edges(config)
    try:
        server, port = build_server(config, registry)
    except (RuntimeError, ValueError, OSError) as exc:  # port taken, unreadable certificate or token file
        log.error("cannot start: %s", exc)
        return 1
    signals = signal_queue()
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
    await drain_on_signal(waiter, signals, config, server.stop)
    log.info("stopped; ledger %s", json.dumps(ledger(registry), sort_keys=True))
    return await exit_after(server.threads)


def signal_queue() -> asyncio.Queue[int]:
    """SIGTERM and SIGINT as they arrive (the first drains, a second stops at once)."""
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    return signals


async def drain_on_signal(waiter: asyncio.Task[int], signals: asyncio.Queue[int], config: ServiceConfig,
                          stop: Callable[[float | None], Coroutine[Any, Any, None]]) -> None:
    """Once `waiter` has a signal: `stop()` drains within the grace; a second signal cuts it to `stop(0)`."""
    signum = await waiter
    log.info("signal %d: draining for up to %.1f s", signum, config.drain_grace_s)
    stopping = asyncio.create_task(stop(None))
    second = asyncio.create_task(signals.get())
    await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        log.info("second signal: stopping now")
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        await stop(0)
    second.cancel()


async def exit_after(threads: ModelThreads, before_exit: Callable[[], None] = lambda: None) -> int:
    """Exit code 0 once the model threads have ended; a forward that outlived the grace gets 0.2 s more."""
    for _ in range(20):
        if not threads.alive:
            return 0
        await asyncio.sleep(0.01)
    # Finalizing the interpreter under a thread that is inside a TorchScript forward can abort the
    # process (std::terminate when the thread wakes), so a hung model must not turn exit 0 into SIGABRT.
    log.warning("the model thread is still in a forward; exiting without waiting for it")
    logging.shutdown()
    before_exit()
    os._exit(0)


def _write_json(path: str, data: dict[str, Any]) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, target)
