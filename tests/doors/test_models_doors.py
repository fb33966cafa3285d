"""Several models behind one port (issue 41), through every door: calls routed by name answer exactly as a
one-model server of the same bundle does (fp32), readiness per model (KServe, grpc.health), ListModels and the
repository index, the request metrics labelled by model, and run-time unload and load under load with nothing
accepted lost or wrong. Real servers on 127.0.0.1, real clients."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpc_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from service.config import ModelEntry
from tests.support.helpers import Running

TEXTS = ["a cat sat", "the dog ran far", "b c"]


@pytest.fixture
async def several(start_server: Callable[..., Any], tiny_text_bundle: Path, bert_reranker: Any,
                  bert_classifier: Any) -> Running:
    models = (ModelEntry("embedder", str(tiny_text_bundle), aliases=("text-embedding-3-small",)),
              ModelEntry("reranker", str(bert_reranker[0])), ModelEntry("classifier", str(bert_classifier[0])))
    return await start_server(model="", models=models, http_port=0, model_control="explicit")


def _encode(model: str = "") -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in TEXTS], model=model,
                            output=pb.OutputOptions(pooling=pb.POOLING_MODEL))


async def test_each_model_answers_by_name_as_alone_on_every_door(
        several: Running, start_server: Callable[..., Any], tiny_text_bundle: Path, bert_reranker: Any,
        bert_classifier: Any) -> None:
    s = several
    alone_text = await start_server(bundle=tiny_text_bundle)
    alone_rerank = await start_server(bundle=bert_reranker[0])
    alone_classify = await start_server(bundle=bert_classifier[0])
    # attention.v1: by name, by alias, and the default (the first model)
    want = await alone_text.stub.Encode(_encode(), timeout=30)
    for name in ("embedder", "text-embedding-3-small", ""):
        got = await s.stub.Encode(_encode(name), timeout=30)
        for a, b in zip(got.outputs, want.outputs, strict=True):
            assert np.array_equal(from_tensor(a.pooled), from_tensor(b.pooled)), name
            assert np.array_equal(from_tensor(a.hidden), from_tensor(b.hidden)), name
    rerank = pb.RerankRequest(query="a cat", texts=TEXTS)
    want_rerank = await alone_rerank.stub.Rerank(rerank, timeout=30)
    got_rerank = await s.stub.Rerank(pb.RerankRequest(query="a cat", texts=TEXTS, model="reranker"), timeout=30)
    assert [(r.index, r.score) for r in got_rerank.results] == [(r.index, r.score) for r in want_rerank.results]
    classify = pb.ClassifyRequest(texts=TEXTS)
    want_classify = await alone_classify.stub.Classify(classify, timeout=30)
    got_classify = await s.stub.Classify(pb.ClassifyRequest(texts=TEXTS, model="classifier"), timeout=30)
    assert str(got_classify.results) == str(want_classify.results)
    listed = await s.stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert [m.name for m in listed.models] == ["embedder", "reranker", "classifier"]
    assert list(listed.models[0].aliases) == ["text-embedding-3-small"]
    assert (await s.stub.GetModelInfo(pb.GetModelInfoRequest(model="reranker"), timeout=10)).name == "reranker"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(_encode("nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "embedder" in (info.value.details() or "")
    # KServe v2 over gRPC: readiness and the index per model, a rerank by model_name
    client = grpc_aio.InferenceServerClient(s.target)
    try:
        for name in ("embedder", "reranker", "classifier"):
            assert await client.is_model_ready(name)
        assert not await client.is_model_ready("nope")
        index = await client.get_model_repository_index()
        assert sorted(m.name for m in index.models) == ["classifier", "embedder", "reranker"]
        text = grpc_aio.InferInput("text", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.asarray([t.encode() for t in TEXTS], dtype=object))
        result = await client.infer("reranker", [text], outputs=[grpc_aio.InferRequestedOutput("scores")],
                                    parameters={"query": "a cat"})
        by_index = {r.index: r.score for r in want_rerank.results}
        assert result.as_numpy("scores").tolist() == pytest.approx([by_index[i] for i in range(len(TEXTS))],
                                                                     rel=0, abs=0)
    finally:
        await client.close()
    # grpc.health: each model's name is a service
    health = health_pb2_grpc.HealthStub(s.channel)
    for name in ("embedder", "text-embedding-3-small", "reranker", "classifier"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
    # HTTP: OpenAI by name and alias, KServe REST readiness per model
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30) as http:
        for name in ("embedder", "text-embedding-3-small"):
            r = await http.post("/v1/embeddings", json={"model": name, "input": TEXTS})
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(np.asarray([d["embedding"] for d in r.json()["data"]], np.float32),
                                          np.stack([from_tensor(o.pooled) for o in want.outputs]))
        ids = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
        assert {"embedder", "reranker", "classifier", "text-embedding-3-small"} <= ids
        for name in ("embedder", "reranker", "classifier"):
            assert (await http.get(f"/v2/models/{name}/ready")).status_code == 200
        assert (await http.get("/v2/models/nope/ready")).status_code == 404
    # the request metrics carry the model
    assert s.sample("attention_requests_total", {"method": "Rerank", "code": "OK", "model": "reranker"}) == 1
    assert s.sample("attention_requests_total", {"method": "Classify", "code": "OK", "model": "classifier"}) == 1


async def test_unload_and_load_under_load_lose_nothing(several: Running, start_server: Callable[..., Any],
                                                       tiny_text_bundle: Path, bert_classifier: Any) -> None:
    s = several
    want = await (await start_server(bundle=tiny_text_bundle)).stub.Encode(_encode(), timeout=30)
    want_pooled = [from_tensor(o.pooled) for o in want.outputs]
    stop = asyncio.Event()
    embedded, classified, refused = 0, 0, []

    async def embedder_caller() -> None:
        nonlocal embedded
        while not stop.is_set():
            got = await s.stub.Encode(_encode("embedder"), timeout=30)  # never refused, always right
            assert all(np.array_equal(from_tensor(o.pooled), w) for o, w in zip(got.outputs, want_pooled,
                                                                                  strict=True))
            embedded += 1

    async def classifier_caller() -> None:
        nonlocal classified
        while not stop.is_set():
            try:
                await s.stub.Classify(pb.ClassifyRequest(texts=TEXTS, model="classifier"), timeout=30)
                classified += 1
            except grpc.aio.AioRpcError as e:
                refused.append(e.code())
                await asyncio.sleep(0.01)

    callers = [asyncio.create_task(embedder_caller()) for _ in range(2)] + [
        asyncio.create_task(classifier_caller()) for _ in range(2)]
    client = grpc_aio.InferenceServerClient(s.target)
    try:
        await asyncio.sleep(0.3)
        await client.unload_model("classifier")
        assert not await client.is_model_ready("classifier")
        health = health_pb2_grpc.HealthStub(s.channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service="classifier"), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.sleep(0.3)
        await client.load_model("classifier")  # configured at start-up: its path is known
        assert await client.is_model_ready("classifier")
        await asyncio.sleep(0.3)
        with pytest.raises(Exception, match="default model"):
            await client.unload_model("embedder")
    finally:
        stop.set()
        await asyncio.gather(*callers)
        await client.close()
    assert embedded > 0 and classified > 0
    assert refused and set(refused) <= {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}, refused
    assert s.sample("attention_failures_total", {"reason": "internal"}) == 0


async def test_repository_control_is_off_by_default(start_server: Callable[..., Any]) -> None:
    s = await start_server()
    client = grpc_aio.InferenceServerClient(s.target)
    try:
        with pytest.raises(Exception, match="model control is off"):
            await client.unload_model("tiny")
    finally:
        await client.close()


async def test_several_models_through_edge_processes(start_server: Callable[..., Any], tiny_text_bundle: Path,
                                                     bert_reranker: Any) -> None:
    from proto.attention.v1 import attention_pb2_grpc
    from tests.support.server_process import ServerProcess

    alone_text = await start_server(bundle=tiny_text_bundle)
    alone_rerank = await start_server(bundle=bert_reranker[0])
    want = await alone_text.stub.Encode(_encode(), timeout=30)
    want_rerank = await alone_rerank.stub.Rerank(pb.RerankRequest(query="a cat", texts=TEXTS), timeout=30)
    # ServerProcess passes its bundle as the first --model: NAME=PATH entries, repeated, serve several models.
    server = await asyncio.to_thread(ServerProcess, Path(f"embedder={tiny_text_bundle}"), "--model",
                                     f"reranker={bert_reranker[0]}", "--edge-processes", "2")
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            for _ in range(4):  # the kernel spreads connections over the edges: ask a few times
                got = await stub.Encode(_encode("embedder"), timeout=30)
                for a, b in zip(got.outputs, want.outputs, strict=True):
                    assert np.array_equal(from_tensor(a.pooled), from_tensor(b.pooled))
                got_rerank = await stub.Rerank(pb.RerankRequest(query="a cat", texts=TEXTS, model="reranker"),
                                               timeout=30)
                assert [(r.index, r.score) for r in got_rerank.results] == [
                    (r.index, r.score) for r in want_rerank.results]
            listed = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert [m.name for m in listed.models] == ["embedder", "reranker"]
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest(service="reranker"), timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        await asyncio.to_thread(server.stop)
