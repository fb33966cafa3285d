"""Every door of a serving process, assembled over one shared call layer: the gRPC server with its doors
(attention.v1, KServe v2, TEI's tei.v1) and, when an HTTP port is configured, the HTTP door with its dialects'
routes (OpenAI, TEI, Cohere-style rerank, KServe v2 REST, attention.v1 as JSON, vLLM's pooling). The one place
that knows the list of doors: a new door is one more entry here, its names (RPCs, routes) registered by the door itself.

Both serving modes build their doors here: one process (service/server.py) and each edge process
(service/multiproc/edge_worker.py), which is why nothing here imports the model stack (torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpc_health.v1 import health

from service.config import ServiceConfig
from service.doors.attention_v1 import AttentionServicer
from service.doors.calls import Calls
from service.doors.grpc_server import GrpcServer, build_grpc_server
from service.doors.http.encode import EncodeJson
from service.doors.http.openai import OpenAI
from service.doors.http.pooling import Pooling
from service.doors.http.rerank import Rerank
from service.doors.http.server import HttpDoor
from service.doors.http.tei import TEI
from service.doors.http.wire import Routes
from service.doors.kserve.core import KServe
from service.doors.kserve.grpc_door import KServeServicer
from service.doors.kserve.rest import KServeRest
from service.doors.tei_v1 import TeiV1


@dataclass
class Doors:
    """The bound (not started) doors of a serving process."""

    grpc: GrpcServer
    http: HttpDoor | None


def build_doors(config: ServiceConfig, calls: Calls, health_servicer: health.aio.HealthServicer, workers: int,
                *, reuse_port: bool = False) -> Doors:
    """Every door over `calls`, bound to the configured ports (the HTTP door only with `http_port` >= 0).
    Raises RuntimeError "Failed to bind" (gRPC) or OSError naming the setting (HTTP) when a port is taken."""
    kserve = KServe(calls, workers)
    grpc = build_grpc_server(config, [AttentionServicer(calls), KServeServicer(kserve), *TeiV1(calls).services()],
                             calls.metrics, health_servicer, reuse_port=reuse_port)
    http = None
    if config.http_port >= 0:
        http = HttpDoor(config, calls, http_dialects(calls, kserve), reuse_port=reuse_port)
    return Doors(grpc, http)


def http_dialects(calls: Calls, kserve: KServe) -> list[Routes]:
    """The HTTP door's dialects, each with its routes (a health route says so: `Route.health`)."""
    return [OpenAI(calls).routes(), TEI(calls).routes(), Rerank(calls).routes(), KServeRest(kserve).routes(),
            EncodeJson(calls).routes(), Pooling(calls).routes()]
