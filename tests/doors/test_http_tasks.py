"""TEI's /rerank and /predict on the HTTP door (issue 31), with httpx against a real server on 127.0.0.1:0:
TEI's JSON shapes, scores equal to Hugging Face's AutoModelForSequenceClassification on the tokenizer's pair
encoding (tiny random-init BERT, pinned transformers), and every bad option refused with TEI's status (422
invalid, 413 too many inputs) and its field in the message; counted per route in the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.support.head_helpers import BERT_LABELS, hf_logits, hf_tokenizer
from tests.support.helpers import Running

QUERY = "the cat"
TEXTS = ["a cat .", "the the the c", "b", "cats a cats"]


def url(s: Running) -> str:
    return f"http://127.0.0.1:{s.server.http_port}"


async def test_rerank_route_in_teis_shape(start_server: Any, bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_reranker
    s = await start_server(bundle=bundle, http_port=0)
    logits = hf_logits(model, hf_tokenizer(src, "[PAD]"), [QUERY] * len(TEXTS), TEXTS)[:, 0]
    want = torch.sigmoid(logits.double()).numpy()
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        r = await http.post("/rerank", json={"query": QUERY, "texts": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body] == sorted(range(len(TEXTS)), key=lambda i: -want[i])
        assert all(set(x) == {"index", "score"} and abs(x["score"] - want[x["index"]]) <= 1e-5 for x in body)
        r = await http.post("/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True,
                                             "raw_scores": True, "top_n": 2})
        body = r.json()
        assert len(body) == 2 and all(x["text"] == TEXTS[x["index"]] for x in body)
        assert all(abs(x["score"] - float(logits[x["index"]])) <= 1e-5 for x in body)
        r = await http.post("/predict", json={"inputs": [QUERY, TEXTS[0]]})  # one pair, as TEI reads it
        assert r.status_code == 200 and len(r.json()) == 1 and r.json()[0]["label"] == "LABEL_0"
        assert abs(r.json()[0]["score"] - want[0]) <= 1e-5
        # The caller's deadline (grpc-timeout, docs/http.md) bounds the task routes as it does /embed.
        for path, body in (("/rerank", {"query": QUERY, "texts": TEXTS}), ("/predict", {"inputs": TEXTS[0]})):
            short = await http.post(path, json=body, headers={"grpc-timeout": "1u"})
            assert short.status_code == 504 and "deadline" in short.text, (path, short.text)
    assert s.sample("attention_requests_total", {"method": "POST /rerank", "code": "OK"}) == 2
    assert s.sample("attention_requests_total", {"method": "POST /rerank", "code": "DEADLINE_EXCEEDED"}) == 1


async def test_predict_route_single_and_batch(start_server: Any, bert_classifier: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_classifier
    s = await start_server(bundle=bundle, http_port=0)
    tok = hf_tokenizer(src, "[PAD]")
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        r = await http.post("/predict", json={"inputs": TEXTS[1]})
        assert r.status_code == 200, r.text
        want = torch.softmax(hf_logits(model, tok, [TEXTS[1]]).double(), -1).numpy()[0]
        got = {x["label"]: x["score"] for x in r.json()}
        assert [x["label"] for x in r.json()] == [BERT_LABELS[i] for i in np.argsort(-want, kind="stable")]
        assert max(abs(got[label] - w) for label, w in zip(BERT_LABELS, want, strict=True)) <= 1e-5
        r = await http.post("/predict", json={"inputs": [[TEXTS[0]], [QUERY, TEXTS[2]], [TEXTS[3]]],
                                              "raw_scores": True})
        assert r.status_code == 200 and len(r.json()) == 3
        pair = hf_logits(model, tok, [QUERY], [TEXTS[2]]).numpy()[0]
        got = {x["label"]: x["score"] for x in r.json()[1]}
        assert max(abs(got[label] - w) for label, w in zip(BERT_LABELS, pair, strict=True)) <= 1e-5
        r = await http.post("/rerank", json={"query": QUERY, "texts": TEXTS})  # three labels: no reranker
        assert r.status_code == 422 and "'rerank'" in r.json()["error"] and r.json()["error"].startswith("/rerank")


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/rerank", {"query": "", "texts": ["a"]}, 422, ["query", "empty"]),
    ("/rerank", {"texts": ["a"]}, 422, ["query", "required"]),
    ("/rerank", {"query": "a", "texts": []}, 400, ["texts", "cannot be empty"]),
    ("/rerank", {"query": "a", "texts": "a"}, 422, ["texts", "array"]),
    ("/rerank", {"query": "a", "texts": ["a", 3]}, 422, ["texts[1]", "string"]),
    ("/rerank", {"query": "a", "texts": ["a"] * 5}, 413, ["batch size 5"]),
    ("/rerank", {"query": "a", "texts": ["a", "b"], "top_n": 0}, 422, ["top_n", "1..2"]),
    ("/rerank", {"query": "a", "texts": ["a", "b"], "top_n": 3}, 422, ["top_n", "got 3"]),
    ("/rerank", {"query": "a", "texts": ["a"], "raw_scores": "yes"}, 422, ["raw_scores", "boolean"]),
    ("/rerank", {"query": "a", "texts": ["a", "the cat " * 20], "truncate": False}, 422, ["texts[1]", "limit of 32"]),
    ("/rerank", {"query": "a", "texts": ["a"], "truncation_direction": "up"}, 422, ["truncation_direction"]),
    ("/predict", {"inputs": [["a", "b", "c"]]}, 422, ["inputs[0]"]),
    ("/predict", {"inputs": []}, 400, ["inputs", "cannot be empty"]),
    ("/predict", {"inputs": 3}, 422, ["inputs"]),
])
async def test_bad_options_are_refused_with_teis_status(start_server: Any, bert_reranker: tuple[Path, Path, Any],
                                                        path: str, body: Any, status: int, words: list[str]) -> None:
    s = await start_server(bundle=bert_reranker[0], http_port=0, max_sequences_per_call=4)
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        r = await http.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"}
    for word in words:
        assert word in r.json()["error"], r.text


async def test_a_model_without_heads_refuses_the_routes(start_server: Any, tiny_text_bundle: Path) -> None:
    s = await start_server(bundle=tiny_text_bundle, http_port=0)
    async with httpx.AsyncClient(base_url=url(s), timeout=30) as http:
        for path, body in (("/rerank", {"query": "a", "texts": ["b"]}), ("/predict", {"inputs": "b"})):
            r = await http.post(path, json=body)
            assert r.status_code == 422 and r.json()["error"].startswith(path + ": "), r.text
            assert "serves embed" in r.json()["error"]
    assert s.sample("attention_failures_total", {"reason": "task_unavailable"}) == 2
