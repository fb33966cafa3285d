"""The Tokenize RPC (TEI's /tokenize) through a real server: the ids Encode runs and sentence-transformers gives
(all-MiniLM-L6-v2), Encode's limits and errors (INVALID_ARGUMENT naming the field, a model without a tokenizer
too), counted in the metrics like the other methods; the client library and `python -m client tokenize`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from client import EncoderClient, SyncEncoderClient
from client.cli import main as cli_main
from client.errors import InvalidArgument
from model.bundle import load_bundle
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.helpers import violated_field, wait_for
from tests.support.hf_helpers import Reference
from tests.support.reliability_helpers import assert_clean_status


async def test_tokenize_gives_the_ids_of_sentence_transformers_and_of_encode(
        start_server: Any, minilm_bundle: Path, minilm_reference: Reference) -> None:
    served = await start_server(bundle=minilm_bundle)
    texts = minilm_reference.texts
    response = await served.stub.Tokenize(pb.TokenizeRequest(texts=texts, truncate=True), timeout=60)
    assert len(response.texts) == len(texts) >= 20
    for i, (got, want) in enumerate(zip(response.texts, minilm_reference.ids, strict=True)):
        assert list(got.ids) == want, texts[i][:40]
        assert got.token_count == len(want) == len(got.tokens)
        assert got.truncated == (i in (5, 6, 8))
    assert list(response.texts[0].tokens) == ["[CLS]", "hello", "world", "[SEP]"]
    # The ids and tokens Encode runs the same texts with (return_tokens), in one call.
    encoded = await served.stub.Encode(pb.EncodeRequest(
        sequences=[pb.Sequence(text=t) for t in texts], truncate=True,
        output=pb.OutputOptions(pooling=pb.POOLING_MODEL, return_hidden=False, return_tokens=True)), timeout=120)
    for got, out in zip(response.texts, encoded.outputs, strict=True):
        assert list(got.ids) == from_tensor(out.token_ids).tolist() and list(got.tokens) == list(out.tokens)
        assert (got.token_count, got.truncated) == (out.token_count, out.truncated)


async def test_prompts_and_truncation_as_encode(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    r = await served.stub.Tokenize(pb.TokenizeRequest(texts=["cat", ""], prompt_name="query"), timeout=10)
    assert [list(t.tokens) for t in r.texts] == [["[CLS]", "a", "cat", "[SEP]"], ["[CLS]", "a", "[SEP]"]]
    tokenizer = load_bundle(tiny_text_bundle).tokenizer
    assert tokenizer is not None
    assert list(r.texts[0].ids) == tokenizer.encode(["cat"], truncate=False, prompt="a ")[0].ids.tolist()
    r = await served.stub.Tokenize(pb.TokenizeRequest(texts=["a b c a b c a b c"], truncate=True), timeout=10)
    assert (r.texts[0].token_count, r.texts[0].truncated) == (8, True)
    assert list(r.texts[0].tokens) == ["[CLS]", "a", "b", "c", "a", "b", "c", "[SEP]"]


@pytest.mark.parametrize(("request_", "field", "words"), [
    (pb.TokenizeRequest(texts=["a", "a b c a b c a b c"]), "texts[1]", ["11 tokens", "limit of 8", "truncate"]),
    (pb.TokenizeRequest(texts=["a"], prompt_name="nope"), "prompt_name", ["unknown prompt", "query"]),
    (pb.TokenizeRequest(), "texts", ["1..4 texts", "got 0"]),
    (pb.TokenizeRequest(texts=["a"] * 5), "texts", ["1..4 texts", "got 5"]),
    (pb.TokenizeRequest(texts=["a" * 40, "b" * 30]), "texts", ["70 characters", "at most 64"]),
])
async def test_errors_name_the_field(start_server: Any, tiny_text_bundle: Path, request_: pb.TokenizeRequest,
                                     field: str, words: list[str]) -> None:
    served = await start_server(bundle=tiny_text_bundle, max_text_chars=64, max_sequences_per_call=4)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Tokenize(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean_status(info.value)
    assert violated_field(info.value) == field
    for word in words:
        assert word in (info.value.details() or ""), info.value.details()


async def test_a_model_without_a_tokenizer_and_malformed_bytes_are_invalid_argument(served: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Tokenize(pb.TokenizeRequest(texts=["hello"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(info.value) == "texts[0]"
    assert "has no tokenizer" in (info.value.details() or "")
    tokenize = served.channel.unary_unary("/attention.v1.AttentionService/Tokenize")
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await tokenize(b"\x0a\x02\xff\xfe", timeout=10)  # texts[0]: two bytes that are not UTF-8
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean_status(malformed.value)


async def test_tokenize_is_counted_like_the_other_methods(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    await served.stub.Tokenize(pb.TokenizeRequest(texts=["the cats"]), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError):
        await served.stub.Tokenize(pb.TokenizeRequest(), timeout=10)
    # The caller has its status before the server's interceptor has counted it: wait for the count.
    await wait_for(lambda: served.sample("attention_requests_total",
                                         {"method": "Tokenize", "code": "INVALID_ARGUMENT"}) == 1,
                   10, "the refused Tokenize call to be counted")
    assert served.sample("attention_requests_total", {"method": "Tokenize", "code": "OK"}) == 1
    assert served.sample("attention_requests_total", {"method": "Tokenize", "code": "INVALID_ARGUMENT"}) == 1
    grpc_labels = {"grpc_type": "unary", "grpc_service": "attention.v1.AttentionService", "grpc_method": "Tokenize"}
    assert served.sample("grpc_server_handled_total", {**grpc_labels, "grpc_code": "OK"}) == 1
    assert served.sample("grpc_server_started_total", grpc_labels) == 2


async def test_client_library_and_cli(start_server: Any, minilm_bundle: Path, minilm_reference: Reference,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    served = await start_server(bundle=minilm_bundle)
    async with EncoderClient(served.target) as c:
        got = await c.tokenize(["Hello world", minilm_reference.texts[5]], truncate=True)
        with pytest.raises(InvalidArgument) as too_long:
            await c.tokenize(["ok", minilm_reference.texts[5]])
    assert got[0].ids == minilm_reference.ids[0] and got[0].tokens == ["[CLS]", "hello", "world", "[SEP]"]
    assert got[1].ids == minilm_reference.ids[5] and got[1].truncated and got[1].token_count == 256
    assert too_long.value.field == "texts[1]" and "limit of 256" in too_long.value.message

    def blocking() -> list[Any]:
        with SyncEncoderClient(served.target) as sync:
            return sync.tokenize(["Hello world"])

    # The blocking client and the CLI run in a worker thread, beside this loop's server.
    assert await asyncio.to_thread(blocking) == got[:1]
    assert await asyncio.to_thread(cli_main, ["--target", served.target, "tokenize", "--text", "Hello world",
                                              "--text", "café"]) == 0
    out = capsys.readouterr().out
    assert "text[0]: 4 tokens\n  tokens [CLS] hello world [SEP]\n  ids    101 7592 2088 102" in out
    assert "text[1]:" in out
    assert await asyncio.to_thread(cli_main, ["--target", served.target, "tokenize", "--json", "--text", "a b"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"ids": [101, 1037, 1038, 102], "tokens": ["[CLS]", "a", "b", "[SEP]"], "truncated": False, "token_count": 4}]
    assert await asyncio.to_thread(cli_main, ["--target", served.target, "tokenize"]) == 2  # no --text


async def test_tokenize_through_edge_processes(tiny_text_bundle: Path, tmp_path: Path) -> None:
    """With `--edge-processes 2` the edges tokenize with the tokenizer the model process sent them."""
    from proto.attention.v1 import attention_pb2_grpc
    from tests.support.server_process import ServerProcess

    server = ServerProcess(tiny_text_bundle, "--edge-processes", "2", directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            r = await stub.Tokenize(pb.TokenizeRequest(texts=["cat", ""], prompt_name="query"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as too_long:
                await stub.Tokenize(pb.TokenizeRequest(texts=["a b c a b c a b c"]), timeout=10)
    finally:
        server.stop()
    assert [list(t.tokens) for t in r.texts] == [["[CLS]", "a", "cat", "[SEP]"], ["[CLS]", "a", "[SEP]"]]
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(too_long.value) == "texts[0]"
