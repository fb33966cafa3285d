"""An edge process: `python -m service.multiproc.edge_worker DIRECTORY INDEX`, started by the model
process (service/multiproc/host.py), never by hand.

It runs every door of the service (service/doors/build.py) on the shared port with SO_REUSEPORT,
admitting into the model process's batcher (service/multiproc/remote.py). Its lifecycle follows the
model process: SERVING once the model process has described its warm model (HELLO); on DRAIN the
same drain as one process's (readiness NOT_SERVING, `drain_delay_s`, new calls UNAVAILABLE, accepted
calls finish within the grace), then its call ledger (BYE) and exit 0. When the model process goes
away, unanswered calls fail UNAVAILABLE and the edge exits 1. Signals are the model process's to
handle: an edge ignores SIGINT/SIGTERM (a terminal's Ctrl-C reaches the whole process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess

from service import event_loop
from service.config import ServiceConfig
from service.doors.build import build_doors
from service.doors.calls import Calls, Model, Serving
from service.doors.grpc_server import GrpcFront, ledger
from service.doors.http.server import HttpFront
from service.metrics import Metrics
from service.multiproc import frames
from service.multiproc.remote import ModelClient
from service.process import Fronts, Lifecycle

log = logging.getLogger("service.edge_process")
SOCKET = "model.sock"
CONFIG = "config.json"


def edge_name(index: int) -> str:
    """Edge process `index`'s name in traces, logs and metrics."""
    return f"edge {index}"


async def run(directory: Path, index: int = 0) -> int:
    config = ServiceConfig(**json.loads((directory / CONFIG).read_text()))
    registry = CollectorRegistry()
    metrics = Metrics(registry)  # prometheus_client's multiprocess mode: the model process sums every process
    metrics.shared = CollectorRegistry()  # KServe statistics: every process's counts, summed (Metrics.counts)
    multiprocess.MultiProcessCollector(metrics.shared, path=str(directory / "metrics"))  # type: ignore[no-untyped-call]
    serving = Serving()
    # The model process serves /metrics and the health port; an edge serves its share of the gRPC port.
    lifecycle = Lifecycle(dataclasses.replace(config, metrics_port=-1, health_port=-1, ready_file=""), metrics,
                          registry, edge_name(index))
    limit = frames.max_frame(config.max_message_bytes)
    try:
        reader, writer = await asyncio.open_unix_connection(str(directory / SOCKET))
        kind, _, body = await frames.read_frame(reader, limit)
    except (OSError, asyncio.IncompleteReadError, frames.FrameError) as exc:
        log.error("cannot reach the model process: %s", exc)
        return 1
    if kind != frames.HELLO:
        log.error("the model process sent frame kind %d before HELLO", kind)
        return 1
    models, default, workers, tokens = frames.read_hello(body)
    config = dataclasses.replace(config, auth_tokens=tokens)  # never in the config file (issue 27, item 9)
    try:
        # Every door; the HTTP door on the HTTP port the model process holds, shared the same way (docs/http.md).
        doors = build_doors(config, Calls(config, serving, metrics, lifecycle.tracing), lifecycle.health, workers,
                            reuse_port=True)
    except (RuntimeError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    loop = asyncio.get_running_loop()
    drains: asyncio.Queue[float] = asyncio.Queue()
    lost = asyncio.Event()
    client = ModelClient(reader, writer, limit, drains.put_nowait, lost.set)
    await lifecycle.open()
    grpc, http = doors.grpc, doors.http
    await grpc.server.start()
    if http is not None:
        await http.start()
    for index, served in enumerate(models):
        serving.add(Model(served.spec, client.lane(index), served.aliases,
                          dataclasses.replace(config, **served.settings)), default=served.spec.name == default)
    await lifecycle.serving({}, [n for model in serving.models.values() for n in model.names])
    client.start()
    client.send(frames.message(frames.READY, {"pid": os.getpid(), "port": grpc.port}))
    log.info("serving on %s:%d (%s, %s), pid %d", config.host, grpc.port, "TLS" if grpc.tls else "plaintext",
             f"{grpc.tokens} bearer tokens" if grpc.tokens else "no token auth", os.getpid())

    async def stop(grace: float) -> None:
        # The model process answers every accepted job before the grace ends (as one process does).
        await lifecycle.drain(grace, Fronts(GrpcFront(grpc.server, serving),
                                            HttpFront(http, serving) if http is not None else None), None)

    drain = asyncio.create_task(drains.get())
    gone = asyncio.create_task(lost.wait())
    await asyncio.wait({drain, gone}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if drain.done():
        stopping = loop.create_task(stop(drain.result()))
        again = asyncio.create_task(drains.get())
        await asyncio.wait({stopping, again, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():  # a second signal (DRAIN 0), or the model process went away
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
            await stop(0)
        again.cancel()
    else:
        drain.cancel()
        log.error("the model process is gone: failing calls UNAVAILABLE and exiting")
        serving.draining = True
        code = 1
        await stop(min(1.0, config.drain_grace_s))  # the calls just failed get their answers out
    gone.cancel()
    client.send(frames.message(frames.BYE, {"pid": os.getpid(), "ledger": ledger(registry)}))
    await client.close()
    return code


def main(argv: list[str]) -> int:
    directory, index = Path(argv[0]), int(argv[1])
    config = json.loads((directory / CONFIG).read_text())
    logging.basicConfig(level=config["log_level"].upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{edge_name(index)}]: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return event_loop.run(run(directory, index), config["event_loop"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
