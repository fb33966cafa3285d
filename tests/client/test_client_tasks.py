"""The client's task calls (issue 31) against real servers on 127.0.0.1:0 serving tiny random-init Hugging Face
heads converted with convert-hf: `rerank`, `classify` and `encode(..., sparse=...)` equal the server's raw RPC
answers and the HF references the service tests use (sync and asyncio clients alike), server refusals arrive as
`InvalidArgument` naming the field, and wrong Python types are refused before anything is sent."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client import (
    Classification,
    EncodeOptions,
    EncoderClient,
    InvalidArgument,
    RankedText,
    SparseOptions,
    SparseVector,
    StreamRequest,
    SyncEncoderClient,
    Unavailable,
)
from proto.attention.v1 import attention_pb2 as pb
from tests.support.head_helpers import BERT_LABELS, hf_logits, hf_splade, hf_tokenizer, sparse_bundle

QUERY = "the cat"
PASSAGES = ["a cat .", "the the the c", "b", "cats a cats", "c c c", "the cat"]
TEXTS = ["the cat", "a b c the cat .", "cats"]


@pytest.fixture
def reranker(bert_reranker: tuple[Path, Path, Any]) -> tuple[Path, Path, Any]:
    return bert_reranker  # tests/conftest.py


@pytest.fixture
def classifier(bert_classifier: tuple[Path, Path, Any]) -> tuple[Path, Path, Any]:
    return bert_classifier  # tests/conftest.py


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    return sparse_bundle(tmp_path_factory)


@pytest.fixture
def closed_target() -> str:
    """An address nothing listens on: a call that reached the wire would fail Unavailable."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_rerank_equals_the_raw_rpc_and_hf(start_server: Any, reranker: tuple[Path, Path, Any]) -> None:
    bundle, src, model = reranker
    served = await start_server(bundle=bundle)
    logits = hf_logits(model, hf_tokenizer(src, "[PAD]"), [QUERY] * len(PASSAGES), PASSAGES)[:, 0]
    want = torch.sigmoid(logits.double()).numpy()
    raw = await served.stub.Rerank(pb.RerankRequest(query=QUERY, texts=PASSAGES, return_text=True), timeout=30)
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        ranked = await c.rerank(QUERY, PASSAGES, return_text=True)
        best = await c.rerank(QUERY, tuple(PASSAGES), top_n=2, raw_scores=True)
    assert info.tasks == ("embed", "classify", "rerank") and info.labels == ("LABEL_0",)
    assert all(isinstance(r, RankedText) for r in ranked)
    assert [(r.index, r.score, r.text, r.token_count, r.truncated) for r in ranked] == [
        (x.index, x.score, x.text, x.token_count, x.truncated) for x in raw.results]  # the server's order, as sent
    assert [r.index for r in ranked] == sorted(range(len(PASSAGES)), key=lambda i: -want[i])
    assert all(abs(r.score - want[r.index]) <= 1e-5 and r.text == PASSAGES[r.index] for r in ranked)
    assert [r.index for r in best] == [r.index for r in ranked[:2]]
    assert all(r.text is None and abs(r.score - float(logits[r.index])) <= 1e-5 for r in best)
    with pytest.raises(AttributeError):  # frozen
        ranked[0].score = 0.0  # type: ignore[misc]

    def sync() -> list[RankedText]:  # in a thread: the in-process server runs on this test's event loop
        with SyncEncoderClient(served.target) as c:
            return c.rerank(QUERY, PASSAGES, return_text=True)

    assert await asyncio.to_thread(sync) == ranked


async def test_rerank_truncate_and_the_fields_the_server_names(start_server: Any,
                                                               reranker: tuple[Path, Path, Any]) -> None:
    served = await start_server(bundle=reranker[0])
    long = "the cat " * 20
    async with EncoderClient(served.target) as c:
        cut = await c.rerank(QUERY, [long, "a"], truncate=True)
        assert {r.index: (r.token_count, r.truncated) for r in cut}[0] == (32, True)
        for kwargs, field in (({"query": "", "texts": ["a"]}, "query"),
                              ({"query": "a", "texts": []}, "texts"),
                              ({"query": "a", "texts": ["a", "b"], "top_n": 0}, "top_n"),
                              ({"query": "a", "texts": ["a", "b"], "top_n": 3}, "top_n"),
                              ({"query": "a", "texts": ["a", long]}, "texts[1]")):
            with pytest.raises(InvalidArgument) as e:
                await c.rerank(**kwargs)
            assert e.value.code == "INVALID_ARGUMENT" and e.value.field == field, (kwargs, e.value)

    def sync_top_n_zero() -> InvalidArgument:
        with SyncEncoderClient(served.target) as c, pytest.raises(InvalidArgument) as e:
            c.rerank("a", ["a"], top_n=0)
        return e.value

    assert (await asyncio.to_thread(sync_top_n_zero)).field == "top_n"


