"""Classify and Rerank (issue 31) through a real server on 127.0.0.1:0: scores equal to Hugging Face's
AutoModelForSequenceClassification on the tokenizer's (pair) encoding (tiny random-init BERT and XLM-R, pinned
transformers), TEI's semantics (sigmoid unless raw_scores, sorted, top_n, return_text), attention weights
of a reranked pair, a 1 x 64 rerank riding the batcher as 64 sequences (the batch-size metric), and every bad
option refused INVALID_ARGUMENT naming its field (a task the model lacks too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.head_helpers import BERT_LABELS, hf_logits, hf_tokenizer
from tests.support.helpers import violated_field

QUERY = "the cat"
PASSAGES = ["a cat .", "the the the c", "b", "cats a cats", "c c c", "the cat"]
X_QUERY = "hello world"
X_PASSAGES = ["the cats", "hello", "a, b. c", "world is the cat", "über 東京"]


def _sigmoid(x: torch.Tensor) -> np.ndarray:
    return torch.sigmoid(x.double()).numpy()


@pytest.mark.parametrize(("kind", "pad", "query", "texts"), [
    ("bert", "[PAD]", QUERY, PASSAGES), ("xlmr", "<pad>", X_QUERY, X_PASSAGES)])
async def test_rerank_scores_equal_hf_on_the_pair_encoding(start_server: Any, request: pytest.FixtureRequest,
                                                           kind: str, pad: str, query: str, texts: list[str]) -> None:
    bundle, src, model = request.getfixturevalue(f"{kind}_reranker")
    served = await start_server(bundle=bundle)
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.tasks) == ["embed", "classify", "rerank"] and list(info.labels) == ["LABEL_0"]
    logits = hf_logits(model, hf_tokenizer(src, pad), [query] * len(texts), texts)[:, 0]
    want = _sigmoid(logits)
    assert float(want.std()) > 0.01  # the texts score apart: the order below means something
    r = await served.stub.Rerank(pb.RerankRequest(query=query, texts=texts, return_text=True), timeout=30)
    assert [x.index for x in r.results] == sorted(range(len(texts)), key=lambda i: -want[i])
    for x in r.results:
        assert abs(x.score - want[x.index]) <= 1e-5 and x.text == texts[x.index] and x.token_count > 0
    raw = await served.stub.Rerank(pb.RerankRequest(query=query, texts=texts, raw_scores=True, top_n=2), timeout=30)
    assert len(raw.results) == 2 and [x.index for x in raw.results] == [x.index for x in r.results[:2]]
    for x in raw.results:
        assert abs(x.score - float(logits[x.index])) <= 1e-5 and x.text == ""
    # The same pairs through Classify (pairs), one label: sigmoid as TEI's /predict.
    c = await served.stub.Classify(pb.ClassifyRequest(pairs=[pb.TextPair(first=query, second=t) for t in texts]),
                                   timeout=30)
    assert [round(res.scores[0].score, 5) for res in c.results] == [round(float(w), 5) for w in want]


async def test_classify_texts_and_pairs_equal_hf(start_server: Any, bert_classifier: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_classifier
    served = await start_server(bundle=bundle)
    tok = hf_tokenizer(src, "[PAD]")
    for second in (None, PASSAGES):
        first = [QUERY] * len(PASSAGES) if second else PASSAGES
        want = torch.softmax(hf_logits(model, tok, first, second).double(), -1).numpy()
        req = (pb.ClassifyRequest(pairs=[pb.TextPair(first=a, second=b) for a, b in zip(first, second, strict=True)])
               if second else pb.ClassifyRequest(texts=first))
        r = await served.stub.Classify(req, timeout=30)
        assert len(r.results) == len(first)
        for res, w in zip(r.results, want, strict=True):
            assert [s.label for s in res.scores] == BERT_LABELS
            assert np.abs(np.array([s.score for s in res.scores]) - w).max() <= 1e-5
    raw = await served.stub.Classify(pb.ClassifyRequest(texts=PASSAGES[:2], raw_scores=True), timeout=30)
    logits = hf_logits(model, tok, PASSAGES[:2]).numpy()
    assert np.abs(np.array([[s.score for s in res.scores] for res in raw.results]) - logits).max() <= 1e-5


async def test_rerank_attention_weights_of_each_pair(start_server: Any, bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_reranker
    served = await start_server(bundle=bundle)
    r = await served.stub.Rerank(pb.RerankRequest(query=QUERY, texts=PASSAGES[:3], attention=pb.AttentionOptions(
        return_attention=True, layers=[-1])), timeout=30)
    tok = hf_tokenizer(src, "[PAD]")
    for x in r.results:
        enc = tok(QUERY, PASSAGES[x.index], return_tensors="pt")
        with torch.inference_mode():
            want = model(**enc, output_attentions=True).attentions[-1][0].numpy()  # (H, T, T)
        got = from_tensor(x.attention)
        assert got.shape == (1, *want.shape) and np.abs(got[0] - want).max() <= 1e-5


async def test_a_1x64_rerank_rides_the_batcher_as_64_sequences(start_server: Any,
                                                               bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, _, _ = bert_reranker
    served = await start_server(bundle=bundle, max_batch_size=64, max_batch_tokens=4096)
    # Pairs of one length: one batch of 64 sequences.
    texts = [["a b", "b c", "the cat", "c a"][i % 4] for i in range(64)]
    before_sum, before_count = served.sample("attention_batch_size_sum"), served.sample("attention_batch_size_count")
    r = await served.stub.Rerank(pb.RerankRequest(query=QUERY, texts=texts), timeout=60)
    assert len(r.results) == 64 and {x.token_count for x in r.results} == {7}
    assert served.sample("attention_batch_size_sum") - before_sum == 64  # each pair one sequence
    assert served.sample("attention_batch_size_count") - before_count == 1  # all in one batch
    assert (r.metadata.batch_size, r.metadata.padded_length) == (64, 7)
    # Mixed lengths: still 64 sequences, batched by length like any work (the windows of similar lengths).
    texts = [" ".join(["a", "b", "cat", "the"][: 1 + i % 4] * (1 + i % 5)) for i in range(64)]
    before_sum, before_count = served.sample("attention_batch_size_sum"), served.sample("attention_batch_size_count")
    r = await served.stub.Rerank(pb.RerankRequest(query=QUERY, texts=texts), timeout=60)
    assert len(r.results) == 64 and len({x.token_count for x in r.results}) > 3
    assert served.sample("attention_batch_size_sum") - before_sum == 64
    assert 1 <= served.sample("attention_batch_size_count") - before_count <= 64


@pytest.mark.parametrize(("request_", "field", "words"), [
    (pb.RerankRequest(query="", texts=["a"]), "query", ["empty"]),
    (pb.RerankRequest(query="a", texts=[]), "texts", ["1..", "got 0"]),
    (pb.RerankRequest(query="a", texts=["a", "b"], top_n=0), "top_n", ["1..2"]),
    (pb.RerankRequest(query="a", texts=["a", "b"], top_n=3), "top_n", ["1..2", "got 3"]),
    (pb.RerankRequest(query="a", texts=["a", "the cat " * 20]), "texts[1]", ["limit of 32", "truncate"]),
    (pb.RerankRequest(query="a", texts=["a"], attention=pb.AttentionOptions(layers=[0])), "attention.layers",
     ["return_attention"]),
    (pb.RerankRequest(query="a", texts=["a"], attention=pb.AttentionOptions(return_attention=True, layers=[5])),
     "attention.layers[0]", ["not in"]),
])
async def test_bad_rerank_options_are_refused_naming_the_field(start_server: Any,
                                                               bert_reranker: tuple[Path, Path, Any],
                                                               request_: pb.RerankRequest, field: str,
                                                               words: list[str]) -> None:
    served = await start_server(bundle=bert_reranker[0])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.stub.Rerank(request_, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert violated_field(e.value) == field, e.value.details()
    for word in words:
        assert word in e.value.details(), e.value.details()


async def test_truncate_cuts_the_pair_longest_first(start_server: Any, bert_reranker: tuple[Path, Path, Any]) -> None:
    bundle, src, model = bert_reranker
    served = await start_server(bundle=bundle)
    long = "the cat " * 20
    r = await served.stub.Rerank(pb.RerankRequest(query=QUERY, texts=[long, "a"], truncate=True), timeout=30)
    by_index = {x.index: x for x in r.results}
    assert (by_index[0].token_count, by_index[0].truncated) == (32, True)
    assert not by_index[1].truncated
    want = _sigmoid(hf_logits(model, hf_tokenizer(src, "[PAD]"), [QUERY], [long], max_length=32)[:, 0])
    assert abs(by_index[0].score - want[0]) <= 1e-5


async def test_a_task_the_model_lacks_is_refused_naming_it(start_server: Any, tiny_text_bundle: Path,
                                                           bert_classifier: tuple[Path, Path, Any]) -> None:
    plain = await start_server(bundle=tiny_text_bundle)
    info = await plain.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.tasks) == ["embed"] and not info.labels
    for call, req, name in ((plain.stub.Rerank, pb.RerankRequest(query="a", texts=["b"]), "rerank"),
                            (plain.stub.Classify, pb.ClassifyRequest(texts=["b"]), "classify")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_field(e.value) in ("Rerank", "Classify") and f"'{name}'" in e.value.details()
    classifier = await start_server(bundle=bert_classifier[0])
    with pytest.raises(grpc.aio.AioRpcError) as e:  # three labels: a classifier, not a reranker
        await classifier.stub.Rerank(pb.RerankRequest(query="a", texts=["b"]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'rerank'" in e.value.details()
    assert "embed, classify" in e.value.details()
    for req, field in ((pb.ClassifyRequest(), "texts"), (pb.ClassifyRequest(
            texts=["a"], pairs=[pb.TextPair(first="a", second="b")]), "pairs")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await classifier.stub.Classify(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(e.value) == field
    # Embeddings still work on a classifier bundle: the encoder's hidden states.
    r = await classifier.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text="the cat")], output=pb.OutputOptions(
        pooling=pb.POOLING_CLS, return_hidden=False)), timeout=10)
    assert from_tensor(r.outputs[0].pooled).shape == (32,)


async def test_rerank_and_classify_through_edge_processes(tmp_path: Path,
                                                          bert_reranker: tuple[Path, Path, Any]) -> None:
    """With --edge-processes 2 the doors tokenize in their own processes: the pairs' token types and the
    head's scores cross the frames (service/multiproc/frames.py), and the scores are HF's."""
    from tests.support.server_process import ServerProcess

    bundle, src, model = bert_reranker
    want = _sigmoid(hf_logits(model, hf_tokenizer(src, "[PAD]"), [QUERY] * len(PASSAGES), PASSAGES)[:, 0])
    server = ServerProcess(bundle, "--edge-processes", "2", directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            from proto.attention.v1 import attention_pb2_grpc

            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert list(info.tasks) == ["embed", "classify", "rerank"]
            r = await stub.Rerank(pb.RerankRequest(query=QUERY, texts=PASSAGES), timeout=60)
            assert [x.index for x in r.results] == sorted(range(len(PASSAGES)), key=lambda i: -want[i])
            assert max(abs(x.score - want[x.index]) for x in r.results) <= 1e-5
    finally:
        server.stop()
