"""The client's TLS, mutual-TLS and bearer-token plumbing against a real server that requires them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from client import TLS, EncoderClient, SyncEncoderClient, Unauthenticated, Unavailable
from client.cli import main as cli_main
from tests.support.certs import Pki, make_pki

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def secured(start_server, pki: Pki):
    return await start_server(tls_cert=str(pki.path("server.pem")), tls_key=str(pki.path("server.key")),
                              tls_client_ca=str(pki.path("ca.pem")), auth_tokens=TOKEN)


def client_tls(pki: Pki, name: str = "client", server_name: str | None = None) -> TLS:
    return TLS.from_files(pki.path("ca.pem"), pki.path(f"{name}.pem"), pki.path(f"{name}.key"), server_name)


async def test_mutual_tls_with_a_token_round_trips(secured, pki: Pki, reference_model):
    ids = np.arange(1, 9)
    async with EncoderClient(secured.target, tls=client_tls(pki), token=TOKEN) as c:
        result = await c.encode([ids])
        assert await c.health("attention.v1.AttentionService") == "SERVING"
    np.testing.assert_allclose(result.hidden[0], reference_model(ids)[0], atol=1e-5, rtol=0)
    # server_name replaces the target's host in the certificate check: a name the certificate
    # holds passes, one it does not hold fails the handshake.
    async with EncoderClient(secured.target, tls=client_tls(pki, server_name="localhost"), token=TOKEN) as c:
        assert (await c.model_info()).name == "tiny"
    async with EncoderClient(secured.target, tls=client_tls(pki, server_name="elsewhere.example"), token=TOKEN,
                             timeout=5) as c:
        with pytest.raises(Unavailable):
            await c.model_info()


async def test_missing_or_wrong_credentials_are_refused(secured, pki: Pki):
    async with EncoderClient(secured.target, tls=client_tls(pki)) as c:
        assert await c.health() == "SERVING"  # health is exempt from the token check
        with pytest.raises(Unauthenticated) as missing:
            await c.encode([[1, 2]])
    async with EncoderClient(secured.target, tls=client_tls(pki), token="wrong") as c:
        with pytest.raises(Unauthenticated):
            await c.model_info()
    assert missing.value.code == "UNAUTHENTICATED"
    # No client certificate, or one from a foreign CA: the handshake fails (RELIABILITY.md decision 12).
    for tls in (TLS(root_certificates=pki.read("ca.pem")), client_tls(pki, "foreign-client")):
        async with EncoderClient(secured.target, tls=tls, token=TOKEN, timeout=5) as c:
            with pytest.raises(Unavailable):
                await c.model_info()


async def test_cli_tls_and_token_flags(secured, pki: Pki, tmp_path: Path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ["--target", secured.target, "--ca", str(pki.path("ca.pem")), "--cert", str(pki.path("client.pem")),
             "--key", str(pki.path("client.key"))]
    # In a thread: the sync client would block the event loop the in-process server runs on.
    assert await asyncio.to_thread(cli_main, [*flags, "--token-file", str(token_file), "info"]) == 0
    assert "tiny" in capsys.readouterr().out
    assert await asyncio.to_thread(cli_main, [*flags, "info"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_tls_settings_are_checked():
    with pytest.raises(ValueError, match="both"):
        TLS(certificate_chain=b"x")
    with pytest.raises(ValueError, match="both"):
        SyncEncoderClient("127.0.0.1:1", tls=TLS(private_key=b"x"))
