"""grpc.health.v1 on the main port: Check and Watch, with and without bearer tokens (health is exempt).

Watch is what gRPC's client-side health checking (`healthCheckConfig` in a service config) calls, so a
break here stops such clients from calling the service at all (issue 16, item 1).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.attention.v1.codec import SERVICE_NAME

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("tokens", ["", "t0ken"], ids=["no-auth", "tokens-on"])
async def test_watch_on_the_main_port_streams_serving_then_the_shutdown(start_server, tokens):
    s = await start_server(auth_tokens=tokens)
    stub = health_pb2_grpc.HealthStub(s.channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
    first = await asyncio.wait_for(call.read(), 10)
    assert first.status == SERVING
    stopping = asyncio.create_task(s.server.stop(0.5))
    second = await asyncio.wait_for(call.read(), 10)
    assert second.status == NOT_SERVING
    await stopping
    handled = s.registry.get_sample_value("grpc_server_started_total", {
        "grpc_type": "server_stream", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Watch"})
    assert handled == 1


async def test_watch_of_an_unknown_service_says_service_unknown(start_server):
    s = await start_server()
    stub = health_pb2_grpc.HealthStub(s.channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    first = await asyncio.wait_for(call.read(), 10)
    assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    assert await call.code() == grpc.StatusCode.CANCELLED


async def test_a_check_whose_message_does_not_parse_is_invalid_argument(start_server):
    """grpcio answers a unary message it cannot decode with UNKNOWN; service/doors/message_wait.py
    decodes it itself (issue 27's "never UNKNOWN")."""
    s = await start_server()
    check = s.channel.unary_unary("/grpc.health.v1.Health/Check")  # bytes in, bytes out
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await check(b"\xff\xff\xff", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert health_pb2.HealthCheckResponse.FromString(await check(b"", timeout=10)).status == \
        health_pb2.HealthCheckResponse.SERVING
