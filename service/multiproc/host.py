"""The model process of `edge_processes` > 0: `serve_with_edges(config)` is `python -m service` then.

It owns the device, the runner, the model threads and the one batcher (service/engine.py
`Engine`), and serves them to its edge processes (service/multiproc/edge_worker.py) over a Unix
socket in a private directory (mode 0700, removed at exit; one a killed model process left behind
is removed by the next start, sweep_leftovers). It holds no secret: the bearer tokens reach the
edges in their HELLO frame. It also serves /metrics (every
process's, summed by prometheus_client's MultiProcessCollector) and the plaintext health port.

The port. With `--port 0` it picks one; either way it holds the port with a bound, never-listening
SO_REUSEPORT socket before any edge starts, and hands the number to the edges, which listen on it
with SO_REUSEPORT (the kernel spreads connections over them). A service in one process (SO_REUSEPORT
off) cannot bind that port, nor can this one bind a port such a service holds. Another service with
edge processes, run by the same user, could join the group: an exclusive lock on
`$TMPDIR/attention-service-<uid>-port-<port>.lock` refuses that one ("port held by another service");
the file is removed at exit, and one that no process holds by the next start.

Start-up: load and warm the model, start the edges, and report SERVING (readiness, ready file) once
every edge is serving. Shutdown (SIGTERM): the same drain as one process's, in every process at
once: readiness NOT_SERVING here and in the edges (DRAIN), `drain_delay_s`, then new calls
UNAVAILABLE, accepted ones answered by the batcher within `drain_grace_s` (what cannot finish:
UNAVAILABLE "shutting down" just before the grace ends), the edges exit 0, then this process logs the
call ledger of every process together and exits 0. A second signal stops everything at once.

A crashed edge: logged as an error and restarted (its port share is taken over by the others
meanwhile); more than `MAX_RESTARTS` crashes within `RESTART_WINDOW_S` fail the service loudly
(drain and exit 1), as a crash loop would otherwise hide. A crashed model process: the edges see the
socket close, fail their unanswered calls UNAVAILABLE and exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, multiprocess, values

from service.batching import Batcher, Item, Request
from service.config import MODEL_SETTINGS, ServiceConfig
from service.doors.ports import port_error
from service.engine import Engine
from service.errors import ModelFailure, ServiceError
from service.fault_hooks import FaultHooks
from service.jobs import Job, ModelSpec
from service.metrics import Metrics
from service.multiproc import frames
from service.multiproc.edge_worker import CONFIG, SOCKET, edge_name
from service.process import Lifecycle, run, signal_queue
from service.tracing import unpacked

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


def enable_multiprocess_metrics(directory: Path) -> None:
    """prometheus_client's multiprocess mode for this process and the edges it starts (they inherit the
    variable). The library picks its value class from the variable when it is imported, so it is
    picked again here, with the library's own function, before any metric exists."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def reserve_port(host: str, port: int) -> tuple[socket.socket, int, PortLock]:
    """Hold host:port for this service's edges (see the module docstring); returns the holder, the
    port (picked when 0) and the held lock. OSError when the port is taken."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    holder = socket.socket(family, kind, proto)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        holder.bind(address)
    except OSError as exc:
        holder.close()
        raise OSError(port_error("gRPC", host, port, exc, "ATTN_PORT / --port")) from None
    port = holder.getsockname()[1]
    lock = PortLock(Path(tempfile.gettempdir()) / f"{PREFIX}{os.getuid()}-port-{port}.lock")
    if not lock.acquire():
        holder.close()
        raise OSError(port_error("gRPC", host, port, "held by another service's edge processes",
                                 "ATTN_PORT / --port")) from None
    return holder, port, lock


class PortLock:
    """An exclusive flock on a file that is removed on release. Whoever removes the file holds the
    lock while doing so, and a lock is taken only on the file the path still names, so two holders
    are never possible (one could otherwise lock a file just removed while another locks its
    successor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self) -> bool:
        """Take the lock, or False when another process holds it."""
        for _ in range(10):  # each retry means another process removed the file meanwhile
            f = open(self.path, "a")  # noqa: SIM115  (held until release)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                return False
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    self._file = f
                    return True
            except FileNotFoundError:
                pass
            f.close()
        return False

    def release(self) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)
            self._file.close()
            self._file = None

    def __enter__(self) -> PortLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


