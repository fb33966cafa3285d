"""tei.v1 on the gRPC port (issue 40): our proto/tei/v1/tei.proto is TEI 1.9.3's on the wire (the two compiled
descriptors compared field by field), and a client made from TEI's own proto (tests/support/tei_helpers.py)
calls Info, Embed and its stream, EmbedAll, Predict, Rerank and its stream, Tokenize and Decode against a real
server on 127.0.0.1, every number equal to the attention.v1 answer for the same input (fp32); the services are
listed by reflection; a stream answers in the order sent and ends with the status of a request that fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from proto.tei.v1 import tei_pb2
from tests.support.head_helpers import BERT_LABELS
from tests.support.helpers import Running
from tests.support.tei_helpers import TeiClient, tei_descriptors

Proto = descriptor_pb2.FileDescriptorProto
TEXTS = ["the cat", "a b c.", "cats", ""]


@pytest.fixture(scope="module")
def tei_proto(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorProto:
    return tei_descriptors(tmp_path_factory.mktemp("tei-proto"))


def wire(file: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    """What a file means on the wire: its package, each message's fields (name, number, type, label, message
    type, proto3 optional) and oneofs, each enum's values, each service's methods (types and streaming)."""
    def fields(m: descriptor_pb2.DescriptorProto) -> Any:
        return (sorted((f.name, f.number, f.type, f.label, f.type_name, f.proto3_optional) for f in m.field),
                sorted(o.name for o in m.oneof_decl))

    return {"package": file.package, "syntax": file.syntax,
            "messages": {m.name: fields(m) for m in file.message_type},
            "enums": {e.name: sorted((v.name, v.number) for v in e.value) for e in file.enum_type},
            "services": {s.name: sorted((m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                                        for m in s.method) for s in file.service}}


def test_our_proto_is_teis_on_the_wire(tei_proto: Proto) -> None:
    ours = descriptor_pb2.FileDescriptorProto()
    tei_pb2.DESCRIPTOR.CopyToProto(ours)
    assert wire(ours) == wire(tei_proto)
    assert len(wire(ours)["messages"]) == 24 and len(wire(ours)["services"]) == 5  # the comparison saw them all
    broken = descriptor_pb2.FileDescriptorProto()
    broken.CopyFrom(tei_proto)
    broken.message_type[0].field.add(name="extra", number=99, type=9, label=1)
    assert wire(broken) != wire(tei_proto)  # the comparison can fail


async def tei_client(s: Running, proto: descriptor_pb2.FileDescriptorProto) -> TeiClient:
    return TeiClient(s.channel, proto)


async def attention_pooled(s: Running, texts: list[str], normalize: bool = True) -> np.ndarray:
    output = pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MODEL, normalize=normalize)
    response = await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], output=output),
                                   timeout=30)
    return np.stack([from_tensor(o.pooled) for o in response.outputs])


async def test_a_tei_client_embeds_tokenizes_and_decodes_as_attention_v1_does(
        start_server: Any, tiny_text_bundle: Path, tei_proto: Proto) -> None:
    s = await start_server(bundle=tiny_text_bundle, served_model_name="tiny-tei")
    tei = await tei_client(s, tei_proto)
    info = await tei.call("Info", "Info")(tei.InfoRequest(), timeout=10)
    assert (info.model_id, info.model_dtype, info.max_input_length, info.max_client_batch_size) == (
        "tiny-tei", "float32", 8, 64)
    assert info.model_type == tei.enums["ModelType"].values_by_name["MODEL_TYPE_EMBEDDING"].number
    assert info.max_batch_tokens == s.server.serving.spec.max_batch_tokens > 0
    want = await attention_pooled(s, TEXTS)
    raw = await attention_pooled(s, TEXTS[:1], normalize=False)
    embed = tei.call("Embed", "Embed")
    for text, vector in zip(TEXTS, want, strict=True):
        got = await embed(tei.EmbedRequest(inputs=text), timeout=30)  # normalize unset: true
        np.testing.assert_allclose(got.embeddings, vector, rtol=0, atol=1e-6)
        assert got.metadata.compute_chars == len(text) and got.metadata.compute_tokens >= 2
        assert got.metadata.total_time_ns >= got.metadata.inference_time_ns > 0
    got = await embed(tei.EmbedRequest(inputs=TEXTS[0], normalize=False), timeout=30)
    np.testing.assert_allclose(got.embeddings, raw[0], rtol=0, atol=1e-6)
    cut = await embed(tei.EmbedRequest(inputs=TEXTS[0], dimensions=4), timeout=30)
    assert len(cut.embeddings) == 4 and abs(float(np.linalg.norm(cut.embeddings)) - 1) < 1e-6
    # The stream answers in the order sent (TEI's messages carry no id).
    requests = [tei.EmbedRequest(inputs=t) for t in TEXTS * 3]
    answers = [r async for r in tei.call("Embed", "EmbedStream")(iter(requests), timeout=30)]
    np.testing.assert_allclose([a.embeddings for a in answers], np.concatenate([want] * 3), rtol=0, atol=1e-6)
    hidden = (await s.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=TEXTS[1])]), timeout=30)).outputs[0]
    every = await tei.call("Embed", "EmbedAll")(tei.EmbedAllRequest(inputs=TEXTS[1]), timeout=30)
    np.testing.assert_allclose([t.embeddings for t in every.token_embeddings], from_tensor(hidden.hidden), rtol=0,
                               atol=1e-5)
    words = [TEXTS[0], "a b"]  # texts that decode back to themselves (this WordPiece has no decoder)
    tokenized = (await s.stub.Tokenize(pb.TokenizeRequest(texts=words), timeout=10)).texts
    tokenize = tei.call("Tokenize", "Tokenize")
    for text, ours in zip(words, tokenized, strict=True):
        with_specials = await tokenize(tei.EncodeRequest(inputs=text, add_special_tokens=True), timeout=10)
        assert [t.id for t in with_specials.tokens] == list(ours.ids)
        assert [t.special for t in with_specials.tokens] == [True] + [False] * (len(ours.ids) - 2) + [True]
        plain = await tokenize(tei.EncodeRequest(inputs=text), timeout=10)  # proto3: add_special_tokens false
        assert [t.id for t in plain.tokens] == list(ours.ids)[1:-1]
        assert not any(t.HasField("start") for t in plain.tokens)
        decoded = await tei.call("Tokenize", "Decode")(tei.DecodeRequest(ids=list(ours.ids), skip_special_tokens=True),
                                                        timeout=10)
        assert decoded.text == text
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # a task the model has no head for
        await tei.call("Rerank", "Rerank")(tei.RerankRequest(query="a", texts=["b"]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rerank" in (refused.value.details() or "")


async def test_a_stream_ends_with_the_status_of_the_request_that_fails(
        start_server: Any, tiny_text_bundle: Path, tei_proto: Proto) -> None:
    s = await start_server(bundle=tiny_text_bundle)
    tei = await tei_client(s, tei_proto)
    requests = [tei.EmbedRequest(inputs="the cat"), tei.EmbedRequest(inputs="the cat " * 20),  # 41 tokens over 8
                tei.EmbedRequest(inputs="a")]
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for answer in tei.call("Embed", "EmbedStream")(iter(requests), timeout=30):
            got.append(answer)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in (info.value.details() or "")
    assert len(got) == 1  # the one before it, in order; none after
    long = await tei.call("Embed", "Embed")(tei.EmbedRequest(inputs="the cat " * 20, truncate=True), timeout=30)
    assert len(long.embeddings) == 32 and long.metadata.compute_tokens == 8


async def test_a_tei_client_reranks_and_predicts_as_attention_v1_does(
        start_server: Any, bert_reranker: tuple[Path, Path, Any], tei_proto: Proto) -> None:
    s = await start_server(bundle=bert_reranker[0])
    tei = await tei_client(s, tei_proto)
    info = await tei.call("Info", "Info")(tei.InfoRequest(), timeout=10)
    assert info.model_type == tei.enums["ModelType"].values_by_name["MODEL_TYPE_RERANKER"].number
    query, texts = "the cat", ["a cat .", "the the the c", "b", "cats a cats"]
    want = await s.stub.Rerank(pb.RerankRequest(query=query, texts=texts), timeout=30)
    got = await tei.call("Rerank", "Rerank")(tei.RerankRequest(query=query, texts=texts, return_text=True), timeout=30)
    assert [r.index for r in got.ranks] == [r.index for r in want.results]
    np.testing.assert_allclose([r.score for r in got.ranks], [r.score for r in want.results], rtol=0, atol=1e-6)
    assert [r.text for r in got.ranks] == [texts[r.index] for r in got.ranks]
    raw = await s.stub.Rerank(pb.RerankRequest(query=query, texts=texts, raw_scores=True), timeout=30)
    other = await s.stub.Rerank(pb.RerankRequest(query="b", texts=texts[:2]), timeout=30)
    # The stream: each pair against its own query (two queries here), ranked together once it ends.
    pairs = [tei.RerankStreamRequest(query=query, text=t, raw_scores=True) for t in texts] + [
        tei.RerankStreamRequest(query="b", text=t) for t in texts[:2]]
    streamed = await tei.call("Rerank", "RerankStream")(iter(pairs), timeout=30)
    expected = {r.index: r.score for r in raw.results}
    expected.update({len(texts) + r.index: r.score for r in (await s.stub.Rerank(pb.RerankRequest(
        query="b", texts=texts[:2], raw_scores=True), timeout=30)).results})
    assert other.results  # the second query's default-scored answer exists; the stream took the first's raw_scores
    assert sorted(r.index for r in streamed.ranks) == list(range(len(pairs)))
    assert [r.score for r in streamed.ranks] == sorted((r.score for r in streamed.ranks), reverse=True)
    np.testing.assert_allclose([r.score for r in streamed.ranks], [expected[r.index] for r in streamed.ranks],
                               rtol=0, atol=1e-5)
    classify = await s.stub.Classify(pb.ClassifyRequest(pairs=[pb.TextPair(first=query, second=texts[0])]), timeout=30)
    pair = await tei.call("Predict", "PredictPair")(tei.PredictPairRequest(inputs=[query, texts[0]]), timeout=30)
    assert [p.label for p in pair.predictions] == ["LABEL_0"]
    np.testing.assert_allclose(pair.predictions[0].score, classify.results[0].scores[0].score, rtol=0, atol=1e-6)


async def test_predict_on_a_classifier_and_reflection_lists_the_services(
        start_server: Any, bert_classifier: tuple[Path, Path, Any], tei_proto: Proto) -> None:
    s = await start_server(bundle=bert_classifier[0])
    tei = await tei_client(s, tei_proto)
    text = "the the the c"
    want = (await s.stub.Classify(pb.ClassifyRequest(texts=[text]), timeout=30)).results[0].scores
    got = await tei.call("Predict", "Predict")(tei.PredictRequest(inputs=text), timeout=30)
    by_label = {p.label: p.score for p in got.predictions}
    assert set(by_label) == set(BERT_LABELS)
    assert [p.score for p in got.predictions] == sorted(by_label.values(), reverse=True)
    np.testing.assert_allclose([by_label[x.label] for x in want], [x.score for x in want], rtol=0, atol=1e-6)
    answers = [r async for r in tei.call("Predict", "PredictStream")(
        iter([tei.PredictRequest(inputs=text)] * 3), timeout=30)]
    assert len(answers) == 3
    for answer in answers:  # batched together: equal to the last bits' order of summation
        assert [p.label for p in answer.predictions] == [p.label for p in got.predictions]
        np.testing.assert_allclose([p.score for p in answer.predictions], [p.score for p in got.predictions],
                                   rtol=0, atol=1e-6)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tei.call("Predict", "PredictPair")(tei.PredictPairRequest(inputs=["a", "b", "c"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    async def ask() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
    [answer] = [r async for r in stub.ServerReflectionInfo(ask(), timeout=10)]
    names = {x.name for x in answer.list_services_response.service}
    assert {f"tei.v1.{name}" for name in ("Info", "Embed", "Predict", "Rerank", "Tokenize")} <= names
    assert s.sample("grpc_server_handled_total", {"grpc_service": "tei.v1.Predict", "grpc_method": "Predict",
                                                   "grpc_type": "unary", "grpc_code": "OK"}) == 1
    # attention_requests_total tells tei.v1's RPCs from attention.v1's of the same name, and counts streams' requests
    assert s.sample("attention_requests_total", {"method": "tei.v1.Predict/Predict", "code": "OK"}) == 1
    assert s.sample("attention_requests_total", {"method": "tei.v1.Predict/PredictStream", "code": "OK"}) == 3
    assert s.sample("attention_requests_total", {"method": "Classify", "code": "OK"}) == 1
