"""The HTTP front door, with real clients against a real server on 127.0.0.1: the `openai` SDK on
/v1/embeddings (vectors equal to the gRPC door's, MiniLM equal to sentence-transformers), TEI's routes
through httpx (shapes, every error code, 429 with Retry-After, 401, TLS), the drain (readiness 503,
accepted calls finish), a caller that leaves (its queued work is cancelled) and the metrics."""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.certs import Pki, make_pki
from tests.support.helpers import Running, ids_request, wait_for
from tests.support.hf_helpers import Reference

IDS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]


def url(s: Running, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{s.server.http_port}"


def sdk(s: Running, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=url(s) + "/v1", max_retries=0, timeout=60, **kwargs)


async def grpc_pooled(s: Running, *ids: list[int], normalize: bool = True) -> np.ndarray:
    response = await s.stub.Encode(ids_request(*ids, output=pb.OutputOptions(
        return_hidden=False, pooling=pb.POOLING_MEAN, normalize=normalize)), timeout=30)
    return np.stack([from_tensor(out.pooled) for out in response.outputs])


@pytest.fixture
async def served_http(start_server: Any) -> Running:
    # The tiny model takes token ids only: /v1/embeddings takes them as its own with openai_token_ids.
    return await start_server(http_port=0, openai_token_ids=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# -- OpenAI ----------------------------------------------------------------------------------------

async def test_openai_sdk_token_ids_equal_the_grpc_door_in_float_and_base64(served_http: Running) -> None:
    s = served_http
    want = await grpc_pooled(s, *IDS)
    async with sdk(s) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        # Unasked, the SDK asks for base64 and decodes it; "float" is JSON numbers; "base64" asked is left encoded.
        for fmt in (openai.NOT_GIVEN, "float", "base64"):
            got = await client.embeddings.create(model="tiny", input=IDS, encoding_format=fmt)  # type: ignore[arg-type]
            assert got.object == "list" and got.model == "tiny"
            assert [d.index for d in got.data] == [0, 1, 2] and {d.object for d in got.data} == {"embedding"}
            vectors = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                       for d in got.data]
            np.testing.assert_allclose(np.array(vectors), want, rtol=0, atol=1e-6)
            assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, IDS))
        one = await client.embeddings.create(model="tiny", input=IDS[0])  # a flat list of ids: one sequence
        np.testing.assert_allclose(one.data[0].embedding, (await grpc_pooled(s, IDS[0]))[0], rtol=0, atol=1e-6)


async def test_openai_base64_is_little_endian_float32_and_dimensions_renormalise(served_http: Running) -> None:
    s = served_http
    want = (await grpc_pooled(s, IDS[0]))[0]
    async with httpx.AsyncClient(base_url=url(s)) as http:
        r = await http.post("/v1/embeddings", json={"model": "tiny", "input": [IDS[0]], "encoding_format": "base64",
                                                    "dimensions": 8, "user": "u-1"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, want[:8] / np.linalg.norm(want[:8]), rtol=0, atol=1e-6)
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-6
    async with sdk(s) as client:
        cut = await client.embeddings.create(model="tiny", input=[IDS[0]], dimensions=8)
        np.testing.assert_allclose(cut.data[0].embedding, vector, rtol=0, atol=1e-6)
        with pytest.raises(openai.BadRequestError) as info:
            await client.embeddings.create(model="tiny", input=[IDS[0]], dimensions=33)  # d_model is 32
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "dimensions" and error["type"] == "invalid_request_error"


async def test_openai_errors_come_in_openais_body(served_http: Running) -> None:
    async with sdk(served_http) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.embeddings.create(model="gpt-nope", input=[[1, 2]])
        assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.embeddings.create(model="tiny", input=[[1, 200]])  # id 200: outside a vocabulary of 100
        assert bad.value.body["param"] == "input[0][1]"  # type: ignore[index]
        assert "not in [0, 100)" in bad.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as text:
            await client.embeddings.create(model="tiny", input="a text")  # this model takes no text
        assert text.value.body["param"] == "input[0]"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=url(served_http)) as http:
        for body, param in [({"model": "tiny"}, "input"), ({"model": "tiny", "input": []}, "input"),
                            ({"model": "tiny", "input": [[1]], "encoding_format": "hex"}, "encoding_format"),
                            ({"model": "tiny", "input": [[1, True]]}, "input[0][1]")]:
            r = await http.post("/v1/embeddings", json=body)
            assert r.status_code == 400, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["param"] == param
        r = await http.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def test_openai_minilm_text_equals_sentence_transformers_and_the_grpc_door(
        start_server: Any, minilm_bundle: Path, minilm_reference: Reference) -> None:
    s = await start_server(bundle=minilm_bundle, http_port=0)
    ref = minilm_reference
    # Those within the model's 256 tokens, and not empty (OpenAI refuses an empty input).
    picked = [i for i, text in enumerate(ref.texts) if i not in (5, 6, 8) and text][:12]
    texts = [ref.texts[i] for i in picked]
    async with sdk(s) as client:
        got = await client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    vectors = np.array([d.embedding for d in got.data])
    np.testing.assert_allclose(vectors, ref.embeddings[picked], rtol=0, atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(ref.ids[i]) for i in picked)
    response = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts],
                                                    output=pb.OutputOptions(return_hidden=False,
                                                                            pooling=pb.POOLING_MODEL)), timeout=120)
    np.testing.assert_allclose(vectors, [from_tensor(o.pooled) for o in response.outputs], rtol=0, atol=1e-6)


