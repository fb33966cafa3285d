"""The lifecycle both serving modes share (one process: service/server.py; edge processes:
service/multiproc/host.py): the metrics port, the health states and the plaintext health port, the
ready file, signals, the drain, and the exit.

The drain, written once (`Lifecycle.drain`): the front is told (edge processes start their own drain);
readiness NOT_SERVING (liveness too); `drain_delay_s` while calls are still served (balancers notice);
then new calls are refused UNAVAILABLE "shutting down" and the model admits nothing more; REFUSING_S
later the front stops accepting (GOAWAY: streaming callers reopen elsewhere) and accepted calls get the
rest of `drain_grace_s` to finish (what cannot finish is answered UNAVAILABLE just before the grace
ends); then the model threads stop and the ports close. A change to the drain's order or timing is made
in `Lifecycle.drain` and nowhere else; a mode supplies only its `Front` (what "refuse" and "stop
accepting" mean for it).

Signals: the first SIGTERM/SIGINT drains; a second one stops at once (`stop(0)`), except a SIGTERM
that `make` (the parent of `make run`) forwards within REPEATED_SIGTERM_S of the group's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from proto.attention.v1.codec import SERVICE_NAME
from service.config import ServiceConfig
from service.doors.grpc_server import grpc_options, ledger
from service.doors.ports import port_error
from service.metrics import Metrics
from service.metrics_http import serve_metrics
from service.process_metrics import ProcessMetrics
from service.tracing import build_tracing

if TYPE_CHECKING:
    from service.engine import Engine

log = logging.getLogger(__name__)

REFUSING_S = 0.25  # refused before the front stops accepting (a fifth of the grace at most): Lifecycle.drain


class Front(Protocol):
    """A serving mode's network side, as the drain drives it."""

    def announce(self, grace: float) -> None:
        """The drain begins (edge processes are told, and drain alongside)."""

    def refuse(self) -> None:
        """From now on, a call that reaches a handler is refused UNAVAILABLE "shutting down"."""

    def close(self, grace: float) -> None:
        """The drain's grace starts now: accepted calls have `grace` seconds to finish (returns at once)."""

    async def closed(self, margin: float) -> None:
        """Stop accepting and wait until closed (called once the model has answered what it admitted)."""


class Fronts:
    """Several fronts drained as one (the gRPC server and the HTTP door of one process)."""

    def __init__(self, *fronts: Front | None) -> None:
        self._fronts = [f for f in fronts if f is not None]

    def announce(self, grace: float) -> None:
        for front in self._fronts:
            front.announce(grace)

    def refuse(self) -> None:
        for front in self._fronts:
            front.refuse()

    def close(self, grace: float) -> None:
        for front in self._fronts:
            front.close(grace)

    async def closed(self, margin: float) -> None:
        await asyncio.gather(*(front.closed(margin) for front in self._fronts))


