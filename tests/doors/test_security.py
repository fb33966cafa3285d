"""Transport security and caller authentication (RELIABILITY.md 4.7, rows 32-35 and 38).

A PKI is made per test run with the openssl tool (tests/support/certs.py). The TLS matrix must fail at the
handshake, before any handler runs; bearer-token refusals must be indistinguishable to the caller
and cost no work; secrets must stay out of logs, `--help` and reprs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import SERVICE_NAME, from_tensor
from service.config import ServiceConfig, build_parser
from service.doors import security
from service.doors.security import UNAUTHENTICATED, TokenChecker
from service.server import build_server
from tests.support import helpers
from tests.support.certs import Pki, make_pki
from tests.support.helpers import Running, health, ids_request
from tests.support.reliability_helpers import assert_clean_status, batches, no_messages

Code = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
TOKENS = "tok-alpha,tok-beta"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_config(pki: Pki, *, server: str = "server", mutual: bool = True) -> dict[str, Any]:
    return {"tls_cert": str(pki.path(f"{server}.pem")), "tls_key": str(pki.path(f"{server}.key")),
            "tls_client_ca": str(pki.path("ca.pem")) if mutual else "", "health_port": 0}


def secure_channel(s: Running, pki: Pki, *, trust: str = "ca", client: str | None = "client",
                   host: str | None = None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.read(f"{trust}.pem"),
        private_key=pki.read(f"{client}.key") if client else None,
        certificate_chain=pki.read(f"{client}.pem") if client else None,
    )
    options = [("grpc.ssl_target_name_override", host)] if host else []
    return grpc.aio.secure_channel(s.target, credentials, options=options)


def handlers_run(s: Running) -> float:
    """RPCs any handler started, on any service (the interceptor counts them)."""
    return sum(x.value for f in s.registry.collect() for x in f.samples if x.name == "grpc_server_started_total")


# -- the TLS matrix (X-01, row 35) ----------------------------------------------------------------

REFUSED = {
    "plaintext client to the TLS port": {"plaintext": True},
    "TLS client without a certificate (mTLS)": {"client": None},
    "client certificate from a foreign CA": {"client": "foreign-client"},
    "client trusts another CA": {"trust": "foreign-ca"},
    "wrong host name": {"host": "not-this-server.example"},
    "expired client certificate": {"client": "expired-client"},
    "expired server certificate": {"server": "expired-server"},
}


@pytest.mark.parametrize("case", REFUSED)
async def test_tls_matrix_is_refused_at_the_handshake(start_server, tiny_bundle, pki: Pki, case: str):
    how = dict(REFUSED[case])
    s = await start_server(**tls_config(pki, server=how.pop("server", "server")))
    plaintext = how.pop("plaintext", False)
    channel = grpc.aio.insecure_channel(s.target) if plaintext else secure_channel(s, pki, **how)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await attention_pb2_grpc.AttentionServiceStub(channel).Encode(ids_request([1, 2]), timeout=10)
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the handshake's refusal ended the call, not its deadline.
    assert info.value.code() == Code.UNAVAILABLE, info.value
    assert_clean_status(info.value)
    assert handlers_run(s) == 0 and batches(s) == 0  # no handler ran: refused at the handshake
    async with secure_channel(s, pki) as good:  # and the server serves valid clients on
        if case != "expired server certificate":
            assert len((await attention_pb2_grpc.AttentionServiceStub(good).Encode(
                ids_request([1, 2]), timeout=10)).outputs) == 1


async def test_valid_mutual_tls_is_served_and_probes_use_the_plaintext_health_port(
        start_server, pki: Pki, reference_model):
    s = await start_server(**tls_config(pki))
    async with secure_channel(s, pki) as channel:
        ids = np.arange(1, 20)
        response = await attention_pb2_grpc.AttentionServiceStub(channel).Encode(ids_request(ids), timeout=10)
        np.testing.assert_allclose(from_tensor(response.outputs[0].hidden), reference_model(ids)[0], atol=1e-5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.health_port}") as probe:
        assert await health(probe) == SERVING and await health(probe, "") == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:  # only health lives there
            await attention_pb2_grpc.AttentionServiceStub(probe).Encode(ids_request([1]), timeout=10)
        assert info.value.code() == Code.UNIMPLEMENTED


async def test_server_side_tls_without_client_certificates(start_server, pki: Pki):
    s = await start_server(**tls_config(pki, mutual=False))
    async with secure_channel(s, pki, client=None) as channel:
        assert len((await attention_pb2_grpc.AttentionServiceStub(channel).Encode(
            ids_request([1, 2]), timeout=10)).outputs) == 1


# -- bearer tokens (X-03, X-04, rows 32-33) -------------------------------------------------------

BAD_CREDENTIALS = {
    "missing": (),
    "wrong token": (("authorization", "Bearer tok-gamma"),),
    "empty token": (("authorization", "Bearer "),),
    "a prefix of a token": (("authorization", "Bearer tok-alph"),),
    "wrong scheme": (("authorization", "Basic dG9rLWFscGhhOg=="),),
    "token without scheme": (("authorization", "tok-alpha"),),
    "duplicated, valid then wrong": (("authorization", "Bearer tok-alpha"), ("authorization", "Bearer nope")),
    "duplicated, both valid": (("authorization", "Bearer tok-alpha"), ("authorization", "Bearer tok-beta")),
    "token in another header": (("x-api-key", "tok-alpha"),),
}


async def test_bad_credentials_get_one_identical_answer_and_no_work(start_server, fault_bundle):
    s = await start_server(bundle=fault_bundle, auth_tokens=TOKENS)
    stub = attention_pb2_grpc.AttentionServiceStub(s.channel)
    for _ in range(20):  # 180 refusals
        for metadata in BAD_CREDENTIALS.values():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Encode(ids_request([1, 2]), metadata=metadata, timeout=10)
            assert info.value.code() == Code.UNAUTHENTICATED
            assert info.value.details() == UNAUTHENTICATED.message  # the same whatever was wrong
            assert_clean_status(info.value, secrets=("tok-",))
    assert handlers_run(s) == 0 and batches(s) == 0  # refused before any handler ran
    assert s.sample("attention_requests_total", {"method": "Encode", "code": "UNAUTHENTICATED"}) == 0
    by_reason = {r: s.sample("attention_auth_failures_total", {"reason": r})
                 for r in ("missing", "invalid", "scheme", "duplicate")}
    assert by_reason == {"missing": 40, "invalid": 60, "scheme": 40, "duplicate": 40}
    # No work: refused before any handler ran (above). How fast is a benchmark's question, not this test's.


async def test_every_method_but_health_needs_a_token(start_server):
    s = await start_server(auth_tokens=TOKENS)
    good = (("x-request-id", "a"), ("authorization", "Bearer tok-beta"), ("x-trace", "b"))  # any position
    stub = attention_pb2_grpc.AttentionServiceStub(s.channel)
    assert len((await stub.Encode(ids_request([1, 2]), metadata=good, timeout=10)).outputs) == 1
    assert len((await stub.Encode(ids_request([1]), metadata=(("authorization", "bearer tok-alpha"),),
                                  timeout=10)).outputs) == 1  # the scheme is case-insensitive
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=10)).name == "tiny"

    async def stream(metadata: Any) -> list[Any]:
        async def requests() -> Any:
            yield ids_request([1, 2], request_id="s1")
        return [r async for r in stub.EncodeStream(requests(), metadata=metadata, timeout=10)]

    assert [r.request_id for r in await stream(good)] == ["s1"]
    reflection = reflection_pb2_grpc.ServerReflectionStub(s.channel)

    async def ask() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    assert len([r async for r in reflection.ServerReflectionInfo(ask(), metadata=good, timeout=10)]) == 1
    for call in (lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
                 lambda: stub.Tokenize(pb.TokenizeRequest(texts=["a"]), timeout=10),
                 lambda: _drain(stub.EncodeStream(no_messages(), timeout=10)),
                 lambda: _drain(reflection.ServerReflectionInfo(no_messages(), timeout=10)),
                 lambda: s.channel.unary_unary(f"/{SERVICE_NAME}/NoSuchMethod")(b"", timeout=10)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        assert info.value.code() == Code.UNAUTHENTICATED and info.value.details() == UNAUTHENTICATED.message
    assert await health(s.channel) == SERVING  # probes need no token


async def _drain(stream: Any) -> list[Any]:
    return [r async for r in stream]


def test_tokens_are_compared_in_constant_time_against_every_token(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    checker = TokenChecker(["first-token", "second-token", "third-token"])
    for value, expected in (("Bearer first-token", None), ("Bearer third-token", None), ("Bearer x", "invalid"),
                            ("Bearer " + "y" * 500, "invalid")):
        calls.clear()
        assert checker.refusal([("authorization", value)]) == expected
        assert len(calls) == 3  # no early exit on a match
        assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: lengths reveal nothing
    calls.clear()
    assert checker.refusal([("Authorization", "Bearer second-token")]) is None  # keys compared case-insensitively
    assert checker.refusal([]) == "missing" and checker.refusal(None) == "missing"


async def test_tokens_from_a_file_and_the_environment(start_server, tmp_path: Path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# rotated 2026-11\n\nfile-token-1\n  file-token-2  \n")
    s = await start_server(auth_tokens_file=str(tokens), auth_tokens="env-token")
    stub = attention_pb2_grpc.AttentionServiceStub(s.channel)
    for token in ("file-token-1", "file-token-2", "env-token"):
        await stub.Encode(ids_request([1]), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(ids_request([1]), metadata=(("authorization", "Bearer # rotated 2026-11"),), timeout=10)
    assert info.value.code() == Code.UNAUTHENTICATED
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no tokens"):  # fail closed, not open
        build_server(helpers.test_config(Path(s.server.config.model), auth_tokens_file=str(empty)),
                     CollectorRegistry())


async def test_secrets_stay_out_of_logs_help_and_reprs(start_server, tmp_path: Path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-from-file\n")
    s = await start_server(auth_tokens="s3cret-from-env", auth_tokens_file=str(tokens))
    stub = attention_pb2_grpc.AttentionServiceStub(s.channel)
    await stub.Encode(ids_request([1]), metadata=(("authorization", "Bearer s3cret-from-env"),), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Encode(ids_request([1]), metadata=(("authorization", "Bearer s3cret-guess"),), timeout=10)
    assert "bearer tokens required (2 configured)" in caplog.text
    config = ServiceConfig.from_args([], env={"ATTN_AUTH_TOKENS": "s3cret-from-env"})
    assert config.auth_token_list == ["s3cret-from-env"]
    assert "s3cret" not in repr(config) and "s3cret" not in repr(s.server.config)
    with pytest.raises(SystemExit):  # not a flag (`ps` shows argv), nor a prefix of --auth-tokens-file
        build_parser().parse_args(["--auth-tokens", "s3cret-on-the-command-line"])
    capsys.readouterr()  # argparse echoes what it refused: that was the caller's own doing
    assert "ATTN_AUTH_TOKENS" in build_parser().format_help()
    with pytest.raises(ValueError) as bad:
        ServiceConfig(auth_tokens="good,s3cret with space")
    assert "token 2" in str(bad.value) and "s3cret" not in str(bad.value)
    captured = capsys.readouterr()
    assert "s3cret" not in caplog.text + captured.out + captured.err


@pytest.mark.parametrize("overrides, message", [
    ({"tls_cert": "cert.pem"}, "tls_cert and tls_key must be given together"),
    ({"tls_client_ca": "ca.pem"}, "tls_client_ca (mutual TLS) needs tls_cert and tls_key"),
    ({"tls_cert": "/nonexistent/c.pem", "tls_key": "/nonexistent/k.pem"}, "tls_cert must name a readable file"),
    ({"auth_tokens_file": "/nonexistent/tokens"}, "auth_tokens_file must name a readable file"),
])
def test_security_settings_are_validated_naming_the_setting(overrides: dict[str, str], message: str):
    with pytest.raises(ValueError) as info:
        ServiceConfig(**overrides)
    assert message in str(info.value)


# -- a production configuration, end to end (X-05) ------------------------------------------------


async def test_production_configuration(start_server, pki: Pki):
    """mTLS + bearer tokens + reflection off + a plaintext health port for probes."""
    s = await start_server(**tls_config(pki), auth_tokens=TOKENS, reflection=False, max_sequences_per_call=8)
    token = (("authorization", "Bearer tok-alpha"),)
    async with secure_channel(s, pki) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        assert len((await stub.Encode(ids_request([1, 2]), metadata=token, timeout=10)).outputs) == 1
        with pytest.raises(grpc.aio.AioRpcError) as no_token:
            await stub.Encode(ids_request([1, 2]), timeout=10)
        assert no_token.value.code() == Code.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await stub.Encode(ids_request(*[[1]] * 9), metadata=token, timeout=10)
        assert too_many.value.code() == Code.INVALID_ARGUMENT
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as no_reflection:
            await _drain(reflection.ServerReflectionInfo(no_messages(), metadata=token, timeout=10))
        assert no_reflection.value.code() == Code.UNIMPLEMENTED
    async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.health_port}") as probe:
        assert await health(probe) == SERVING
    with pytest.raises(grpc.aio.AioRpcError) as plaintext:
        await asyncio.wait_for(s.stub.Encode(ids_request([1]), metadata=token, timeout=10), 15)
    assert plaintext.value.code() == Code.UNAVAILABLE
    assert dataclasses.replace(s.server.config).reflection is False