# -- TEI -------------------------------------------------------------------------------------------

async def test_tei_routes_answer_in_teis_shapes(start_server: Any, tiny_text_bundle: Path) -> None:
    # The budget measured at warm-up (0), so that /info must report the one in force, not the configuration.
    s = await start_server(bundle=tiny_text_bundle, http_port=0, max_batch_tokens=0)
    texts = ["the cat", "a b c."]
    grpc_response = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts],
                                                         output=pb.OutputOptions(pooling=pb.POOLING_MODEL)), timeout=30)
    async with httpx.AsyncClient(base_url=url(s)) as http:
        embed = await http.post("/embed", json={"inputs": texts})
        assert embed.status_code == 200, embed.text
        np.testing.assert_allclose(embed.json(), [from_tensor(o.pooled) for o in grpc_response.outputs],
                                   rtol=0, atol=1e-6)
        single = await http.post("/embed", json={"inputs": "the cat", "normalize": False, "truncate": True,
                                                 "truncation_direction": "Right", "dimensions": 4})
        assert single.status_code == 200 and len(single.json()) == 1 and len(single.json()[0]) == 4
        everything = await http.post("/embed_all", json={"inputs": texts})
        assert everything.status_code == 200
        for got, out in zip(everything.json(), grpc_response.outputs, strict=True):
            np.testing.assert_allclose(got, from_tensor(out.hidden), rtol=0, atol=1e-5)
        tokens = await http.post("/tokenize", json={"inputs": texts})
        assert tokens.status_code == 200
        with_ids = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts],
                                                        output=pb.OutputOptions(pooling=pb.POOLING_MODEL,
                                                                                return_tokens=True)), timeout=30)
        assert [[t["id"] for t in row] for row in tokens.json()] == [
            from_tensor(o.token_ids).tolist() for o in with_ids.outputs]
        assert tokens.json()[0][0]["special"] is True and set(tokens.json()[0][0]) == {
            "id", "text", "special", "start", "stop"}
        ids = [t["id"] for t in tokens.json()[0]]
        decoded = await http.post("/decode", json={"ids": ids})
        assert decoded.status_code == 200 and decoded.json() == ["the cat"]
        kept = await http.post("/decode", json={"ids": [ids], "skip_special_tokens": False})
        assert kept.json() == ["[CLS] the cat [SEP]"]
        info = (await http.get("/info")).json()
        assert info["model_id"] == s.server.serving.spec.name and info["max_client_batch_size"] == 64
        assert info["model_type"] == {"embedding": {"pooling": "mean"}}
        in_force = s.server.serving.spec
        assert in_force.batch_reason.startswith("measured")
        assert info["max_batch_tokens"] == in_force.max_batch_tokens > 0
        assert (await http.get("/health")).status_code == 200