async def test_classify_texts_and_pairs_equal_the_raw_rpc_and_hf(start_server: Any,
                                                                 classifier: tuple[Path, Path, Any]) -> None:
    bundle, src, model = classifier
    served = await start_server(bundle=bundle)
    tok = hf_tokenizer(src, "[PAD]")
    pairs = [(QUERY, p) for p in PASSAGES]
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        texts = await c.classify(PASSAGES)
        paired = await c.classify(pairs)
        listed = await c.classify([list(p) for p in pairs])  # a 2-item list is a pair too
        raw = await c.classify(PASSAGES[:2], raw_scores=True)
    assert info.labels == tuple(BERT_LABELS) and "classify" in info.tasks
    wire = await served.stub.Classify(pb.ClassifyRequest(pairs=[pb.TextPair(first=a, second=b) for a, b in pairs]),
                                      timeout=30)
    assert [(r.scores, r.token_count, r.truncated) for r in paired] == [
        ({s.label: s.score for s in w.scores}, w.token_count, w.truncated) for w in wire.results]
    assert listed == paired
    for got, first, second in ((texts, PASSAGES, None), (paired, [QUERY] * len(PASSAGES), PASSAGES)):
        want = torch.softmax(hf_logits(model, tok, first, second).double(), -1).numpy()
        assert len(got) == len(first) and all(isinstance(r, Classification) for r in got)
        for r, w in zip(got, want, strict=True):
            assert list(r.scores) == BERT_LABELS  # the model's label order
            assert np.abs(np.array(list(r.scores.values())) - w).max() <= 1e-5
            assert r.label == BERT_LABELS[int(np.argmax(w))]
    logits = hf_logits(model, tok, PASSAGES[:2]).numpy()
    assert np.abs(np.array([list(r.scores.values()) for r in raw]) - logits).max() <= 1e-5

    def sync() -> list[Classification]:
        with SyncEncoderClient(served.target) as c:
            return c.classify(pairs)

    assert await asyncio.to_thread(sync) == paired


async def test_encode_sparse_equals_the_raw_rpc_and_the_masked_lm_splade(start_server: Any,
                                                                        splade: tuple[Path, Path, Any]) -> None:
    bundle, src, model = splade
    served = await start_server(bundle=bundle)
    want = hf_splade(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        every = await c.encode(TEXTS, sparse=True, pooling="mean", return_hidden=False)
        top = await c.encode(TEXTS, sparse=SparseOptions(top_k=3, threshold=0.01), return_hidden=False)
        plain = await c.encode(TEXTS, return_hidden=False)
        streamed = [item async for item in c.encode_stream(
            [StreamRequest(TEXTS, options=EncodeOptions(sparse=SparseOptions(top_k=3, threshold=0.01),
                                                        return_hidden=False))])]
    assert info.tasks == ("embed", "sparse")
    output = pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MEAN, sparse=pb.SparseOptions())
    raw = await served.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in TEXTS], output=output),
                                   timeout=30)
    assert len(every.sparse) == len(TEXTS) and len(every.pooled) == len(TEXTS) and plain.sparse == []
    for vector, out, w in zip(every.sparse, raw.outputs, want, strict=True):
        assert isinstance(vector, SparseVector)
        assert vector.indices.dtype == np.int32 and vector.values.dtype == np.float32
        assert vector.indices.tolist() == list(out.sparse.indices) == np.flatnonzero(w > 0).tolist()
        assert vector.values.tolist() == list(out.sparse.values)
        assert np.abs(vector.dense(info.vocab_size) - w).max() <= 1e-5
    for vector, w in zip(top.sparse, want, strict=True):
        best = sorted(np.flatnonzero(w > 0.01), key=lambda i: (-w[i], i))[:3]
        assert vector.indices.tolist() == sorted(best) and len(vector) == 3
    (result,) = streamed
    assert not isinstance(result, Exception)
    assert [v.indices.tolist() for v in result.sparse] == [v.indices.tolist() for v in top.sparse]


