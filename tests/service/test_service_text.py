"""Text in, through the running service: all-MiniLM-L6-v2 against the sentence-transformers references (one
call and concurrent calls), the text options and their errors (INVALID_ARGUMENT naming the field), start-up
with a corrupt tokenizer, and text batching with ids."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from client import EncoderClient
from client.errors import InvalidArgument
from model.bundle import BundleError
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from service.config import ServiceConfig
from tests.support.helpers import ids_request, plan_request, violated_field
from tests.support.hf_helpers import Reference
from tests.support.reliability_helpers import assert_clean_status


def _text_request(*texts: str, **fields: Any) -> pb.EncodeRequest:
    output = fields.pop("output", pb.OutputOptions(pooling=pb.POOLING_MODEL, return_tokens=True))
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], output=output, **fields)



def _check(out: pb.SequenceOutput, ref: Reference, i: int) -> None:
    assert from_tensor(out.token_ids).tolist() == ref.ids[i] and out.token_count == len(ref.ids[i])
    assert out.truncated == (i in (5, 6, 8))
    pooled = np.asarray(from_tensor(out.pooled))
    np.testing.assert_allclose(pooled, ref.embeddings[i], rtol=0, atol=1e-5)
    assert float(pooled @ ref.embeddings[i]) >= 0.99999
    hidden = np.asarray(from_tensor(out.hidden))[ref.hidden_rows[i]]
    np.testing.assert_allclose(hidden, ref.hidden[i], rtol=0, atol=1e-4)


async def test_minilm_in_one_call_matches_sentence_transformers(start_server: Any, minilm_bundle: Path,
                                                                 minilm_reference: Reference) -> None:
    served = await start_server(bundle=minilm_bundle)
    response = await served.stub.Encode(_text_request(*minilm_reference.texts, truncate=True), timeout=120)
    assert len(response.outputs) == len(minilm_reference.texts) >= 20
    for i, out in enumerate(response.outputs):
        _check(out, minilm_reference, i)
    assert list(response.outputs[14].tokens[:3]) == ["[CLS]", "[SEP]", "in"]


async def test_minilm_concurrent_calls_match_sentence_transformers(start_server: Any, minilm_bundle: Path,
                                                                   minilm_reference: Reference) -> None:
    served = await start_server(bundle=minilm_bundle, max_batch_tokens=4096)
    responses = await asyncio.gather(*(served.stub.Encode(_text_request(text, truncate=True), timeout=120)
                                       for text in minilm_reference.texts))
    for i, response in enumerate(responses):
        _check(response.outputs[0], minilm_reference, i)


async def test_minilm_info_and_client_strings(start_server: Any, minilm_bundle: Path,
                                              minilm_reference: Reference) -> None:
    served = await start_server(bundle=minilm_bundle)
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        result = await c.encode(["Hello world", ""], normalize=True, return_hidden=False, return_tokens=True)
        raw = await c.encode(["Hello world"], normalize=False, return_hidden=False)
        with pytest.raises(InvalidArgument) as too_long:
            await c.encode(["ok", minilm_reference.texts[5]])
    assert info.text is not None and info.name == "all-MiniLM-L6-v2"
    assert (info.text.max_tokens, info.text.default_pooling, info.text.default_normalize) == (256, "mean", True)
    assert info.text.tokenizer_checksum == "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
    np.testing.assert_allclose(result.pooled[0], minilm_reference.embeddings[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.pooled[1], minilm_reference.embeddings[1], rtol=0, atol=1e-5)
    assert result.tokens == [["[CLS]", "hello", "world", "[SEP]"], ["[CLS]", "[SEP]"]]
    assert result.token_counts == [4, 2] and result.truncated == [False, False] and result.hidden == []
    assert abs(float(np.linalg.norm(raw.pooled[0])) - 1) > 1e-3  # not normalised when asked not to
    np.testing.assert_allclose(raw.pooled[0] / np.linalg.norm(raw.pooled[0]), result.pooled[0], atol=1e-6)
    assert too_long.value.field == "sequences[1].text"
    assert "410 tokens" in too_long.value.message and "limit of 256" in too_long.value.message


async def test_text_and_ids_share_a_computation(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    spec = served.server.serving.model().spec
    text = plan_request(_text_request("the cats"), spec, served.server.config)
    ids = plan_request(ids_request(np.array([2, 8, 9, 10, 3])), spec, served.server.config)
    assert text.jobs[0].key == ids.jobs[0].key  # so the batcher may put them in one batch
    both = await served.stub.Encode(pb.EncodeRequest(
        sequences=[pb.Sequence(text="the cats"), ids_request(np.array([2, 8, 9, 10, 3])).sequences[0]],
        output=pb.OutputOptions(pooling=pb.POOLING_MEAN)), timeout=10)
    # One call's sequences of one computation are queued together: one batch of 2, text beside ids.
    assert both.metadata.batch_size == 2
    np.testing.assert_allclose(from_tensor(both.outputs[0].hidden), from_tensor(both.outputs[1].hidden), atol=1e-5)
    # Text takes the model's normalisation by default; ids on the same model too (one model, one embedding).
    for out in both.outputs:
        assert abs(float(np.linalg.norm(from_tensor(out.pooled))) - 1) < 1e-5
    assert [o.token_count for o in both.outputs] == [5, 5]


async def test_prompts_truncation_and_empty_text(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    r = await served.stub.Encode(_text_request("cat", "", "   ", output=pb.OutputOptions(
        pooling=pb.POOLING_CLS, prompt_name="query", return_tokens=True, return_hidden=False)), timeout=10)
    assert [list(o.tokens) for o in r.outputs] == [["[CLS]", "a", "cat", "[SEP]"], ["[CLS]", "a", "[SEP]"],
                                                   ["[CLS]", "a", "[SEP]"]]
    r = await served.stub.Encode(_text_request("a b c a b c a b c", "", truncate=True), timeout=10)
    assert [o.token_count for o in r.outputs] == [8, 2] and [o.truncated for o in r.outputs] == [True, False]
    assert list(r.outputs[0].tokens) == ["[CLS]", "a", "b", "c", "a", "b", "c", "[SEP]"]
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.text.accepted and info.text.max_tokens == 8 and dict(info.text.prompts) == {"query": "a ",
                                                                                             "passage": "b "}
    assert info.text.default_pooling == pb.POOLING_MEAN and info.text.default_normalize


@pytest.mark.parametrize(("request_", "field", "words"), [
    (_text_request("a", "a b c a b c a b c"), "sequences[1].text", ["11 tokens", "limit of 8", "truncate"]),
    (_text_request("a", output=pb.OutputOptions(prompt_name="nope")), "output.prompt_name",
     ["unknown prompt", "query"]),
    (pb.EncodeRequest(sequences=[pb.Sequence(text="a")], output=pb.OutputOptions(normalize=True)),
     "output.normalize", ["pooling"]),
    (_text_request("a" * 40, "b" * 30), "sequences", ["70 characters", "at most 64"]),
])
async def test_text_errors_name_the_field(start_server: Any, tiny_text_bundle: Path, request_: pb.EncodeRequest,
                                          field: str, words: list[str]) -> None:
    served = await start_server(bundle=tiny_text_bundle, max_text_chars=64)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Encode(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean_status(info.value)
    assert violated_field(info.value) == field
    for word in words:
        assert word in (info.value.details() or ""), info.value.details()


async def test_text_on_an_ids_only_model_is_refused(served: Any) -> None:
    for request, field in [(_text_request("hello"), "sequences[0].text"),
                           (pb.EncodeRequest(sequences=ids_request(np.array([1, 2])).sequences,
                                             output=pb.OutputOptions(pooling=pb.POOLING_MODEL)), "output.pooling"),
                           (pb.EncodeRequest(sequences=ids_request(np.array([1, 2])).sequences,
                                             output=pb.OutputOptions(prompt_name="query")), "output.prompt_name")]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Encode(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(info.value) == field
    info_ = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert not info_.HasField("text")
    # normalize on an ids-only model: asked for, applied; by default, off.
    r = await served.stub.Encode(pb.EncodeRequest(sequences=ids_request(np.array([1, 2, 3])).sequences,
                                                  output=pb.OutputOptions(pooling=pb.POOLING_MEAN, normalize=True)),
                                 timeout=10)
    assert abs(float(np.linalg.norm(from_tensor(r.outputs[0].pooled))) - 1) < 1e-5
    r = await served.stub.Encode(ids_request(np.array([1, 2, 3]), output=pb.OutputOptions(pooling=pb.POOLING_MEAN)),
                                 timeout=10)
    assert abs(float(np.linalg.norm(from_tensor(r.outputs[0].pooled))) - 1) > 1e-3


async def test_invalid_utf8_is_invalid_argument(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    good = _text_request("cat").SerializeToString()
    bad = good.replace(b"cat", b"c\xffa")  # the string field's bytes, same length: no longer UTF-8
    call = served.channel.unary_unary("/attention.v1.AttentionService/Encode")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(bad, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean_status(info.value)


async def test_big_text_calls_tokenize_off_the_event_loop(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle)
    # Over TOKENIZE_INLINE_CHARS: validated in a worker thread; same answer as inline.
    long = "the cats " * 600
    r = await served.stub.Encode(_text_request(long, "cat", truncate=True), timeout=10)
    assert [o.token_count for o in r.outputs] == [8, 3] and r.outputs[0].truncated


async def test_corrupt_tokenizer_fails_start_up(start_server: Any, tiny_text_bundle: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_text_bundle, bundle)
    data = bytearray((bundle / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle / "tokenizer.json").write_bytes(bytes(data))
    served = await start_server(bundle=bundle, wait_ready=False)
    with pytest.raises(BundleError, match=r"tokenizer\.json failed its checksum: manifest sha256 [0-9a-f]{64}, "
                                          r"file sha256 [0-9a-f]{64}"):
        await served.server.ready()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Encode(_text_request("cat"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_max_text_chars_is_validated() -> None:
    with pytest.raises(ValueError, match="max_text_chars"):
        ServiceConfig(max_text_chars=0)


async def test_cli_takes_text(start_server: Any, tiny_text_bundle: Path, capsys: pytest.CaptureFixture[str],
                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.image

    from client import cli

    served = await start_server(bundle=tiny_text_bundle)
    target = ["--target", served.target]
    assert await asyncio.to_thread(cli.main, [*target, "encode", "--text", "the cats", "--text", "",
                                              "--tokens", "--no-hidden"]) == 0
    out = capsys.readouterr().out
    assert "sequence 0: 5 tokens" in out and "tokens    [CLS] the cat ##s [SEP]" in out
    assert "sequence 1: 2 tokens" in out and "pooled    [32]" in out
    assert await asyncio.to_thread(cli.main, [*target, "encode", "--text", "a b c a b c a b c", "--truncate",
                                              "--prompt", "passage", "--tokens", "--no-hidden"]) == 0
    assert "8 tokens (truncated)" in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, [*target, "encode", "--text", "a b c a b c a b c"]) == 1
    assert "sequences[0].text" in capsys.readouterr().err
    assert await asyncio.to_thread(cli.main, [*target, "info"]) == 0
    assert "text.max_tokens" in capsys.readouterr().out

    labels: list[Any] = []
    real = cli.save_heatmap

    def recording(weights: Any, ids: Any, *args: Any, **kwargs: Any) -> None:
        labels.append(ids)
        real(weights, ids, *args, **kwargs)

    monkeypatch.setattr(cli, "save_heatmap", recording)
    png = tmp_path / "text.png"
    assert await asyncio.to_thread(cli.main, [*target, "plot", "--text", "the cats", "--out", str(png)]) == 0
    assert labels == [["[CLS]", "the", "cat", "##s", "[SEP]"]]
    assert matplotlib.image.imread(png).shape[0] >= 300
