"""Inputs longer than the model (error | truncate | chunk), through a real server on 127.0.0.1:0: chunked
outputs against the bundle run window by window and stitched by hand here (ids, embeddings, text on the
real all-MiniLM-L6-v2), chunk == no chunk within the limit, cancellation and failure of windows, the
limits and the errors, EncodeStream, KServe v2 parameters, the client and the CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton_aio

from client import EncoderClient
from model import faults
from model.bundle import load_bundle
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor, to_tensor
from tests.support.helpers import Running, ids_request, violated_field, wait_for
from tests.support.reliability_helpers import Admissions, assert_clean_status, assert_ledger_balanced, batches
from tests.support.reliability_helpers import fault_state as fault_state  # a fixture

W = 64  # the tiny model's max_length
D = 32
CHUNK = pb.LONG_INPUTS_CHUNK
Code = grpc.StatusCode


# -- the windowed computation, by hand ----------------------------------------------------------------


def starts_by_hand(T: int, window: int, stride: int) -> list[int]:
    """Window starts: every `stride` tokens while a window would end before the sequence, then one ending with it."""
    starts, a = [], 0
    while a + window < T:
        starts.append(a)
        a += stride
    return [*starts, T - window]


def stitched_by_hand(run_window: Any, x: np.ndarray, window: int, stride: int) -> tuple[np.ndarray, int]:
    """Each token's state from the window whose centre is nearest (the earlier on a tie); and the window count."""
    T = len(x)
    starts = starts_by_hand(T, window, stride)
    states = [run_window(x[a: a + window]) for a in starts]  # each (window, D)
    centres = np.array([a + (window - 1) / 2 for a in starts])
    out = np.empty((T, states[0].shape[1]), np.float32)
    for t in range(T):
        k = int(np.argmin(np.abs(t - centres)))  # argmin takes the first of equals: the earlier window
        out[t] = states[k][t - starts[k]]
    return out, len(starts)


def runner_of(bundle: Path, kind: str = "ids") -> Any:
    module = load_bundle(bundle).module

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            if kind == "ids":
                hidden, _ = module(torch.from_numpy(x.astype(np.int64))[None], None, torch.tensor([len(x)]), False, [])
            else:
                hidden, _ = module(None, torch.from_numpy(x)[None], torch.tensor([len(x)]), False, [])
        return hidden[0].float().numpy()

    return run


def normalized(v: np.ndarray) -> np.ndarray:
    return v / max(float(np.linalg.norm(v)), 1e-12)


def hidden_of(out: pb.SequenceOutput) -> np.ndarray:
    return np.asarray(from_tensor(out.hidden))


def rng_ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 90, n)  # below the fault model's sentinels (92..99)