class Lifecycle:
    """The health servicer, the metrics port (`registry` served at /metrics, with this process's own health and
    that of the processes `children` lists: service/process_metrics.py), the plaintext health port, the process's
    tracing (None: off; service/tracing.py; `process` names this process in its traces and metrics), and the
    drain. `open()` before anything listens; `serving()` once the model is warm."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, registry: CollectorRegistry,
                 process: str = "server", children: Callable[[], Iterable[tuple[str, int]]] = lambda: ()) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = registry
        if config.metrics_port >= 0:  # served: an edge process's registry is not
            registry.register(ProcessMetrics(process, children))
        self.tracing = build_tracing(config, process)
        self.health = health.aio.HealthServicer()
        self.health_grpc: grpc.aio.Server | None = None
        self.health_port = 0
        if config.health_port >= 0:
            self.health_grpc, self.health_port = health_server(config, self.health)
        self.metrics_port = 0
        self._httpd: Any = None
        self.draining = False

    async def open(self) -> None:
        """The metrics port, then readiness NOT_SERVING and liveness SERVING, then the health port.
        The metrics port comes first: one in use stops start-up with nothing else running."""
        if self.config.metrics_port >= 0:
            self._httpd = start_metrics(self.config, self.registry)
            self.metrics_port = self._httpd.server_port
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.health_grpc is not None:
            await self.health_grpc.start()

    async def serving(self, ready: dict[str, Any], models: Sequence[str] = ()) -> None:
        """Readiness SERVING (unless a drain began meanwhile), the service's and each model name's in `models`
        (grpc.health with a model's name as the service name), and the ready file with `ready` in it."""
        if self.draining:
            return
        if self.config.gc_freeze:
            log.info("gc: %d objects of start-up frozen (gc.freeze): full collections skip them", freeze_heap())
        for name in models:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.metrics.ready.set(1)
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, {
                "metrics_port": self.metrics_port, "health_port": self.health_port, "pid": os.getpid(), **ready})

    async def drain(self, grace: float | None, front: Front, engine: Engine | None,
                    startup: asyncio.Task[None] | None = None) -> None:
        """Drain and stop (the module docstring). `grace` defaults to `drain_grace_s`; 0 stops at once.
        `engine` None: an edge process, whose model is another process's. Returns within about
        `drain_delay_s + grace + 0.5 s`, whatever the model is doing."""
        grace = self.config.drain_grace_s if grace is None else grace
        self.draining = True
        front.announce(grace)
        await self.health.enter_graceful_shutdown()  # readiness NOT_SERVING, liveness too
        self.metrics.ready.set(0)
        if grace > 0 and self.config.drain_delay_s > 0:
            await asyncio.sleep(self.config.drain_delay_s)
        front.refuse()
        if engine is not None:
            engine.close()
        if startup is not None and not startup.done():
            startup.cancel()
        if engine is not None:
            await engine.hooks.pause("in_shutdown")
        # Refusing for a moment before the front stops accepting, out of the grace: a caller told "shutting
        # down" moves on, so it has no call in flight when the gRPC server stops and grpcio's core cancels
        # every call it holds without a handler (CANCELLED for a call that never ran, grpc/grpc#41785;
        # 16 raw-stub callers at load 8 on 2 cores: 9-14 CANCELLED without the pause, none with it).
        refusing = min(REFUSING_S, grace / 5)
        if refusing > 0:
            await asyncio.sleep(refusing)
            grace -= refusing
        # The front stops accepting now; accepted calls have `grace`. Just before it ends the batcher
        # answers what is left itself, UNAVAILABLE "shutting down", rather than let the front cancel them.
        margin = min(0.25, grace / 5)
        front.close(grace)
        if engine is not None:
            await engine.drain(grace, margin)
        # The metrics thread notices a shutdown within its 0.5 s poll: let that overlap the front's close.
        metrics_down = (asyncio.create_task(asyncio.to_thread(self._httpd.shutdown)) if self._httpd is not None
                        else None)
        await front.closed(margin)
        if metrics_down is not None:
            await metrics_down
            self._httpd.server_close()
        if self.health_grpc is not None:
            await self.health_grpc.stop(None)
        await self.close_tracing()

    async def close_ports(self) -> None:
        """Close what `open()` opened, for a start-up that failed before any drain."""
        if self._httpd is not None:
            await asyncio.to_thread(self._httpd.shutdown)
            self._httpd.server_close()
            self._httpd = None
        if self.health_grpc is not None:
            await self.health_grpc.stop(None)
        await self.close_tracing()

    async def close_tracing(self) -> None:
        """The spans not yet exported go out now (within a few seconds, whatever the collector does)."""
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)


def start_metrics(config: ServiceConfig, registry: CollectorRegistry) -> Any:
    """The /metrics HTTP server on `metrics_host` (or `host`):`metrics_port` (service/metrics.py
    `serve_metrics`: scrapes bounded in what they cost this process); OSError that names the setting
    when the port cannot be had."""
    host = config.metrics_host or config.host
    try:
        httpd = serve_metrics(host, config.metrics_port, registry)
    except OSError as exc:
        setting = "ATTN_METRICS_PORT / --metrics-port"
        raise OSError(port_error("metrics", host, config.metrics_port, exc, setting)) from None
    return httpd


def health_server(config: ServiceConfig, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """The extra plaintext port serving only grpc.health.v1 (`health_port`), bound, not started."""
    server = grpc.aio.server(options=grpc_options(config))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, server.add_insecure_port(f"{config.host}:{config.health_port}")


def freeze_heap() -> int:
    """Collect garbage, then move every object this process holds into CPython's permanent generation
    (`gc.freeze`), which collections never scan; returns how many are there. Start-up builds a few hundred thousand
    objects that live as long as the process (modules, torch, gRPC, the models' Python side), and without this
    every full collection walks them all, holding the GIL for about 0.1 s on the project's machine, several times
    a second under load (docs/performance.md, "Garbage collection"). Only what exists now is frozen: cycles among
    objects made later are collected as before. An unloaded model's frozen objects are let go of by
    `service.memory.release`."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def write_ready_file(path: str, data: dict[str, Any]) -> None:
    """`data` as JSON at `path`, atomically (a reader never sees half a file)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, target)


