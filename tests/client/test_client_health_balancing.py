"""The client library's round robin uses gRPC client-side health checking on the readiness name: with
two servers behind one channel, one NOT_SERVING, every call goes to the SERVING one; flip them and the
calls follow. Real servers on 127.0.0.1:0 (issue 16; the client-side way of docs/scale-out.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2

from client import EncoderClient
from client.channel import service_config, wants_health_check
from client.errors import Unavailable
from client.messages import EncodeResult, StreamRequest
from proto.attention.v1.codec import SERVICE_NAME
from tests.support.helpers import Running

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


def stream_answers(running: Running) -> float:
    return running.sample("attention_requests_total", {"method": "EncodeStream", "code": "OK"})


async def drain_mid_stream(start_server: Callable[..., Any], max_reopens: int) -> tuple[list[Any], Running, Running]:
    """Two servers behind the client's round robin; the one holding a 40-request stream drains (SIGTERM's
    path: NOT_SERVING, 0.3 s delay, then refusals) after 10 answers. Returns every item the stream gave."""
    a, b = await start_server(drain_delay_s=0.3), await start_server(drain_delay_s=0.3)
    answered = asyncio.Event()
    items: list[Any] = []

    async def requests() -> Any:
        for n in range(40):
            if n == 10:
                await answered.wait()  # the first ten are answered by the first server
            yield StreamRequest([[1 + n % 50, 2, 3]], request_id=f"r{n}")
            await asyncio.sleep(0.02)

    async with EncoderClient([a.target, b.target], timeout=60) as client:
        stream = client.encode_stream(requests(), max_reopens=max_reopens)
        stopping = None
        async for item in stream:
            items.append(item)
            if len(items) == 10:
                holder = a if stream_answers(a) else b
                stopping = asyncio.create_task(holder.server.stop())
                answered.set()
        assert stopping is not None
        await stopping
    return items, a, b


async def test_a_stream_moves_off_a_draining_server_and_every_request_is_answered_once(
        start_server: Callable[..., Any], reference_model: Any) -> None:
    items, a, b = await drain_mid_stream(start_server, max_reopens=5)
    ids = [item.request_id for item in items]
    assert sorted(ids) == sorted(f"r{n}" for n in range(40)), "every request answered exactly once"
    assert all(isinstance(item, EncodeResult) for item in items), [i for i in items if not isinstance(i, EncodeResult)]
    for item in items:
        n = int(item.request_id[1:])
        np.testing.assert_allclose(item.hidden[0], reference_model(np.array([1 + n % 50, 2, 3]))[0], atol=1e-5, rtol=0)
    assert stream_answers(a) >= 10 and stream_answers(b) >= 10, "the stream was reopened on the other server"
    assert stream_answers(a) + stream_answers(b) == 40


async def test_without_reopens_the_drained_requests_come_back_unavailable(start_server: Callable[..., Any]) -> None:
    """max_reopens=0 keeps the single-stream behaviour: what the draining server refused is answered
    UNAVAILABLE in the stream, and the rest is never sent."""
    items, _, _ = await drain_mid_stream(start_server, max_reopens=0)
    refused = [item for item in items if isinstance(item, Unavailable)]
    assert refused and all(item.request_id for item in refused)