async def test_tei_error_codes_and_bodies(start_server: Any, fault_bundle: Path) -> None:
    s = await start_server(bundle=fault_bundle, http_port=0, max_queue_requests=2, max_message_bytes=1 << 16,
                           max_sequences_per_call=4)
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        async def post(body: Any, path: str = "/embed", **kwargs: Any) -> httpx.Response:
            r = await http.post(path, json=body, **kwargs) if body is not None else await http.post(path, **kwargs)
            if r.status_code != 200:
                assert set(r.json()) == {"error", "error_type"}, r.text
            return r

        r = await post({"inputs": [[1, 2], [3]], "normalize": "yes"})
        assert r.status_code == 422 and r.json()["error_type"] == "Validation" and "normalize" in r.json()["error"]
        r = await post({"inputs": [[1]] * 5})  # more than max_sequences_per_call
        assert r.status_code == 413 and "batch size 5" in r.json()["error"]
        r = await post(None, content=b"x" * (1 << 17), headers={"content-type": "application/json"})
        assert r.status_code == 413  # over max_message_bytes, refused on its Content-Length
        r = await post({"inputs": [[1], [2], [3]]})  # three sequences, a queue of two
        assert r.status_code == 429 and r.json()["error_type"] == "Overloaded"
        assert int(r.headers["Retry-After"]) >= 1
        r = await post({"inputs": [[faults.RAISE]]})
        assert r.status_code == 424 and r.json()["error_type"] == "Backend" and "ref=" in r.json()["error"]
        assert "Traceback" not in r.text
        r = await post({"inputs": [[1]], "truncation_direction": "up"})
        assert r.status_code == 422 and "Left" in r.json()["error"]
        r = await post({"inputs": []})
        assert r.status_code == 400 and r.json()["error_type"] == "Empty"
        assert (await http.get("/nowhere")).status_code == 404
        assert (await http.get("/embed")).status_code == 405
        ok = await post({"inputs": [[1], [2]]})  # healthy after all that
        assert ok.status_code == 200 and len(ok.json()) == 2
    assert s.sample("attention_requests_total", {"method": "POST /embed", "code": "RESOURCE_EXHAUSTED"}) == 1
    assert s.sample("attention_requests_total", {"method": "POST /embed", "code": "INTERNAL"}) == 1
    assert s.sample("attention_requests_total", {"method": "POST /embed", "code": "OK"}) == 1
    assert s.sample("attention_failures_total", {"reason": "queue_full"}) == 1


async def test_tokens_are_required_except_on_health_routes(start_server: Any) -> None:
    s = await start_server(http_port=0, auth_tokens="sekrit-1,sekrit-2", openai_token_ids=True)
    async with httpx.AsyncClient(base_url=url(s)) as http:
        for path in ("/health", "/", "/ping", "/v2/health/live", "/v2/health/ready"):
            assert (await http.get(path)).status_code == 200, path
        for path in ("/embed", "/"):  # POST / is TEI's inference route, not its health route
            r = await http.post(path, json={"inputs": [[1]]})
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert r.json()["error"] == "missing or invalid credentials"
        for value in ("Bearer wrong", "Basic sekrit-1"):
            r = await http.post("/embed", json={"inputs": [[1]]}, headers={"authorization": value})
            assert r.status_code == 401
        r = await http.post("/embed", json={"inputs": [[1]]}, headers={"authorization": "Bearer sekrit-2"})
        assert r.status_code == 200
    async with sdk(s, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.embeddings.create(model="tiny", input=[[1]])
    async with sdk(s, api_key="sekrit-1") as client:
        assert len((await client.embeddings.create(model="tiny", input=[[1]])).data) == 1
    assert s.sample("attention_auth_failures_total", {"reason": "missing"}) == 2
    assert s.sample("attention_auth_failures_total", {"reason": "invalid"}) == 2


async def test_tls_on_the_grpc_port_means_tls_on_the_http_port(start_server: Any, pki: Pki) -> None:
    s = await start_server(http_port=0, tls_cert=str(pki.path("server.pem")), tls_key=str(pki.path("server.key")))
    async with httpx.AsyncClient(base_url=f"https://localhost:{s.server.http_port}",
                                 verify=ssl.create_default_context(cafile=pki.path("ca.pem"))) as https:
        r = await https.post("/embed", json={"inputs": [[1, 2]]})
        assert r.status_code == 200 and len(r.json()[0]) == 32
    async with httpx.AsyncClient(base_url=url(s)) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.post("/embed", json={"inputs": [[1, 2]]})
    async with httpx.AsyncClient(base_url=f"https://localhost:{s.server.http_port}",
                                 verify=ssl.create_default_context(cafile=pki.path("foreign-ca.pem"))) as untrusted:
        with pytest.raises(httpx.ConnectError):
            await untrusted.get("/health")


# -- lifecycle -------------------------------------------------------------------------------------

async def test_the_drain_answers_503_on_readiness_and_lets_accepted_calls_finish(
        start_server: Any, fault_bundle: Path) -> None:
    faults.reset()
    s = await start_server(bundle=fault_bundle, http_port=0, model_workers=1, drain_grace_s=10.0)
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        accepted = asyncio.ensure_future(http.post("/embed", json={"inputs": [[faults.HANG]]}))
        await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)
        stopping = asyncio.ensure_future(s.server.stop(10.0))
        try:
            await wait_for(lambda: s.sample("attention_ready") == 0, 10, "the drain to begin")
            assert (await http.get("/health")).status_code == 503
            assert (await http.get("/v2/health/ready")).status_code == 503
            assert (await http.get("/v2/health/live")).status_code == 200
            refused = await http.post("/embed", json={"inputs": [[1]]})
            assert refused.status_code == 503 and refused.json()["error_type"] == "Unhealthy"
        finally:
            faults.HANG_RELEASE.set()
        r = await accepted
        assert r.status_code == 200 and len(r.json()) == 1
        await stopping
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=url(s)) as http:
            await http.get("/health")