PREFIX = "attention-service-"  # the private directories (+ "<owner pid>-") and port lock files (+ "<uid>-port-")


def private_directory() -> Path:
    """The model process's private directory (mode 0700), named after its pid so that a later start
    can tell whether its owner is gone (sweep_leftovers)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))


def sweep_leftovers(tmp: Path | None = None) -> list[Path]:
    """Remove what model processes of this user that were killed (kill -9, OOM) left in the temp
    folder: private directories whose owner is gone, and port lock files that no process holds.
    Returns what was removed. A directory of an earlier version (no pid in its name) is removed
    when its socket refuses connections."""
    tmp = tmp if tmp is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    uid = os.getuid()
    for path in sorted(tmp.glob(f"{PREFIX}*")):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            continue
        if stat.S_ISDIR(st.st_mode):
            if _owner_gone(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        elif path.name.startswith(f"{PREFIX}{uid}-port-") and path.name.endswith(".lock"):
            lock = PortLock(path)
            if lock.acquire():
                lock.release()
                removed.append(path)
    return removed


def _owner_gone(directory: Path) -> bool:
    owner = re.fullmatch(rf"{PREFIX}(\d+)-[^-]+", directory.name)
    if owner is not None:
        try:
            os.kill(int(owner.group(1)), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive (another user's pid now: not ours to judge)
            return False
        return False
    sock = directory / SOCKET
    if not sock.exists():
        return False  # an earlier version's model process still loading, or not ours
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(sock))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


@dataclass(eq=False)
class EdgeSlot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class ModelHost:
    """The model process: the engine, the edge processes it spawns, and the socket they reach it on."""

    def __init__(self, config: ServiceConfig, directory: Path, port: int, http_port: int = -1) -> None:
        self.config = config
        self.directory = directory
        self.port = port
        self.http_port = http_port  # the HTTP door's (docs/http.md), held like the gRPC port; -1: off
        self.metrics = Metrics(CollectorRegistry())
        self.totals = CollectorRegistry()  # every process's metrics, summed: /metrics and the ledger
        multiprocess.MultiProcessCollector(self.totals, path=str(directory / "metrics"))  # type: ignore[no-untyped-call]
        self.lifecycle = Lifecycle(config, self.metrics, self.totals, "model", self._edges)
        self.health = self.lifecycle.health
        self.hooks = FaultHooks.from_config(config)
        self.engine = Engine(config, self.metrics, self.hooks, self.lifecycle.tracing)
        self.threads = self.engine.threads
        self.slots = [EdgeSlot(i) for i in range(config.edge_processes)]
        self.batcher: Batcher[Job] | None = None
        self.spec: ModelSpec | None = None
        self.stopping = False
        self.failed = asyncio.Event()  # a crash loop: the service stops, exit 1
        self._crashes: list[float] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._unix: asyncio.Server | None = None
        self.startup: asyncio.Task[None] | None = None
        self.max_frame = frames.max_frame(config.max_message_bytes)

    def _edges(self) -> list[tuple[str, int]]:
        """The edge processes running now, by name and pid (their health on /metrics)."""
        return [(edge_name(slot.index), slot.proc.pid) for slot in self.slots
                if slot.proc is not None and slot.proc.returncode is None]

    @property
    def metrics_port(self) -> int:
        return self.lifecycle.metrics_port

    @property
    def health_port(self) -> int:
        return self.lifecycle.health_port

    async def start(self) -> None:
        await self.lifecycle.open()
        self.engine.start()
        self.startup = asyncio.create_task(self._load_and_start_edges())

    async def _load_and_start_edges(self) -> None:
        config = self.config
        self.batcher, self.spec = await self.engine.load()
        # No secret in the file: the bearer tokens go to each edge in its HELLO (_connection), so a
        # directory left behind by a killed process holds none. 0600 in a 0700 directory all the same.
        # The models reach the edges in their HELLO, with each one's own settings: not in this file.
        edge_config = {**_fields(config), "port": self.port, "http_port": self.http_port, "ready_file": "",
                       "auth_tokens": "", "models": [], "models_file": ""}
        with os.fdopen(os.open(self.directory / CONFIG, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(edge_config, f)
        self._unix = await asyncio.start_unix_server(self._connection, str(self.directory / SOCKET))
        for slot in self.slots:
            await self._spawn(slot)
        await asyncio.gather(*(slot.ready.wait() for slot in self.slots))
        if self.stopping:
            return
        await self.lifecycle.serving({
            "port": self.port, "http_port": max(self.http_port, 0),
            "edge_pids": [s.proc.pid for s in self.slots if s.proc is not None]},
            [n for model in self.engine.models.values() for n in model.names])
        spec = self.spec
        log.info("serving %s v%s on %s:%d through %d edge processes (%s, %s)", spec.name, spec.version,
                 config.host, self.port, len(self.slots), spec.device, spec.precision)

    async def _spawn(self, slot: EdgeSlot) -> None:
        slot.ready.clear()
        slot.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service.multiproc.edge_worker", str(self.directory), str(slot.index))
        log.info("edge %d started (pid %d)", slot.index, slot.proc.pid)
        self._watchers.append(asyncio.create_task(self._watch(slot, slot.proc)))

    async def _watch(self, slot: EdgeSlot, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        multiprocess.mark_process_dead(proc.pid, str(self.directory / "metrics"))  # type: ignore[no-untyped-call]
        if self.stopping:
            if code != 0:
                log.error("edge %d (pid %d) exited %d during shutdown", slot.index, proc.pid, code)
            return
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < RESTART_WINDOW_S] + [now]
        if len(self._crashes) > MAX_RESTARTS:
            log.error("edge %d (pid %d) exited %d: %d edge crashes within %.0f s; stopping the service",
                      slot.index, proc.pid, code, len(self._crashes), RESTART_WINDOW_S)
            self.failed.set()
            return
        log.error("edge %d (pid %d) exited %d; restarting it", slot.index, proc.pid, code)
        await self._spawn(slot)

    # -- one edge's connection -------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Every model, in the order SUBMIT frames index them (the engine's models do not change: run-time load
        # and unload are for one process, service/config.py).
        lanes = [loaded.admission for loaded in self.engine.models.values()]
        writer.write(frames.hello([frames.Served(m.spec, m.aliases, {k: getattr(m.config, k) for k in MODEL_SETTINGS})
                                   for m in self.engine.models.values()], self.engine.default, self.engine.workers,
                                  self.config.auth_tokens))
        owner: dict[int, Any] = {}  # call -> the lane its jobs went to
        calls: dict[int, list[Item[Job]]] = {}
        slot: EdgeSlot | None = None
        try:
            while True:
                kind, call, body = await frames.read_frame(reader, self.max_frame)
                if kind == frames.SUBMIT:
                    deadline, jobs, model, traced = frames.read_submit(body)
                    if model >= len(lanes):
                        raise frames.FrameError(f"model index {model}: {len(lanes)} models served")
                    batcher = owner[call] = lanes[model]
                    link = unpacked(traced)  # the edge's call span, which this model's forward spans link to
                    try:
                        items = batcher.submit([Request(job, job.length, job.key, link) for job in jobs], deadline)
                    except ServiceError as exc:  # refused: Overloaded, ShuttingDown
                        writer.write(frames.error(call, -1, exc))
                        continue
                    calls[call] = items
                    for index, item in enumerate(items):
                        item.future.add_done_callback(functools.partial(self._answer, writer, calls, call, index))
                elif kind == frames.CANCEL:
                    if (cancelled := calls.pop(call, None)) is not None:
                        owner.pop(call).cancel(cancelled)
                elif kind == frames.READY:
                    pid = frames.read_message(body)["pid"]
                    slot = next((s for s in self.slots if s.proc is not None and s.proc.pid == pid), None)
                    if slot is None:
                        raise frames.FrameError(f"READY from pid {pid}, not an edge of this process")
                    slot.writer = writer
                    slot.ready.set()
                    if self.stopping:  # started just as the drain began
                        writer.write(frames.drain(0))
                elif kind == frames.BYE:
                    data = frames.read_message(body)
                    log.info("edge %s (pid %d) stopped; its calls %s", slot.index if slot else "?", data["pid"],
                             json.dumps(data["ledger"], sort_keys=True))
                else:
                    raise frames.FrameError(f"unexpected frame kind {kind} from an edge")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except frames.FrameError as exc:
            log.error("bad frame from an edge: %s", exc)
        finally:
            for call, items in calls.items():  # the edge is gone: so are its callers
                owner[call].cancel(items)
            if slot is not None and slot.writer is writer:
                slot.writer = None
            writer.close()

    def _answer(self, writer: asyncio.StreamWriter, calls: dict[int, list[Item[Job]]], call: int, index: int,
                future: asyncio.Future[Any]) -> None:
        items = calls.get(call)
        if items is not None and all(item.future.done() for item in items):
            del calls[call]
        if future.cancelled() or writer.is_closing():
            return
        exc = future.exception()
        if exc is None:
            writer.write(frames.result(call, index, future.result()))
        else:
            if not isinstance(exc, ServiceError):
                exc = ModelFailure("internal error")
                log.error("a job failed (ref=%s)", exc.ref, exc_info=future.exception())
            writer.write(frames.error(call, index, exc))

    # -- shutdown: service/process.py `Lifecycle.drain`, with the edges as the front ---------------------

    def announce(self, grace: float) -> None:
        self.stopping = True
        for slot in self.slots:
            if slot.writer is not None and not slot.writer.is_closing():
                slot.writer.write(frames.drain(grace))

    def refuse(self) -> None:
        pass  # each edge refuses on its own, from the DRAIN frame

    def close(self, grace: float) -> None:
        pass  # the edges stop accepting on their own, and exit once they have answered

    async def closed(self, margin: float) -> None:
        """The edges answer what the batcher just answered, then exit (by their own grace at the latest)."""
        procs = [s.proc for s in self.slots if s.proc is not None]
        if procs:
            _, late = await asyncio.wait([asyncio.create_task(p.wait()) for p in procs], timeout=margin + 1.0)
            for proc in procs:
                if proc.returncode is None:
                    log.error("edge pid %d did not exit in time; killing it", proc.pid)
                    proc.kill()
            if late:
                await asyncio.wait(late, timeout=2.0)
        await asyncio.gather(*self._watchers, return_exceptions=True)
        if self._unix is not None:
            self._unix.close()

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop every process. `grace` defaults to `drain_grace_s`; 0 stops at once."""
        await self.lifecycle.drain(grace, self, self.engine, self.startup)