# -- correctness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stride", [0, 33, 48, W])  # 33: odd, so some tokens lie midway between centres
async def test_chunked_ids_equal_the_windowed_model_stitched_by_hand(served: Running, tiny_bundle: Path,
                                                                       stride: int) -> None:
    ids, short = rng_ids(160), rng_ids(20, seed=1)  # 2.5 x max_length, and one within it
    run = runner_of(tiny_bundle)
    expected, windows = stitched_by_hand(run, ids, W, stride or W // 2)
    for pooling in (pb.POOLING_MEAN, pb.POOLING_CLS):
        r = await served.stub.Encode(ids_request(ids, short, long_inputs=CHUNK, chunk_stride=stride,
                                                 output=pb.OutputOptions(pooling=pooling)), timeout=30)
        long_out, short_out = r.outputs
        assert (long_out.windows, long_out.token_count, long_out.truncated) == (windows, 160, False)
        assert windows == {0: 4, 33: 4, 48: 3, W: 3}[stride]
        np.testing.assert_allclose(hidden_of(long_out), expected, rtol=0, atol=1e-5)
        pooled = expected.mean(axis=0) if pooling == pb.POOLING_MEAN else expected[0]
        np.testing.assert_allclose(from_tensor(long_out.pooled), pooled, rtol=0, atol=1e-5)
        assert short_out.windows == 0 and short_out.token_count == 20
        np.testing.assert_allclose(hidden_of(short_out), run(short), rtol=0, atol=1e-5)
    # Normalised and without hidden states: the pooled vector alone, of all 160 tokens.
    r = await served.stub.Encode(ids_request(ids, long_inputs=CHUNK, chunk_stride=stride, output=pb.OutputOptions(
        pooling=pb.POOLING_MEAN, normalize=True, return_hidden=False)), timeout=30)
    assert not r.outputs[0].HasField("hidden")
    np.testing.assert_allclose(from_tensor(r.outputs[0].pooled), normalized(expected.mean(axis=0)), rtol=0, atol=1e-5)


async def test_chunked_embeddings_equal_the_windowed_model_stitched_by_hand(served: Running, tiny_bundle: Path) -> None:
    emb = np.random.default_rng(2).standard_normal((160, D)).astype(np.float32)
    expected, windows = stitched_by_hand(runner_of(tiny_bundle, "embeddings"), emb, W, 20)
    request = pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(emb))], long_inputs=CHUNK, chunk_stride=20,
                               output=pb.OutputOptions(pooling=pb.POOLING_MEAN))
    out = (await served.stub.Encode(request, timeout=30)).outputs[0]
    assert out.windows == windows == 6 and out.token_count == 160
    np.testing.assert_allclose(hidden_of(out), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(from_tensor(out.pooled), expected.mean(axis=0), rtol=0, atol=1e-5)


async def test_within_max_length_chunk_is_exactly_no_chunk(served: Running) -> None:
    emb = np.random.default_rng(3).standard_normal((W, D)).astype(np.float32)
    sequences = [*ids_request(rng_ids(W), rng_ids(1), rng_ids(37)).sequences, pb.Sequence(embeddings=to_tensor(emb))]
    output = pb.OutputOptions(pooling=pb.POOLING_MEAN)
    plain = await served.stub.Encode(pb.EncodeRequest(sequences=sequences, output=output), timeout=30)
    for stride in (0, 1, W):
        chunked = await served.stub.Encode(pb.EncodeRequest(sequences=sequences, output=output, long_inputs=CHUNK,
                                                            chunk_stride=stride), timeout=30)
        assert [o.SerializeToString() for o in chunked.outputs] == [o.SerializeToString() for o in plain.outputs]
        assert all(o.windows == 0 for o in chunked.outputs)


async def test_truncate_keeps_the_first_max_length_tokens_of_ids_and_embeddings(served: Running,
                                                                                tiny_bundle: Path) -> None:
    ids = rng_ids(100, seed=4)
    emb = np.random.default_rng(5).standard_normal((90, D)).astype(np.float32)
    sequences = [*ids_request(ids, rng_ids(10)).sequences, pb.Sequence(embeddings=to_tensor(emb))]
    for fields in ({"long_inputs": pb.LONG_INPUTS_TRUNCATE}, {"truncate": True},
                   {"truncate": True, "long_inputs": pb.LONG_INPUTS_TRUNCATE}):
        r = await served.stub.Encode(pb.EncodeRequest(sequences=sequences, **fields), timeout=30)
        assert [(o.token_count, o.truncated, o.windows) for o in r.outputs] == [(W, True, 0), (10, False, 0),
                                                                                (W, True, 0)]
        np.testing.assert_allclose(hidden_of(r.outputs[0]), runner_of(tiny_bundle)(ids[:W]), rtol=0, atol=1e-5)
        np.testing.assert_allclose(hidden_of(r.outputs[2]), runner_of(tiny_bundle, "emb")(emb[:W]), rtol=0, atol=1e-5)


# -- errors and limits ----------------------------------------------------------------------------------


async def _refused(served: Running, request: pb.EncodeRequest) -> tuple[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Encode(request, timeout=30)
    assert info.value.code() == Code.INVALID_ARGUMENT, info.value
    assert_clean_status(info.value)
    return violated_field(info.value), info.value.details() or ""


async def test_the_default_still_refuses_naming_the_field_length_and_limit(served: Running) -> None:
    emb = np.zeros((65, D), np.float32)
    for request, field in ((ids_request(rng_ids(65)), "sequences[0].token_ids"),
                           (ids_request(rng_ids(65), long_inputs=pb.LONG_INPUTS_ERROR), "sequences[0].token_ids"),
                           (pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(emb))]),
                            "sequences[0].embeddings")):
        got, message = await _refused(served, request)
        assert got == field and "1..64" in message and "got 65" in message and "long_inputs" in message


