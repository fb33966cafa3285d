"""The clients people point at Text Embeddings Inference and at OpenAI-compatible servers, set up as their own
docs show, against the HTTP door on 127.0.0.1 (issue 40): huggingface_hub's InferenceClient (and its async
client) at the root URL, the cohere SDK's v2 client reranking, the OpenAI SDK with tiktoken-shaped ids, and
httpx for TEI's own routes. Every number equals the attention.v1 answer for the same input (fp32); long texts
cut by auto-truncate equal sentence-transformers' truncated vectors (the genuine all-MiniLM-L6-v2); left
truncation of texts and pairs equals transformers' tokenizer with truncation_side="left"."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
import torch

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor, to_tensor
from tests.support import family_helpers  # noqa: F401  (HF_HUB_OFFLINE=1 before huggingface_hub is imported)
from tests.support.head_helpers import hf_logits, hf_tokenizer
from tests.support.helpers import Running
from tests.support.hf_helpers import Reference, tiny_tokenizer_json

from huggingface_hub import AsyncInferenceClient, InferenceClient  # isort: skip  (after HF_HUB_OFFLINE)

HELLO_CL100K = [9906, 1917, 13]  # "Hello world." as tiktoken's cl100k_base encodes it (what LangChain sends)
TIMING = ("x-compute-time", "x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time",
          "x-compute-characters", "x-compute-tokens", "x-compute-type")


def url(s: Running) -> str:
    return f"http://127.0.0.1:{s.server.http_port}"


async def attention_pooled(s: Running, texts: list[str], normalize: bool | None = None) -> np.ndarray:
    output = pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MODEL)
    if normalize is not None:
        output.normalize = normalize
    response = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], output=output),
                                   timeout=120)
    return np.stack([from_tensor(o.pooled) for o in response.outputs])


def cosines(vectors: np.ndarray) -> np.ndarray:
    first, rest = vectors[0], vectors[1:]
    return np.asarray(rest @ first / (np.linalg.norm(rest, axis=1) * np.linalg.norm(first)))


@pytest.fixture
def hub_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """huggingface_hub's clients refuse every request under HF_HUB_OFFLINE=1, to loopback too: off for the
    test's calls (their model is a 127.0.0.1 URL), with the Hub's endpoint a closed local port, so that any call
    for the Hub fails here at once instead of leaving the machine. The sync client's shared session (kept
    alive to a server the test stops) is closed after."""
    from huggingface_hub import close_session, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    yield
    close_session()


@pytest.fixture
async def minilm(start_server: Any, minilm_bundle: Path) -> Running:
    return await start_server(bundle=minilm_bundle, http_port=0, model_alias="text-embedding-3-small")


async def test_huggingface_hub_inference_client_at_the_root_url(minilm: Running, hub_client: None) -> None:
    s, texts = minilm, ["The quick brown fox jumps over the lazy dog.", "a cat", ""]
    want = await attention_pooled(s, texts)
    client = InferenceClient(model=url(s), timeout=120)
    one = await asyncio.to_thread(client.feature_extraction, texts[0])
    assert one.shape == (1, 384)
    np.testing.assert_allclose(one[0], want[0], rtol=0, atol=1e-6)
    batch = await asyncio.to_thread(client.feature_extraction, texts)
    np.testing.assert_allclose(batch, want, rtol=0, atol=1e-6)
    similar = await asyncio.to_thread(client.sentence_similarity, texts[0], texts[1:])
    np.testing.assert_allclose(similar, cosines(await attention_pooled(s, texts, normalize=False)), rtol=0, atol=1e-6)
    async with AsyncInferenceClient(model=url(s), timeout=120) as async_client:
        got = await async_client.feature_extraction(texts[1], truncation_direction="left", truncate=True)
        np.testing.assert_allclose(got[0], want[1], rtol=0, atol=1e-6)
        np.testing.assert_allclose(await async_client.sentence_similarity(texts[0], texts[1:]), similar, rtol=0,
                                   atol=1e-6)
    async with httpx.AsyncClient(base_url=url(s), timeout=60) as http:
        r = await http.post("/", json={"inputs": texts[1], "parameters": {"normalize": False}})
        assert r.status_code == 200 and all(name in r.headers for name in TIMING), r.headers
        np.testing.assert_allclose(r.json()[0], (await attention_pooled(s, texts[1:2], normalize=False))[0], rtol=0,
                                   atol=1e-6)
        assert int(r.headers["x-compute-characters"]) == len(texts[1]) and int(r.headers["x-compute-tokens"]) == 4
        for path in ("/", "/ping", "/health"):
            assert (await http.get(path)).status_code == 200
        info = (await http.get("/info")).json()
        assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["auto_truncate"] is True
        assert info["served_model_name"] == "all-MiniLM-L6-v2" and info["max_input_length"] == 256


async def test_huggingface_hub_text_classification_on_a_classifier(
        start_server: Any, bert_classifier: tuple[Path, Path, Any], hub_client: None) -> None:
    s = await start_server(bundle=bert_classifier[0], http_port=0)
    text = "the the the c"
    want = (await s.stub.Classify(pb.ClassifyRequest(texts=[text]), timeout=30)).results[0].scores
    got = await asyncio.to_thread(InferenceClient(model=url(s), timeout=60).text_classification, text)
    assert [x.label for x in got] == sorted((x.label for x in want), key=lambda label: -{
        x.label: x.score for x in want}[label])
    np.testing.assert_allclose([x.score for x in got], sorted((x.score for x in want), reverse=True), rtol=0,
                               atol=1e-6)
    async with httpx.AsyncClient(base_url=url(s), timeout=60) as http:
        info = (await http.get("/info")).json()
        assert info["model_type"] == {"classifier": {"id2label": {"0": "neg", "1": "neutral", "2": "pos"},
                                                     "label2id": {"neg": 0, "neutral": 1, "pos": 2}}}
        single = await http.post("/invocations", json={"inputs": text})  # TEI's shape: a single input's list
        assert [x["label"] for x in single.json()] == [x.label for x in got]


async def test_cohere_v2_client_reranks_through_the_door(start_server: Any,
                                                        bert_reranker: tuple[Path, Path, Any]) -> None:
    s = await start_server(bundle=bert_reranker[0], http_port=0, model_alias="rerank-v3.5")
    query, documents = "the cat", ["a cat .", "the the the c", "b", "cats a cats"]
    want = (await s.stub.Rerank(pb.RerankRequest(query=query, texts=documents), timeout=30)).results
    async with httpx.AsyncClient(base_url=url(s), timeout=60) as http:
        co = cohere.AsyncClientV2(api_key="unused", base_url=url(s), httpx_client=http)
        got = await co.rerank(model="rerank-v3.5", query=query, documents=documents, top_n=3)
        assert [r.index for r in got.results] == [r.index for r in want[:3]]
        np.testing.assert_allclose([r.relevance_score for r in got.results], [r.score for r in want[:3]], rtol=0,
                                   atol=1e-6)
        r = await http.post("/v1/rerank", json={"query": query, "documents": [{"text": d} for d in documents],
                                                "return_documents": True, "top_n": 99, "rank_fields": ["text"]})
        body = r.json()
        assert r.status_code == 200 and [x["index"] for x in body["results"]] == [x.index for x in want]
        assert all(x["document"] == {"text": documents[x["index"]]} for x in body["results"])
        assert body["usage"]["total_tokens"] > 0 and body["meta"]["api_version"] == {"version": "2"}
        r = await http.post("/v2/rerank", json={"model": "rerank-nope", "query": query, "documents": documents})
        assert r.status_code == 404 and "rerank-nope" in r.json()["message"]
        r = await http.post("/v2/rerank", json={"query": query, "documents": [3]})
        assert r.status_code == 400 and r.json()["message"].startswith("documents[0]")
        info = (await http.get("/info")).json()
        assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
        root = await http.post("/", json={"query": query, "texts": documents[:2]})  # a reranker's POST /: rerank
        assert [x["index"] for x in root.json()] == [x.index for x in want if x.index < 2]


async def test_the_openai_token_id_trap(minilm: Running, start_server: Any, minilm_bundle: Path) -> None:
    async with openai.AsyncOpenAI(base_url=url(minilm) + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as refused:  # LangChain's OpenAIEmbeddings by default
            await client.embeddings.create(model="text-embedding-3-small", input=[HELLO_CL100K])
        assert "check_embedding_ctx_length=False" in str(refused.value.body) and "tiktoken" in str(refused.value.body)
        text = await client.embeddings.create(model="text-embedding-3-small", input=["Hello world."])
        np.testing.assert_allclose(text.data[0].embedding, (await attention_pooled(minilm, ["Hello world."]))[0],
                                   rtol=0, atol=1e-6)
    s = await start_server(bundle=minilm_bundle, http_port=0, openai_token_ids=True)
    async with openai.AsyncOpenAI(base_url=url(s) + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        ids = await client.embeddings.create(model="all-MiniLM-L6-v2", input=[HELLO_CL100K])
    response = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(
        np.asarray(HELLO_CL100K, np.int64)))], output=pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MODEL)),
        timeout=30)
    np.testing.assert_allclose(ids.data[0].embedding, from_tensor(response.outputs[0].pooled), rtol=0, atol=1e-6)


async def test_long_and_empty_texts_equal_sentence_transformers(minilm: Running,
                                                                minilm_reference: Reference) -> None:
    ref = minilm_reference
    picked = [5, 6, 8, 1, 0]  # 2160, 5400 and 508 characters (cut at 256 tokens), the empty text, a short one
    assert [len(ref.ids[i]) for i in picked[:3]] == [256] * 3 and ref.texts[1] == ""
    texts = [ref.texts[i] for i in picked]
    async with openai.AsyncOpenAI(base_url=url(minilm) + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        got = await client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    np.testing.assert_allclose([d.embedding for d in got.data], ref.embeddings[picked], rtol=0, atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(ref.ids[i]) for i in picked)
    async with httpx.AsyncClient(base_url=url(minilm), timeout=120) as http:
        embed = await http.post("/embed", json={"inputs": texts})
        assert embed.status_code == 200, embed.text
        np.testing.assert_allclose(embed.json(), ref.embeddings[picked], rtol=0, atol=1e-5)
        refused = await http.post("/embed", json={"inputs": texts[:1], "truncate": False})
        assert refused.status_code == 422 and refused.json()["error_type"] == "Validation"


async def test_auto_truncate_off_refuses_long_texts(start_server: Any, tiny_text_bundle: Path) -> None:
    s = await start_server(bundle=tiny_text_bundle, http_port=0, auto_truncate=False)
    async with httpx.AsyncClient(base_url=url(s), timeout=60) as http:
        assert (await http.get("/info")).json()["auto_truncate"] is False
        r = await http.post("/embed", json={"inputs": "the cat " * 20})
        assert r.status_code == 422 and "limit of 8" in r.json()["error"]
        r = await http.post("/v1/embeddings", json={"input": "the cat " * 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
        assert (await http.post("/embed", json={"inputs": "the cat " * 20, "truncate": True})).status_code == 200


async def test_left_truncation_of_texts_and_pairs_equals_transformers(
        start_server: Any, tiny_text_bundle: Path, bert_reranker: tuple[Path, Path, Any], tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    tok = hf_tokenizer(tmp_path, "[PAD]")
    text = "the cat a b c . cats a b c the end"  # 14 tokens with [CLS] and [SEP]: over the bundle's 8
    s = await start_server(bundle=tiny_text_bundle, http_port=0)
    async with httpx.AsyncClient(base_url=url(s), timeout=60) as http:
        for side in ("left", "right"):
            tok.truncation_side = side
            ids = tok(text, truncation=True, max_length=8)["input_ids"]
            want = await s.stub.Encode(pb.EncodeRequest(
                sequences=[pb.Sequence(token_ids=to_tensor(np.asarray(ids, np.int64)))],
                output=pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MODEL)), timeout=30)
            r = await http.post("/embed", json={"inputs": text, "truncation_direction": side.title()})
            np.testing.assert_allclose(r.json()[0], from_tensor(want.outputs[0].pooled), rtol=0, atol=1e-6)
    bundle, src, model = bert_reranker
    r_s = await start_server(bundle=bundle, http_port=0)
    query, texts = "the cat a b c . cats a b", ["a b c the cat . " * 4, "cats the the the c a b . the end"]
    pair_tok = hf_tokenizer(src, "[PAD]")
    scores = {}
    async with httpx.AsyncClient(base_url=url(r_s), timeout=60) as http:
        for side in ("left", "right"):
            pair_tok.truncation_side = side
            want = torch.sigmoid(hf_logits(model, pair_tok, [query] * 2, texts, max_length=32)[:, 0].double()).numpy()
            r = await http.post("/rerank", json={"query": query, "texts": texts, "truncation_direction": side.title()})
            scores[side] = {x["index"]: x["score"] for x in r.json()}
            np.testing.assert_allclose([scores[side][i] for i in range(2)], want, rtol=0, atol=1e-5)
    assert max(abs(scores["left"][i] - scores["right"][i]) for i in range(2)) > 1e-4  # the sides differ