def signal_queue() -> asyncio.Queue[int]:
    """SIGTERM and SIGINT as they arrive (the first drains, a second stops at once)."""
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    return signals


# GNU make forwards a SIGTERM it receives to its children (commands.c, fatal_error_signal), so a
# supervisor that signals the process group of `make run` reaches the service twice: directly and
# through make. Under such a parent, a SIGTERM this soon after the first is that echo, not a second
# signal. Under any other parent a second SIGTERM stops at once, as does a second Ctrl-C (SIGINT).
REPEATED_SIGTERM_S = 0.5
FORWARDING_PARENTS = frozenset({"make", "gmake"})


def parent_forwards_sigterm() -> bool:
    """Whether this process's parent is one that forwards SIGTERM to its children (Linux /proc)."""
    try:
        with open(f"/proc/{os.getppid()}/comm", encoding="utf-8") as f:
            return f.read().strip() in FORWARDING_PARENTS
    except OSError:
        return False


async def drain_on_signal(waiter: asyncio.Task[int], signals: asyncio.Queue[int], config: ServiceConfig,
                          stop: Callable[[float | None], Coroutine[Any, Any, None]],
                          echoes: bool | None = None) -> None:
    """Once `waiter` has a signal: `stop()` drains within the grace; a second signal cuts it to `stop(0)`.
    With `echoes` (default: the parent forwards SIGTERM), a SIGTERM within REPEATED_SIGTERM_S of a
    first SIGTERM is not a second signal."""
    signum = await waiter
    first_at = time.monotonic()
    if echoes is None:
        echoes = parent_forwards_sigterm()
    log.info("signal %d: draining for up to %.1f s", signum, config.drain_grace_s)
    stopping = asyncio.create_task(stop(None))
    while True:
        second = asyncio.create_task(signals.get())
        await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.done() or not second.done():
            break
        if echoes and signum == second.result() == signal.SIGTERM and time.monotonic() - first_at < REPEATED_SIGTERM_S:
            log.info("SIGTERM again within %.1f s: the process group's, forwarded by the parent; still draining",
                     REPEATED_SIGTERM_S)
            continue
        log.info("second signal: stopping now")
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        await stop(0)
        break
    second.cancel()


async def run(config: ServiceConfig, startup: asyncio.Task[None], signals: asyncio.Queue[int],
              stop: Callable[[float | None], Coroutine[Any, Any, None]], engine: Engine, totals: CollectorRegistry,
              failed: Awaitable[Any] | None = None, before_exit: Callable[[], None] = lambda: None) -> int:
    """Serve until a signal (drain, exit 0), a failed start-up (exit 1) or `failed` (drain, exit 1)."""
    waiter = asyncio.create_task(signals.get())
    failing = asyncio.ensure_future(failed) if failed is not None else None
    watched: set[asyncio.Future[Any]] = {waiter, startup} | ({failing} if failing is not None else set())
    while not (waiter.done() or (failing is not None and failing.done())):  # a start-up that succeeds ends neither
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if startup.done() and not startup.cancelled() and startup.exception() is not None:
            log.error("start-up failed: %s", startup.exception())
            waiter.cancel()
            if failing is not None:
                failing.cancel()
            await stop(0)
            return 1
        watched.discard(startup)
    if failing is not None and failing.done():
        waiter.cancel()
        await stop(None)
        log.info("stopped; ledger %s", json.dumps(ledger(totals), sort_keys=True))
        return 1
    if failing is not None:
        failing.cancel()
    await drain_on_signal(waiter, signals, config, stop)
    log.info("stopped; ledger %s", json.dumps(ledger(totals), sort_keys=True))
    return await exit_after(engine, before_exit)


async def exit_after(engine: Engine, before_exit: Callable[[], None] = lambda: None) -> int:
    """Exit code 0 once the model threads have ended; a forward that outlived the grace gets 0.2 s more."""
    for _ in range(20):
        if not engine.threads.alive:
            return 0
        await asyncio.sleep(0.01)
    # Finalizing the interpreter under a thread that is inside a TorchScript forward can abort the
    # process (std::terminate when the thread wakes), so a hung model must not turn exit 0 into SIGABRT.
    log.warning("the model thread is still in a forward; exiting without waiting for it")
    logging.shutdown()
    before_exit()
    os._exit(0)