@pytest.mark.parametrize("fields, field, words", [
    ({"long_inputs": CHUNK, "chunk_stride": 65}, "chunk_stride", ["1..64", "got 65"]),
    ({"long_inputs": CHUNK, "chunk_stride": -1}, "chunk_stride", ["got -1"]),
    ({"chunk_stride": 8}, "chunk_stride", ["not chunk"]),
    ({"long_inputs": pb.LONG_INPUTS_TRUNCATE, "chunk_stride": 8}, "chunk_stride", ["not chunk"]),
    ({"truncate": True, "long_inputs": CHUNK}, "long_inputs", ["contradicts truncate"]),
    ({"truncate": True, "long_inputs": pb.LONG_INPUTS_ERROR}, "long_inputs", ["contradicts truncate"]),
    ({"long_inputs": 9}, "long_inputs", ["unknown value 9"]),
])
async def test_bad_choices_are_invalid_argument_naming_the_field(served: Running, fields: dict[str, Any], field: str,
                                                                 words: list[str]) -> None:
    got, message = await _refused(served, ids_request(rng_ids(10), **fields))
    assert got == field and all(w in message for w in words), message


async def test_attention_with_chunk_is_refused_only_where_windows_are_needed(served: Running) -> None:
    attention = pb.AttentionOptions(return_attention=True, layers=[-1])
    field, message = await _refused(served, ids_request(rng_ids(10), rng_ids(100), long_inputs=CHUNK,
                                                        attention=attention))
    assert field == "attention.return_attention" and "sequences[1].token_ids has 100 tokens" in message
    ok = await served.stub.Encode(ids_request(rng_ids(10), long_inputs=CHUNK, attention=attention), timeout=30)
    assert list(ok.outputs[0].attention.shape) == [1, 4, 10, 10] and ok.outputs[0].windows == 0


async def test_per_call_limits_count_the_windows(start_server: Any) -> None:
    served = await start_server(max_tokens_per_call=200)
    field, message = await _refused(served, ids_request(rng_ids(160), long_inputs=CHUNK))  # 4 windows of 64
    assert field == "sequences" and "256 tokens in all" in message and "windows" in message and "200" in message
    r = await served.stub.Encode(ids_request(rng_ids(160), long_inputs=CHUNK, chunk_stride=W), timeout=30)
    assert r.outputs[0].windows == 3  # 192 tokens: within the limit
    # The queue bound counts windows: 4 windows never fit a queue of 3 sequences.
    small = await start_server(max_queue_requests=3, max_batch_size=3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await small.stub.Encode(ids_request(rng_ids(160), long_inputs=CHUNK), timeout=30)
    assert info.value.code() == Code.RESOURCE_EXHAUSTED and "0/3 sequences" in (info.value.details() or "")
    ok = await small.stub.Encode(ids_request(rng_ids(160), long_inputs=CHUNK, chunk_stride=W), timeout=30)
    assert ok.outputs[0].windows == 3


# -- the batcher: cancellation and failure -----------------------------------------------------------


async def test_cancelling_a_chunked_call_drops_all_its_queued_windows(start_server: Any, fault_bundle: Path) -> None:
    s = await start_server(bundle=fault_bundle, allow_fault_hooks=True, fault_delay_after_admit_ms=2000)
    admissions = Admissions(s)
    call = s.stub.Encode(ids_request(rng_ids(160), long_inputs=CHUNK), timeout=30)
    await wait_for(lambda: s.sample("attention_queue_depth") == 4, what="the 4 windows queued")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) == 4,
                   what="the 4 windows dropped")
    assert batches(s) == 0 and admissions.sequences == 4
    await assert_ledger_balanced(s, admissions)


@pytest.mark.usefixtures("fault_state")
async def test_a_failing_window_fails_its_call_only(start_server: Any, fault_bundle: Path) -> None:
    s = await start_server(bundle=fault_bundle, max_wait_ms=50)
    admissions = Admissions(s)
    poisoned = rng_ids(160, seed=6)
    poisoned[150] = faults.RAISE  # in the last window only (it starts at 96)
    healthy = [rng_ids(160, seed=7), rng_ids(30, seed=8), rng_ids(64, seed=9)]
    calls = [s.stub.Encode(ids_request(poisoned, long_inputs=CHUNK), timeout=30)] + [
        s.stub.Encode(ids_request(ids, long_inputs=CHUNK), timeout=30) for ids in healthy]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[0], grpc.aio.AioRpcError) and results[0].code() == Code.INTERNAL
    assert_clean_status(results[0])
    for ids, result in zip(healthy, results[1:], strict=True):
        assert isinstance(result, pb.EncodeResponse), result
        assert result.outputs[0].token_count == len(ids) and result.outputs[0].HasField("hidden")
    await assert_ledger_balanced(s, admissions)
    assert admissions.sequences == 4 + 4 + 1 + 1


# -- EncodeStream, KServe, the client and the CLI ------------------------------------------------------