async def test_a_task_the_model_lacks_is_invalid_argument_naming_it(start_server: Any, tiny_text_bundle: Path,
                                                                    splade: tuple[Path, Path, Any]) -> None:
    plain = await start_server(bundle=tiny_text_bundle)
    async with EncoderClient(plain.target) as c:
        assert (await c.model_info()).tasks == ("embed",)
        calls = ((c.rerank("a", ["b"]), "Rerank", "'rerank'"), (c.classify(["b"]), "Classify", "'classify'"),
                 (c.encode(["a"], sparse=True), "output.sparse", "'sparse'"))
        for call, field, name in calls:
            with pytest.raises(InvalidArgument) as e:
                await call
            assert e.value.field == field and name in e.value.message, e.value
    with_head = await start_server(bundle=splade[0])
    async with EncoderClient(with_head.target) as c:
        for options, field in ((SparseOptions(top_k=-1), "output.sparse.top_k"),
                               (SparseOptions(threshold=-0.5), "output.sparse.threshold")):
            with pytest.raises(InvalidArgument) as e:
                await c.encode(["a"], sparse=options)
            assert e.value.field == field, e.value

    def sync() -> InvalidArgument:
        with SyncEncoderClient(plain.target) as c, pytest.raises(InvalidArgument) as e:
            c.classify([("a", "b")])
        return e.value

    assert (await asyncio.to_thread(sync)).field == "Classify"


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda c: c.rerank("q", "one text"), TypeError, "one text: pass [text]"),
    (lambda c: c.rerank(b"q", ["a"]), TypeError, "query must be a str"),
    (lambda c: c.rerank("q", ["a", 1]), TypeError, "texts[1] must be a str"),
    (lambda c: c.rerank("q", ["a"], top_n=True), TypeError, "top_n must be an int"),
    (lambda c: c.rerank("q", ["a"], top_n=1.5), TypeError, "top_n must be an int"),
    (lambda c: c.rerank("q", ["a"], raw_scores="yes"), TypeError, "raw_scores must be a bool"),
    (lambda c: c.rerank("q", ["a"], timeout=0), ValueError, "timeout must be > 0"),
    (lambda c: c.classify("one text"), TypeError, "one text: pass [text]"),
    (lambda c: c.classify([1]), TypeError, "inputs[0] must be a str or a (str, str) pair"),
    (lambda c: c.classify([("a", 1)]), TypeError, "inputs[0] must be a (str, str) pair"),
    (lambda c: c.classify([("a", "b"), "c"]), InvalidArgument, "inputs[1] is a text but inputs[0] is a pair"),
    (lambda c: c.classify(["a"], truncate=1), TypeError, "truncate must be a bool"),
    (lambda c: c.encode(["a"], sparse=3), TypeError, "sparse must be True, False or SparseOptions"),
    (lambda c: c.encode(["a"], sparse=SparseOptions(top_k=1.5)), TypeError, "sparse top_k must be an int"),
    (lambda c: c.encode(["a"], sparse=SparseOptions(threshold="0.1")), TypeError, "sparse threshold must be a number"),
])
def test_wrong_python_values_are_refused_before_any_call(closed_target: str, call: Any, error: type[Exception],
                                                         words: str) -> None:
    with SyncEncoderClient(closed_target, retry=None, timeout=5) as c:
        with pytest.raises(error) as e:
            call(c)
        assert words in str(e.value), e.value
        assert not isinstance(e.value, Unavailable)  # nothing was sent
        if isinstance(e.value, InvalidArgument):
            assert e.value.field == "inputs[1]"
        with pytest.raises(Unavailable):  # the same client does reach for the wire with a good call
            c.rerank("q", ["a"], timeout=1)


async def test_the_async_client_refuses_wrong_types_before_any_call(closed_target: str) -> None:
    async with EncoderClient(closed_target, retry=None, timeout=5) as c:
        with pytest.raises(TypeError, match=r"texts\[0\] must be a str"):
            await c.rerank("q", [None])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument) as e:
            await c.classify(["a", ("b", "c")])
        assert e.value.field == "inputs[1]"
        with pytest.raises(Unavailable):
            await c.classify(["a"], timeout=1)