def _fields(config: ServiceConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


async def serve_with_edges(config: ServiceConfig) -> int:
    """Run the model process until SIGTERM/SIGINT; returns the exit code."""
    for path in sweep_leftovers():
        log.info("removed %s, left by a model process that is gone", path)
    directory = private_directory()
    try:
        (directory / "metrics").mkdir()
        enable_multiprocess_metrics(directory / "metrics")
        return await _serve(config, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _serve(config: ServiceConfig, directory: Path) -> int:
    try:
        holder, port, lock = reserve_port(config.host, config.port)
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    with contextlib.ExitStack() as held:
        held.enter_context(holder)
        held.enter_context(lock)
        http_port = -1
        if config.http_port >= 0:  # the HTTP door's port, held and shared by the edges the same way
            try:
                http_holder, http_port, http_lock = reserve_port(config.host, config.http_port)
            except OSError as exc:
                log.error("cannot start: HTTP port: %s", exc)
                return 1
            held.enter_context(http_holder)
            held.enter_context(http_lock)
        try:
            host = ModelHost(config, directory, port, http_port)
        except (RuntimeError, ValueError, OSError) as exc:
            log.error("cannot start: %s", exc)
            return 1
        signals = signal_queue()
        try:
            await host.start()
        except OSError as exc:
            log.error("cannot start: %s", exc)
            await host.lifecycle.close_ports()
            return 1
        log.info("port %s:%d held for %d edge processes, metrics on %s; loading the model", config.host, port,
                 config.edge_processes,
                 f"{config.metrics_host or config.host}:{host.metrics_port}" if host.metrics_port else "(off)")
        assert host.startup is not None
        return await run(config, host.startup, signals, host.stop, host.engine, host.totals, host.failed.wait(),
                         functools.partial(shutil.rmtree, directory, ignore_errors=True))