async def test_encode_stream_chunks_one_response_per_request(served: Running, tiny_bundle: Path) -> None:
    ids = rng_ids(130, seed=10)
    expected, windows = stitched_by_hand(runner_of(tiny_bundle), ids, W, W // 2)

    async def requests() -> Any:
        yield ids_request(ids, request_id="long", long_inputs=CHUNK)
        yield ids_request(rng_ids(5), request_id="short", long_inputs=CHUNK)
        yield ids_request(ids, request_id="refused")

    answers = {r.request_id: r async for r in served.stub.EncodeStream(requests(), timeout=30)}
    assert sorted(answers) == ["long", "refused", "short"]
    assert answers["long"].outputs[0].windows == windows == 4
    np.testing.assert_allclose(hidden_of(answers["long"].outputs[0]), expected, rtol=0, atol=1e-5)
    assert answers["short"].outputs[0].windows == 0
    assert answers["refused"].error.code == "INVALID_ARGUMENT" and answers["refused"].error.field == \
        "sequences[0].token_ids"


async def test_kserve_parameters_choose_what_to_do_with_long_rows(served: Running, tiny_bundle: Path) -> None:
    from tests.doors.test_kserve import MODEL, inputs, outputs

    ids = np.zeros((2, 160), np.int64)
    ids[0], ids[1, :20] = rng_ids(160, seed=11), rng_ids(20, seed=12)
    mask = (ids != 0).astype(np.int64)
    mask[0] = 1
    expected, windows = stitched_by_hand(runner_of(tiny_bundle), ids[0], W, 40)
    client = triton_aio.InferenceServerClient(served.target)
    try:
        result = await client.infer(MODEL, inputs(ids, mask), outputs=outputs("last_hidden_state", "pooled"),
                                    parameters={"long_inputs": "chunk", "chunk_stride": 40})
        hidden = result.as_numpy("last_hidden_state")
        assert hidden.shape == (2, 160, D)
        np.testing.assert_allclose(hidden[0], expected, rtol=0, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("pooled")[0], expected.mean(axis=0), rtol=0, atol=1e-5)
        assert not hidden[1, 20:].any()
        assert result.get_response().parameters["windows"].int64_param == windows == 4
        cut = await client.infer(MODEL, inputs(ids, mask), outputs=outputs("last_hidden_state"),
                                 parameters={"long_inputs": "truncate"})
        assert cut.as_numpy("last_hidden_state").shape == (2, W, D)
        assert cut.get_response().parameters["truncated"].bool_param
        np.testing.assert_allclose(cut.as_numpy("last_hidden_state")[0], runner_of(tiny_bundle)(ids[0, :W]),
                                   rtol=0, atol=1e-5)
        for parameters, field in (({}, "input_ids[0]"), ({"long_inputs": "chunk", "chunk_stride": 65},
                                                         "parameters.chunk_stride"),
                                  ({"long_inputs": "slice"}, "parameters.long_inputs"),
                                  ({"long_inputs": "chunk", "truncate": True}, "parameters.long_inputs")):
            with pytest.raises(Exception) as info:
                await client.infer(MODEL, inputs(ids, mask), parameters=parameters)
            assert "INVALID_ARGUMENT" in str(info.value) and field in str(info.value), (parameters, info.value)
        with pytest.raises(Exception) as attention:
            await client.infer(MODEL, inputs(ids, mask), outputs=outputs("attention"),
                               parameters={"long_inputs": "chunk"})
        assert "INVALID_ARGUMENT" in str(attention.value) and "chunked" in str(attention.value)
    finally:
        await client.close()


async def test_client_and_cli_take_long_inputs(served: Running, tiny_bundle: Path, capsys: Any) -> None:
    from client import cli

    ids = rng_ids(100, seed=13)
    expected, windows = stitched_by_hand(runner_of(tiny_bundle), ids, W, 16)
    async with EncoderClient(served.target) as c:
        result = await c.encode([ids, ids[:8]], long_inputs="chunk", stride=16, pooling="mean")
        cut = await c.encode([ids], long_inputs="truncate")
    assert result.windows == [windows, 0] and result.token_counts == [100, 8] and windows == 4
    np.testing.assert_allclose(result.hidden[0], expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.pooled[0], expected.mean(axis=0), rtol=0, atol=1e-5)
    assert cut.truncated == [True] and cut.token_counts == [W] and cut.hidden[0].shape == (W, D)
    target = ["--target", served.target]
    assert await asyncio.to_thread(cli.main, [*target, "encode", "--ids", *map(str, ids), "--long-inputs", "chunk",
                                              "--stride", "16", "--pooling", "mean"]) == 0
    out = capsys.readouterr().out
    assert "sequence 0: 100 tokens (chunked: 4 windows)" in out and "hidden    [100, 32]" in out
    assert await asyncio.to_thread(cli.main, [*target, "encode", "--ids", *map(str, ids)]) == 1
    assert "long_inputs" in capsys.readouterr().err


# -- text ------------------------------------------------------------------------------------------


async def test_minilm_text_chunks_over_the_whole_tokenized_text(start_server: Any, minilm_bundle: Path,
                                                                minilm_reference: Any) -> None:
    served = await start_server(bundle=minilm_bundle)
    text = minilm_reference.texts[5]  # 410 tokens, over the model's 256
    r = await served.stub.Encode(pb.EncodeRequest(
        sequences=[pb.Sequence(text=text), pb.Sequence(text="Hello world")], long_inputs=CHUNK,
        output=pb.OutputOptions(pooling=pb.POOLING_MODEL, return_tokens=True)), timeout=120)
    long_out, short_out = r.outputs
    ids = np.asarray(from_tensor(long_out.token_ids))
    tokenizer = load_bundle(minilm_bundle).tokenizer
    assert tokenizer is not None
    assert ids.tolist() == tokenizer.encode([text], truncate=False)[0].ids.tolist()
    assert long_out.tokens[0] == "[CLS]" and long_out.tokens[-1] == "[SEP]" and len(ids) == long_out.token_count == 410
    assert "[CLS]" not in long_out.tokens[1:] and "[SEP]" not in long_out.tokens[:-1]  # windows not re-wrapped
    expected, windows = stitched_by_hand(runner_of(minilm_bundle), ids, 256, 128)
    assert long_out.windows == windows == 3 and not long_out.truncated
    np.testing.assert_allclose(hidden_of(long_out), expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(from_tensor(long_out.pooled), normalized(expected.mean(axis=0)), rtol=0, atol=1e-5)
    # A text within the limit is unchanged: it matches sentence-transformers as without chunking.
    assert short_out.windows == 0
    np.testing.assert_allclose(from_tensor(short_out.pooled), minilm_reference.embeddings[0], rtol=0, atol=1e-5)
    field, message = await _refused(served, pb.EncodeRequest(sequences=[pb.Sequence(text=text)], long_inputs=CHUNK,
                                                             chunk_stride=257))
    assert field == "chunk_stride" and "1..256" in message


async def test_text_chunks_through_grpc_and_kserve_alike(start_server: Any, tiny_text_bundle: Path) -> None:
    from tests.doors.test_kserve_text import text_input

    served = await start_server(bundle=tiny_text_bundle)  # max_tokens 8
    text = "a b c a b c a b c"  # 11 tokens with [CLS] and [SEP]
    r = await served.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=text)], long_inputs=CHUNK,
                                                  chunk_stride=3, output=pb.OutputOptions(
                                                      pooling=pb.POOLING_MODEL, return_tokens=True)), timeout=30)
    out = r.outputs[0]
    ids = np.asarray(from_tensor(out.token_ids))
    expected, windows = stitched_by_hand(runner_of(tiny_text_bundle), ids, 8, 3)
    assert (out.token_count, out.windows, windows) == (11, 2, 2) and list(out.tokens[::10]) == ["[CLS]", "[SEP]"]
    np.testing.assert_allclose(hidden_of(out), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(from_tensor(out.pooled), normalized(expected.mean(axis=0)), rtol=0, atol=1e-5)
    client = triton_aio.InferenceServerClient(served.target)
    try:
        result = await client.infer("tiny-bert", [text_input([text, "the cats"])],
                                    parameters={"long_inputs": "chunk", "chunk_stride": 3})
        assert result.as_numpy("last_hidden_state").shape == (2, 11, 32)
        np.testing.assert_allclose(result.as_numpy("last_hidden_state")[0], expected, rtol=0, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("pooled")[0], from_tensor(out.pooled), rtol=0, atol=1e-6)
        assert result.get_response().parameters["windows"].int64_param == 2
        with pytest.raises(Exception) as info:  # the text window is max_tokens (8), not max_length
            await client.infer("tiny-bert", [text_input([text])], parameters={"long_inputs": "chunk",
                                                                               "chunk_stride": 9})
        assert "parameters.chunk_stride" in str(info.value) and "1..8" in str(info.value)
    finally:
        await client.close()
