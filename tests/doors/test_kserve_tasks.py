"""KServe v2 outputs by name for the task heads (issue 31), through tritonclient against a real server on
127.0.0.1:0: `logits` of a classifier (text in) equal to Hugging Face's AutoModelForSequenceClassification,
`sparse` of a masked-LM (SPLADE weights, dense [batch, vocab]) equal to max over tokens of log(1 + relu(MLM
logits)); both listed in ModelMetadata only for a model that has the head, and unknown outputs otherwise.
Rerank (parameter `query`, output `scores` [batch] in the rows' order) over gRPC and REST: equal to
attention.v1's Rerank re-ordered by index and to HF's pair scores, and every misuse refused naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
import tritonclient.http as triton_http
import tritonclient.http.aio as http_aio
from tritonclient.utils import InferenceServerException

from proto.attention.v1 import attention_pb2 as pb
from tests.support.head_helpers import head_bundle, hf_logits, hf_splade, hf_tokenizer, sparse_bundle

TEXTS = ["the cat", "a b c the cat .", "cats"]
QUERY = "the cat"
PASSAGES = ["a cat .", "the the the c", "b", "cats a cats", "c c c", "the cat"]


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


async def test_logits_and_sparse_outputs_equal_hf(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    bundle, src, model = head_bundle(tmp_path_factory, "bert-classifier")
    s = await start_server(bundle=bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        meta = await client.get_model_metadata("bert-classifier")
        assert [o.name for o in meta.outputs if o.name in ("logits", "sparse", "scores")] == ["logits"]
        result = await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60,
                                    outputs=[triton.InferRequestedOutput("logits")])
        want = hf_logits(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
        np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=0, atol=1e-5)
        with pytest.raises(InferenceServerException) as info:  # no SPLADE head on a classifier
            await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60,
                               outputs=[triton.InferRequestedOutput("sparse")])
        assert "INVALID_ARGUMENT" in str(info.value) and "unknown output 'sparse'" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60, outputs=[
                triton.InferRequestedOutput("logits"), triton.InferRequestedOutput("pooled")])
        assert "logits comes alone" in str(info.value)
        with pytest.raises(InferenceServerException) as info:  # three labels: a classifier, not a reranker
            await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60,
                               outputs=[triton.InferRequestedOutput("logits")], parameters={"query": "a"})
        assert "INVALID_ARGUMENT" in str(info.value) and "parameters.query: model bert-classifier does not serve " \
            "'rerank'" in str(info.value)
    finally:
        await client.close()
    bundle, src, model = sparse_bundle(tmp_path_factory)
    s = await start_server(bundle=bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        result = await client.infer("bert-splade", [text_input(TEXTS)], client_timeout=60,
                                    outputs=[triton.InferRequestedOutput("sparse"),
                                             triton.InferRequestedOutput("pooled")])
        want = hf_splade(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
        np.testing.assert_allclose(result.as_numpy("sparse"), want, rtol=0, atol=1e-5)
        assert result.as_numpy("pooled").shape == (3, 32)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("bert-splade", [text_input(TEXTS)], client_timeout=60,
                               outputs=[triton.InferRequestedOutput("logits")])
        assert "INVALID_ARGUMENT" in str(info.value) and "unknown output 'logits'" in str(info.value)
    finally:
        await client.close()


def http_text_input(texts: list[str]) -> triton_http.InferInput:
    tensor = triton_http.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


async def test_rerank_scores_by_row_equal_attention_v1_and_hf(start_server: Any,
                                                             bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_reranker
    s = await start_server(bundle=bundle, http_port=0)
    logits = hf_logits(model, hf_tokenizer(src, "[PAD]"), [QUERY] * len(PASSAGES), PASSAGES)[:, 0]
    want = torch.sigmoid(logits.double()).numpy()
    assert float(want.std()) > 0.01  # the passages score apart: a row mix-up would show
    reranked = await s.stub.Rerank(pb.RerankRequest(query=QUERY, texts=PASSAGES), timeout=30)
    by_index = np.zeros(len(PASSAGES), np.float32)
    for x in reranked.results:
        by_index[x.index] = x.score
    assert sorted(x.index for x in reranked.results) == list(range(len(PASSAGES)))
    assert [x.index for x in reranked.results] != list(range(len(PASSAGES)))  # sorted there, by row here

    client = triton_aio.InferenceServerClient(s.target)
    try:
        meta = await client.get_model_metadata("bert-reranker")
        assert [(o.name, list(o.shape)) for o in meta.outputs if o.name in ("logits", "scores")] == [
            ("logits", [-1, 1]), ("scores", [-1])]
        config = (await client.get_model_config("bert-reranker")).config
        scores_config = next(o for o in config.output if o.name == "scores")
        assert list(scores_config.dims) == [1] and scores_config.HasField("reshape")
        assert list(scores_config.reshape.shape) == []
        # No outputs named: scores, one per row in the rows' order.
        result = await client.infer("bert-reranker", [text_input(PASSAGES)], client_timeout=60,
                                    parameters={"query": QUERY})
        scores = result.as_numpy("scores")
        assert scores.dtype == np.float32 and scores.shape == (len(PASSAGES),)
        assert [o.name for o in result.get_response().outputs] == ["scores"]
        np.testing.assert_array_equal(scores, by_index)
        np.testing.assert_allclose(scores, want, rtol=0, atol=1e-5)
        # raw_scores: the logit itself; logits beside: the same value as [batch, 1].
        result = await client.infer("bert-reranker", [text_input(PASSAGES)], client_timeout=60,
                                    parameters={"query": QUERY, "raw_scores": True},
                                    outputs=[triton.InferRequestedOutput("scores"),
                                             triton.InferRequestedOutput("logits")])
        np.testing.assert_allclose(result.as_numpy("scores"), logits.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(result.as_numpy("logits")[:, 0], result.as_numpy("scores"))
        result = await client.infer("bert-reranker", [text_input(PASSAGES)], client_timeout=60,
                                    parameters={"query": QUERY, "datatype": "FP16"})
        assert result.as_numpy("scores").dtype == np.float16
        np.testing.assert_allclose(result.as_numpy("scores"), want, rtol=0, atol=1e-3)
        # Attention of each pair beside the scores: [batch, layers, heads, T, T], T the longest pair.
        result = await client.infer("bert-reranker", [text_input(PASSAGES[:2])], client_timeout=60,
                                    parameters={"query": QUERY, "attention_layers": "-1"},
                                    outputs=[triton.InferRequestedOutput("scores"),
                                             triton.InferRequestedOutput("attention")])
        np.testing.assert_allclose(result.as_numpy("scores"), want[:2], rtol=0, atol=1e-5)
        attention = result.as_numpy("attention")
        assert attention.shape[:3] == (2, 1, 4) and attention.shape[3] == attention.shape[4]
    finally:
        await client.close()

    rest = http_aio.InferenceServerClient(f"127.0.0.1:{s.server.http_port}")
    try:
        meta_json = await rest.get_model_metadata("bert-reranker")
        assert {"name": "scores", "datatype": "FP32", "shape": [-1]} in meta_json["outputs"]
        for binary in (True, False):
            answer = await rest.infer("bert-reranker", [http_text_input(PASSAGES)], parameters={"query": QUERY},
                                      outputs=[triton_http.InferRequestedOutput("scores", binary_data=binary)])
            np.testing.assert_array_equal(answer.as_numpy("scores"), by_index)
        answer = await rest.infer("bert-reranker", [http_text_input(PASSAGES)],
                                  parameters={"query": QUERY, "raw_scores": True})
        np.testing.assert_allclose(answer.as_numpy("scores"), logits.numpy(), rtol=0, atol=1e-5)
        with pytest.raises(InferenceServerException) as info:
            await rest.infer("bert-reranker", [http_text_input(PASSAGES)], parameters={"query": ""})
        assert "parameters.query: must not be empty" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            await rest.infer("bert-reranker", [http_text_input(PASSAGES)],
                             outputs=[triton_http.InferRequestedOutput("scores")])
        assert "parameters.query: required with the scores output" in str(info.value)
    finally:
        await rest.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}") as raw:  # the JSON wire itself
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": PASSAGES[:2]}],
                "parameters": {"query": QUERY}, "outputs": [{"name": "scores", "parameters": {"binary_data": False}}]}
        answer_json = (await raw.post("/v2/models/bert-reranker/infer", json=body)).json()
        assert answer_json["outputs"][0]["shape"] == [2]
        np.testing.assert_allclose(answer_json["outputs"][0]["data"], want[:2], rtol=0, atol=1e-5)
        refused = await raw.post("/v2/models/bert-reranker/infer", json={**body, "parameters": {"query": ""}})
        assert refused.status_code == 400 and refused.json() == {"error": "parameters.query: must not be empty"}


REFUSED = [
    ({"query": ""}, None, "parameters.query: must not be empty"),
    ({}, ["scores"], "parameters.query: required with the scores output"),
    ({"query": 3}, None, "parameters.query: must be a string"),
    ({"query": "a"}, ["pooled"], "outputs[0]: 'pooled' is not a rerank output"),
    ({"query": "a"}, ["scores", "last_hidden_state"], "outputs[1]: 'last_hidden_state' is not a rerank output"),
    ({"raw_scores": True}, ["logits"], "parameters.raw_scores: given, but the scores output is not requested"),
    ({"query": "a", "raw_scores": "yes"}, None, "parameters.raw_scores: must be a bool"),
    ({"query": "a", "top_n": 2}, None, "parameters.top_n: unknown parameter"),
    ({"query": "a", "dimensions": 8}, None, "parameters.dimensions: applies to embeddings, not to rerank"),
    ({"query": "a", "prompt_name": "query"}, None, "parameters.prompt_name: applies to embeddings, not to rerank"),
    ({"query": "a", "long_inputs": "chunk"}, None, "parameters.long_inputs: must be error or truncate for rerank"),
    ({"query": "a", "pooling": "cls"}, None, "parameters.pooling: given, but no pooled"),
]


async def test_rerank_misuse_is_refused_naming_the_field(start_server: Any,
                                                         bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, _, _ = bert_reranker
    s = await start_server(bundle=bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        for parameters, outputs, message in REFUSED:
            asked = None if outputs is None else [triton.InferRequestedOutput(o) for o in outputs]
            with pytest.raises(InferenceServerException) as info:
                await client.infer("bert-reranker", [text_input(PASSAGES)], client_timeout=60, parameters=parameters,
                                   outputs=asked)
            assert "INVALID_ARGUMENT" in str(info.value) and message in str(info.value), (parameters, outputs)
        ids = triton.InferInput("input_ids", [1, 3], "INT64")
        ids.set_data_from_numpy(np.array([[2, 5, 3]], np.int64))
        with pytest.raises(InferenceServerException) as info:  # a rerank's rows are texts
            await client.infer("bert-reranker", [ids], client_timeout=60, parameters={"query": "a"})
        assert "INVALID_ARGUMENT" in str(info.value) and "text: required with parameters.query" in str(info.value)
        with pytest.raises(InferenceServerException) as info:  # a pair over the model's 32 tokens
            await client.infer("bert-reranker", [text_input(["a", "the cat " * 20])], client_timeout=60,
                               parameters={"query": "a"})
        assert "text[1]: " in str(info.value) and "limit of 32" in str(info.value)
        result = await client.infer("bert-reranker", [text_input(["a", "the cat " * 20])], client_timeout=60,
                                    parameters={"query": "a", "truncate": True})
        assert result.as_numpy("scores").shape == (2,)
        assert result.get_response().parameters["truncated"].bool_param
    finally:
        await client.close()


async def test_rerank_limits_count_the_query_once_per_row(start_server: Any, tiny_text_bundle: Path,
                                                          bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, _, _ = bert_reranker
    passages = ["a cat .", "b", "c c c"]  # 13 characters; with the query once per row 34
    s = await start_server(bundle=bundle, max_text_chars=30)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        embedded = await client.infer("bert-reranker", [text_input(passages)], client_timeout=60,
                                      outputs=[triton.InferRequestedOutput("pooled")])
        assert embedded.as_numpy("pooled").shape == (3, 32)  # the texts alone fit
        with pytest.raises(InferenceServerException) as info:
            await client.infer("bert-reranker", [text_input(passages)], client_timeout=60,
                               parameters={"query": QUERY})
        assert "INVALID_ARGUMENT" in str(info.value) and "text: 34 characters of text in all (a query counted " \
            "once per text); at most 30 per call" in str(info.value)
    finally:
        await client.close()
    plain = await start_server(bundle=tiny_text_bundle)  # an embedding model: no rerank head
    client = triton_aio.InferenceServerClient(plain.target)
    try:
        meta = await client.get_model_metadata("tiny-bert")
        assert "scores" not in [o.name for o in meta.outputs]
        with pytest.raises(InferenceServerException) as info:
            await client.infer("tiny-bert", [text_input(["b"])], client_timeout=60, parameters={"query": "a"})
        assert "INVALID_ARGUMENT" in str(info.value) and "parameters.query: model tiny-bert does not serve " \
            "'rerank'; it serves embed" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("tiny-bert", [text_input(["b"])], client_timeout=60, parameters={"query": "a"},
                               outputs=[triton.InferRequestedOutput("scores")])
        assert "unknown output 'scores'" in str(info.value)
    finally:
        await client.close()