async def test_a_caller_that_leaves_cancels_its_queued_work(start_server: Any, fault_bundle: Path) -> None:
    faults.reset()
    s = await start_server(bundle=fault_bundle, http_port=0, model_workers=1)
    try:
        async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
            holder = asyncio.ensure_future(http.post("/embed", json={"inputs": [[faults.HANG]]}))
            await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)
            with pytest.raises(httpx.TimeoutException):  # queued behind the holder; the caller gives up
                await http.post("/embed", json={"inputs": [[1, 2, 3]]}, timeout=0.3)
            await wait_for(lambda: s.sample("attention_requests_total", {"method": "POST /embed", "code": "CANCELLED"})
                           == 1, 10, "the left call's handler to be cancelled")
            assert s.sample("attention_queue_depth") == 0  # its sequence left the queue with it
            faults.HANG_RELEASE.set()
            assert (await holder).status_code == 200
        assert s.sample("attention_batch_size_count") == 1  # only the holder's batch ever ran
        assert s.sample("attention_sequences_total") == 1
    finally:
        faults.HANG_RELEASE.set()


async def test_the_http_port_is_off_at_minus_one_and_a_taken_one_fails_the_build(start_server: Any) -> None:
    from prometheus_client import CollectorRegistry

    from service.server import build_server
    from tests.support.helpers import test_config

    off = await start_server(http_port=-1)
    assert off.server.http is None and off.server.http_port == 0
    taken = await start_server(http_port=0)
    with pytest.raises(OSError, match=r"HTTP port 127\.0\.0\.1:\d+ is already in use.*ATTN_HTTP_PORT"):
        build_server(test_config(Path(str(taken.server.config.model)), http_port=taken.server.http_port),
                     CollectorRegistry())


async def test_oversized_request_lines_and_headers_are_400_and_logged_without_tracebacks(
        served_http: Running, caplog: pytest.LogCaptureFixture) -> None:
    port = served_http.server.http_port

    async def first_line(data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        return line.strip()

    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    assert await first_line(head + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n") == b"HTTP/1.0 400 Bad Request"
    assert await first_line(head + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n") == \
        b"HTTP/1.0 400 Bad Request"
    assert await first_line(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n") == b"HTTP/1.0 400 Bad Request"
    assert await first_line(b"\x16\x03\x01 not http\r\n\r\n") == b"HTTP/1.0 400 Bad Request"
    assert not [r for r in caplog.records if r.levelno >= 40 or r.exc_info], caplog.records
    async with httpx.AsyncClient(base_url=url(served_http)) as http:
        assert (await http.get("/health")).status_code == 200
