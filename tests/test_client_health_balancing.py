"""The client library's round robin uses gRPC client-side health checking on the readiness name: with
two servers behind one channel, one NOT_SERVING, every call goes to the SERVING one; flip them and the
calls follow. Real servers on 127.0.0.1:0 (issue 16; the client-side way of README "Scaling out")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2

from client import EncoderClient
from client.channel import service_config, wants_health_check
from service.servicer import SERVICE_NAME
from tests.conftest import Running

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def ok_calls(running: Running) -> float:
    return running.sample("attention_requests_total", {"method": "Encode", "code": "OK"})


async def calls_until(client: EncoderClient, predicate: Callable[[], bool], bound: int = 400) -> None:
    """Encode until `predicate` holds (the watch has delivered the new status), at most `bound` calls."""
    for _ in range(bound):
        if predicate():
            return
        await client.encode([[1, 2, 3]])
    raise AssertionError(f"still not so after {bound} calls")


def test_service_config_watches_the_readiness_name() -> None:
    config = json.loads(service_config())
    assert config["healthCheckConfig"] == {"serviceName": SERVICE_NAME}
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert "healthCheckConfig" not in json.loads(service_config(health_check=False))


def test_health_checking_is_on_where_the_client_balances() -> None:
    """On for several addresses and dns: names; off for one host:port, which may be a proxy whose
    Watch would report whichever replica it reached."""
    assert wants_health_check("ipv4:127.0.0.1:1,127.0.0.1:2")
    assert wants_health_check("dns:///attention.default.svc.cluster.local:50051")
    assert not wants_health_check("127.0.0.1:50051") and not wants_health_check("ipv4:127.0.0.1:1")
    assert "healthCheckConfig" not in dict(EncoderClient("127.0.0.1:1")._options)["grpc.service_config"]
    assert "healthCheckConfig" in dict(EncoderClient(["127.0.0.1:1", "127.0.0.1:2"])._options)["grpc.service_config"]


async def test_round_robin_skips_a_not_serving_server(start_server: Callable[..., Any]) -> None:
    a, b = await start_server(), await start_server()
    await b.server.health.set(SERVICE_NAME, NOT_SERVING)
    async with EncoderClient([a.target, b.target], timeout=10) as client:
        for _ in range(20):
            await client.encode([[1, 2, 3]])
        assert (ok_calls(a), ok_calls(b)) == (20, 0)
        assert b.sample("attention_requests_total", {"method": "Encode", "code": "UNAVAILABLE"}) == 0

        # Flip them: the calls follow the health status, and none fails on the way.
        await b.server.health.set(SERVICE_NAME, SERVING)
        await a.server.health.set(SERVICE_NAME, NOT_SERVING)
        await calls_until(client, lambda: ok_calls(b) > 0)
        before = ok_calls(a), ok_calls(b)
        for _ in range(20):
            await client.encode([[1, 2, 3]])
        assert (ok_calls(a), ok_calls(b)) == (before[0], before[1] + 20)

        # Both SERVING: round robin uses both again.
        await a.server.health.set(SERVICE_NAME, SERVING)
        await calls_until(client, lambda: ok_calls(a) > before[0])
        before = ok_calls(a), ok_calls(b)
        await asyncio.gather(*(client.encode([[1, 2, 3]]) for _ in range(20)))
        assert ok_calls(a) > before[0] and ok_calls(b) > before[1]
    unavailable = sum(s.sample("attention_requests_total", {"method": "Encode", "code": "UNAVAILABLE"}) for s in (a, b))
    assert unavailable == 0
