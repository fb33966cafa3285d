"""Late interaction through real servers on every door (issue 43): ColBERT token vectors (query and document
encodings) and MaxSim rerank, BGE-M3's dense, sparse and ColBERT outputs from one call and its compute_score
rerank, against the references the authors' packages made from the same weights (tests/data/late_reference.*,
tests/support/late_helpers.py), in fp32, within 1e-5; in one process and through edge processes; and the
response-size bound counting token vectors before any compute."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpc_aio

from model.__main__ import main as model_main
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from service.tasks import ranked
from tests.support import late_helpers as L
from tests.support.helpers import Running
from tests.support.server_process import ServerProcess

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads((L.DATA / "late_reference.json").read_text(encoding="utf-8"))
    with np.load(L.DATA / "late_reference.npz") as npz:
        return meta, {k: npz[k] for k in npz.files}


def _bundle(root: Path, folder: Path, name: str) -> Path:
    out = root / "bundle"
    assert model_main(["convert-hf", "--model-dir", str(folder), "--out", str(out), "--name", name]) == 0
    return out


@pytest.fixture(scope="module")
def pylate_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pylate")
    return _bundle(root, L.write_pylate(root / "hf"), "tiny-colbert")


@pytest.fixture(scope="module")
def m3_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("m3")
    return _bundle(root, L.write_bge_m3(root / "hf"), "tiny-m3")


def _text(texts: list[str], mode: int, **output: Any) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts],
                            output=pb.OutputOptions(return_hidden=False, vectors=mode, **output))


def _close(got: np.ndarray, want: np.ndarray, what: Any) -> None:
    assert got.shape == want.shape and float(np.abs(got - want).max()) <= ATOL, what


def _check_vectors(vectors: list[np.ndarray], arrays: dict[str, np.ndarray], key: str) -> None:
    for i, v in enumerate(vectors):
        _close(np.asarray(v, np.float32), arrays[f"{key}_{i}"], (key, i))


async def _grpc_vectors(stub: Any, texts: list[str], mode: int) -> list[np.ndarray]:
    response = await stub.Encode(_text(texts, mode), timeout=30)
    return [from_tensor(o.vectors) for o in response.outputs]


async def test_colbert_vectors_and_maxsim_rerank_on_every_door(
        start_server: Callable[..., Any], pylate_bundle: Path, reference: Any) -> None:
    meta, arrays = reference
    s: Running = await start_server(bundle=pylate_bundle, http_port=0)
    info = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vector_dim == 16 and "colbert" in info.tasks
    # attention.v1: the vectors of both encodings
    _check_vectors(await _grpc_vectors(s.stub, L.QUERIES, pb.MULTI_VECTOR_QUERY), arrays, "pylate_query")
    _check_vectors(await _grpc_vectors(s.stub, L.DOCUMENTS, pb.MULTI_VECTOR_DOCUMENT), arrays, "pylate_document")
    # attention.v1 Rerank: MaxSim, ranked as the reference ranks
    for qi, query in enumerate(L.QUERIES):
        want = meta["pylate"]["maxsim"][qi]
        response = await s.stub.Rerank(pb.RerankRequest(query=query, texts=L.DOCUMENTS), timeout=30)
        assert [r.index for r in response.results] == ranked(want, len(want))
        for r in response.results:
            assert abs(r.score - want[r.index]) <= ATOL * max(1.0, abs(want[r.index]))
    # KServe v2 (gRPC): token vectors padded with their counts, and a rerank's scores in the rows' order
    client = grpc_aio.InferenceServerClient(s.target)
    try:
        text = grpc_aio.InferInput("text", [len(L.DOCUMENTS)], "BYTES")
        text.set_data_from_numpy(np.asarray([t.encode() for t in L.DOCUMENTS], dtype=object))
        result = await client.infer("tiny-colbert", [text], outputs=[grpc_aio.InferRequestedOutput("token_vectors")],
                                    parameters={"vectors_mode": "document"})
        padded, counts = result.as_numpy("token_vectors"), result.as_numpy("token_vectors_count")
        _check_vectors([padded[i, :n] for i, n in enumerate(counts)], arrays, "pylate_document")
        assert not padded[np.arange(padded.shape[1])[None, :] >= counts[:, None]].any()  # zeros past each count
        result = await client.infer("tiny-colbert", [text], outputs=[grpc_aio.InferRequestedOutput("scores")],
                                    parameters={"query": L.QUERIES[1]})
        np.testing.assert_allclose(result.as_numpy("scores"), meta["pylate"]["maxsim"][1], rtol=1e-5, atol=ATOL)
    finally:
        await client.close()
    # HTTP: vLLM's /pooling for the vectors, TEI's /rerank for MaxSim
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30) as http:
        r = await http.post("/pooling", json={"input": L.QUERIES, "input_type": "query"})
        assert r.status_code == 200, r.text
        assert [d["object"] for d in r.json()["data"]] == ["pooling"] * len(L.QUERIES)
        _check_vectors([np.asarray(d["data"]) for d in r.json()["data"]], arrays, "pylate_query")
        r = await http.post("/rerank", json={"query": L.QUERIES[2], "texts": L.DOCUMENTS})
        assert r.status_code == 200, r.text
        want = meta["pylate"]["maxsim"][2]
        assert [x["index"] for x in r.json()] == ranked(want, len(want))
        for x in r.json():
            assert abs(x["score"] - want[x["index"]]) <= ATOL * max(1.0, abs(want[x["index"]]))


async def test_bge_m3_dense_sparse_and_colbert_from_one_call_and_its_compute_score(
        start_server: Callable[..., Any], m3_bundle: Path, reference: Any) -> None:
    meta, arrays = reference
    ref = meta["bge_m3"]
    s: Running = await start_server(bundle=m3_bundle, http_port=0)
    info = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.sparse_kind == "lexical" and info.vector_dim == 32
    for side, texts, mode in (("query", L.M3_QUERIES, pb.MULTI_VECTOR_QUERY),
                              ("document", L.M3_DOCUMENTS, pb.MULTI_VECTOR_DOCUMENT)):
        response = await s.stub.Encode(_text(texts, mode, pooling=pb.POOLING_CLS, normalize=True,
                                             sparse=pb.SparseOptions()), timeout=30)
        dense = np.stack([from_tensor(o.pooled) for o in response.outputs])
        _close(dense, arrays[f"m3_{side}_dense"], side)
        _check_vectors([from_tensor(o.vectors) for o in response.outputs], arrays, f"m3_{side}_colbert")
        for o, want in zip(response.outputs, ref[f"{side}_lexical"], strict=True):
            assert sorted(int(k) for k in want) == list(o.sparse.indices)
            np.testing.assert_allclose(list(o.sparse.values), [want[str(k)] for k in o.sparse.indices],
                                       rtol=0, atol=ATOL)
    weights = ref["weights"]
    for mode in ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense"):
        response = await s.stub.Rerank(pb.RerankRequest(query=L.M3_QUERIES[0], texts=L.M3_DOCUMENTS, scoring=mode,
                                                        weights=weights), timeout=30)
        want = [ref["compute_score"][0][di][mode] for di in range(len(L.M3_DOCUMENTS))]
        got = {r.index: r.score for r in response.results}
        np.testing.assert_allclose([got[i] for i in range(len(want))], want, rtol=1e-5, atol=ATOL)
    with pytest.raises(grpc.aio.AioRpcError) as info_error:
        await s.stub.Rerank(pb.RerankRequest(query="a", texts=["b"], scoring="nonsense"), timeout=10)
    assert info_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "scoring" in (
        info_error.value.details() or "")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30) as http:
        r = await http.post("/embed_sparse", json={"inputs": L.M3_DOCUMENTS[:1]})
        assert r.status_code == 200, r.text
        want = ref["document_lexical"][0]
        assert {str(e["index"]): e["value"] for e in r.json()[0]} == pytest.approx(want, abs=ATOL)


async def test_token_vectors_count_in_the_response_size_before_any_compute(
        start_server: Callable[..., Any], pylate_bundle: Path) -> None:
    texts = ["cats a cats ? the . dog runs a b c the cat a"] * 64  # 64 documents of up to 12 tokens, 16 wide
    roomy = await start_server(bundle=pylate_bundle)
    size = (await roomy.stub.Encode(_text(texts, pb.MULTI_VECTOR_DOCUMENT), timeout=30)).ByteSize()
    tight = await start_server(bundle=pylate_bundle, max_message_bytes=size - 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tight.stub.Encode(_text(texts, pb.MULTI_VECTOR_DOCUMENT), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_bytes" in (info.value.details() or "")
    assert tight.sample("attention_batch_size_count") == 0  # refused before any compute
    with pytest.raises(grpc.aio.AioRpcError) as info:  # chunked long inputs have no token vectors
        await roomy.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text="a b c")],
                                                 long_inputs=pb.LONG_INPUTS_CHUNK,
                                                 output=pb.OutputOptions(return_hidden=False,
                                                                         vectors=pb.MULTI_VECTOR_DOCUMENT)), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output.vectors" in (info.value.details() or "")


@pytest.fixture(scope="module")
def edge_server(pylate_bundle: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(pylate_bundle, "--edge-processes", "2")
    try:
        yield server
    finally:
        server.stop()


async def test_colbert_through_edge_processes(edge_server: ServerProcess, reference: Any) -> None:
    meta, arrays = reference
    async with grpc.aio.insecure_channel(edge_server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        _check_vectors(await _grpc_vectors(stub, L.QUERIES, pb.MULTI_VECTOR_QUERY), arrays, "pylate_query")
        response = await stub.Rerank(pb.RerankRequest(query=L.QUERIES[0], texts=L.DOCUMENTS), timeout=30)
        want = meta["pylate"]["maxsim"][0]
        assert [r.index for r in response.results] == ranked(want, len(want))
