"""The service end to end on a real server (127.0.0.1:0): outputs, batching, validation, limits,
deadlines, cancellation, attention, streaming, health and reflection."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import SERVICE_NAME, from_tensor, to_tensor
from tests.support import helpers
from tests.support.helpers import Running, details_of, health, ids_request, violated_field, wait_for
from tests.support.reliability_helpers import fault_state  # noqa: F401  (a fixture, used by name)


async def test_outputs_equal_direct_model_calls_for_many_concurrent_callers(served: Running, reference_model):
    rng = np.random.default_rng(0)
    calls = [[rng.integers(0, 100, rng.integers(1, 65)) for _ in range(rng.integers(1, 4))] for _ in range(48)]
    responses = await asyncio.gather(*(
        served.stub.Encode(ids_request(*seqs, request_id=f"call-{i}"), timeout=30) for i, seqs in enumerate(calls)
    ))
    for i, (seqs, response) in enumerate(zip(calls, responses, strict=True)):
        assert response.request_id == f"call-{i}"
        assert len(response.outputs) == len(seqs)
        for ids, out in zip(seqs, response.outputs, strict=True):
            hidden = from_tensor(out.hidden)
            assert hidden.shape == (len(ids), 32)
            np.testing.assert_allclose(hidden, reference_model(ids)[0], atol=1e-5, rtol=0)
    assert served.sample("attention_sequences_total") == sum(len(s) for s in calls)


async def test_batching_groups_queued_callers_within_the_token_budget(start_server, fault_bundle, reference_model):
    budget = 512
    s = await start_server(bundle=fault_bundle, max_batch_tokens=budget)
    holder = asyncio.ensure_future(s.stub.Encode(ids_request([faults.SLEEP, 1]), timeout=30))
    # The 200 ms SLEEP holds the model while 32 callers queue up. Waiting for its batch to start (not a
    # fixed time) keeps a slow first call from being batched with them, in arrival order.
    await wait_for(lambda: (s.sample("attention_batches_total", {"width": "wide"}) or 0) >= 1, 10, "the holder")
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 90, rng.integers(4, 65)) for _ in range(32)]
    responses = await asyncio.gather(*(s.stub.Encode(ids_request(ids), timeout=30) for ids in seqs))
    await holder
    sizes = [r.metadata.batch_size for r in responses]
    assert max(sizes) > 1, sizes
    for r in responses:
        assert r.metadata.batch_size * r.metadata.padded_length <= budget
    for ids, r in zip(seqs, responses, strict=True):
        np.testing.assert_allclose(from_tensor(r.outputs[0].hidden), reference_model(ids)[0], atol=1e-5, rtol=0)
    # Length-aware grouping: padded tokens stay within 1.25x of real tokens for lengths 4..64 (the
    # batches seen by these 32 sequences; FIFO batches padded to their longest give about 1.6x here).
    padded = sum(r.metadata.padded_length for r in responses)
    real = sum(len(ids) for ids in seqs)
    assert padded / real <= 1.25, padded / real


def int32_request(ids: list[int]) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(np.array(ids, np.int32)))])


BAD_REQUESTS = {
    "no sequences": (pb.EncodeRequest(), "sequences"),
    "too many sequences": (ids_request(*[[1]] * 65), "sequences"),
    "too long": (ids_request(np.ones(65)), "sequences[0].token_ids"),
    "id over vocab": (ids_request([1, 2, 3], [4, 5, 100]), "sequences[1].token_ids[2]"),
    "negative id": (ids_request([1, -1]), "sequences[0].token_ids[1]"),
    "negative int32 id": (int32_request([3, 4, -2]), "sequences[0].token_ids[2]"),
    "int32 id over vocab": (int32_request([100, 1]), "sequences[0].token_ids[0]"),
    "ids as float": (pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(np.ones(3, np.float32)))]),
                     "sequences[0].token_ids"),
    "byte size mismatch": (pb.EncodeRequest(sequences=[pb.Sequence(token_ids=pb.Tensor(
        dtype=pb.DTYPE_INT64, shape=[3], data=b"\0" * 23))]), "sequences[0].token_ids"),
    "ids of rank 2": (pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(np.ones((2, 2), np.int64)))]),
                      "sequences[0].token_ids"),
    "embeddings of wrong width": (pb.EncodeRequest(sequences=[pb.Sequence(
        embeddings=to_tensor(np.ones((3, 31), np.float32)))]), "sequences[0].embeddings"),
    "no input": (pb.EncodeRequest(sequences=[pb.Sequence()]), "sequences[0]"),
    "unknown output dtype": (ids_request([1], output=pb.OutputOptions(dtype=42)), "output.dtype"),
    "int output dtype": (ids_request([1], output=pb.OutputOptions(dtype=pb.DTYPE_INT32)), "output.dtype"),
    "unknown pooling": (ids_request([1], output=pb.OutputOptions(pooling=9)), "output.pooling"),
    "unknown heads": (ids_request([1], attention=pb.AttentionOptions(return_attention=True, heads=7)),
                      "attention.heads"),
    "layer out of range": (ids_request([1], attention=pb.AttentionOptions(return_attention=True, layers=[2])),
                           "attention.layers[0]"),
    "layer twice": (ids_request([1], attention=pb.AttentionOptions(return_attention=True, layers=[1, -1])),
                    "attention.layers[1]"),
    "nothing to return": (ids_request([1], output=pb.OutputOptions(return_hidden=False)), "output"),
    "attention over budget": (ids_request(np.ones(64), attention=pb.AttentionOptions(return_attention=True)),
                              "attention"),
    "request id too long": (ids_request([1], request_id="x" * 129), "request_id"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
async def test_bad_input_is_invalid_argument_naming_the_field(start_server, case):
    s = await start_server(max_attention_bytes=64 * 64 * 4 * 2 * 4 - 1)  # one 64-token sequence, all layers: over
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_field(info.value) == field
    assert info.value.details().startswith(field)
    assert s.sample("attention_failures_total", {"reason": "invalid_argument"}) == 1
    assert s.sample("attention_batch_size_count") == 0  # nothing reached a batch


async def test_nan_in_embeddings_is_refused_and_counted(served: Running):
    embeddings = np.ones((4, 32), np.float32)
    embeddings[2, 5] = np.nan
    request = pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(embeddings))])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Encode(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_field(info.value) == "sequences[0].embeddings"
    assert served.sample("attention_nonfinite_inputs_total") == 1


async def test_malformed_message_is_invalid_argument_not_unknown(served: Running):
    raw = served.channel.unary_unary(f"/{SERVICE_NAME}/Encode")  # bytes in, bytes out
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw(b"\xff\xff\xff\xff garbage", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid attention.v1.EncodeRequest" in info.value.details()


async def test_full_queue_is_resource_exhausted_at_once_with_retry_advice(start_server):
    s = await start_server(max_queue_requests=2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(ids_request([1], [2], [3]), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in details_of(info.value))
    assert retry.retry_delay.ToNanoseconds() > 0
    assert s.sample("attention_failures_total", {"reason": "queue_full"}) == 1
    ok = await s.stub.Encode(ids_request([1], [2]), timeout=10)  # within the bound: served
    assert len(ok.outputs) == 2


@pytest.mark.usefixtures("fault_state")
async def test_expired_deadline_is_never_computed(start_server, fault_bundle):
    s = await start_server(bundle=fault_bundle)
    # The holder hangs until released (not a 200 ms sleep that a busy machine can outlast), so the
    # model is busy for as long as the short call's deadline takes to pass.
    holder = asyncio.ensure_future(s.stub.Encode(ids_request([faults.HANG]), timeout=30))
    await wait_for(lambda: s.sample("attention_batch_size_count") == 1, 10, "the holder's batch to start")
    # A deadline long enough to reach the queue on a busy machine (50 ms could pass before the call did),
    # and the call seen queued before it passes.
    short = s.stub.Encode(ids_request([5, 6, 7]), timeout=2)
    await wait_for(lambda: s.sample("attention_queue_depth") == 1, 2, "the short call to be queued")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await short
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server's deadline for the call can end a little after the caller's (it counts from when the headers
    # arrived): the model is freed only once the server has dropped the call, or it would compute it.
    await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) + s.sample(
        "attention_dropped_total", {"reason": "deadline"}) == 1, 10, "the expired call to be dropped")
    faults.HANG_RELEASE.set()
    await holder
    assert s.sample("attention_batch_size_count") == 1  # only the holder's batch ran
    assert s.sample("attention_dropped_total", {"reason": "cancelled"}) + s.sample(
        "attention_dropped_total", {"reason": "deadline"}) == 1
    assert s.sample("attention_requests_total", {"method": "Encode", "code": "DEADLINE_EXCEEDED"}) == 1


@pytest.mark.usefixtures("fault_state")
async def test_cancelled_call_is_dropped_before_compute(start_server, fault_bundle):
    s = await start_server(bundle=fault_bundle)
    holder = asyncio.ensure_future(s.stub.Encode(ids_request([faults.HANG]), timeout=30))  # until released
    await wait_for(lambda: s.sample("attention_batch_size_count") == 1, 10, "the holder's batch to start")
    call = s.stub.Encode(ids_request([5, 6, 7]), timeout=30)
    await wait_for(lambda: s.sample("attention_queue_depth") == 1, 10, "the call to be queued")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) == 1, 10,
                   "the cancelled call to be dropped")
    faults.HANG_RELEASE.set()
    await holder
    await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) == 1, 10,
                   "the cancelled call to be dropped")
    assert s.sample("attention_batch_size_count") == 1
    assert s.sample("attention_dropped_total", {"reason": "cancelled"}) == 1


async def test_attention_only_when_asked_for_the_layers_and_dtype_asked(served: Running, reference_model):
    short, long = np.arange(1, 6), np.arange(1, 40)
    plain = await served.stub.Encode(ids_request(short), timeout=10)
    assert not plain.outputs[0].HasField("attention")
    request = ids_request(short, long, attention=pb.AttentionOptions(
        return_attention=True, layers=[-1, 0], dtype=pb.DTYPE_FLOAT16))
    response = await served.stub.Encode(request, timeout=10)
    for ids, out in zip((short, long), response.outputs, strict=True):
        assert out.attention.dtype == pb.DTYPE_FLOAT16
        attention = from_tensor(out.attention).astype(np.float32)
        assert attention.shape == (2, 4, len(ids), len(ids))  # padding stripped
        expected = reference_model(ids, layers=(0, 1))[1][[1, 0]]  # asked order: last layer, then first
        np.testing.assert_allclose(attention, expected, atol=2e-3)
        np.testing.assert_allclose(attention.sum(-1), 1.0, atol=5e-3)
    mean = await served.stub.Encode(ids_request(short, attention=pb.AttentionOptions(
        return_attention=True, heads=pb.HEADS_MEAN)), timeout=10)
    np.testing.assert_allclose(from_tensor(mean.outputs[0].attention)[:, 0],
                               reference_model(short, layers=(0, 1))[1].mean(axis=1), atol=1e-6)


async def test_pooling_output_dtypes_and_causal(served: Running, reference_model):
    ids = np.arange(3, 20)
    request = ids_request(ids, causal=True, output=pb.OutputOptions(
        pooling=pb.POOLING_MEAN, dtype=pb.DTYPE_BFLOAT16, return_hidden=False))
    response = await served.stub.Encode(request, timeout=10)
    out = response.outputs[0]
    assert not out.HasField("hidden") and out.pooled.dtype == pb.DTYPE_BFLOAT16
    expected = reference_model(ids, causal=True)[0].mean(axis=0)
    np.testing.assert_allclose(from_tensor(out.pooled), expected, rtol=1e-2, atol=1e-2)
    cls = await served.stub.Encode(ids_request(ids, output=pb.OutputOptions(pooling=pb.POOLING_CLS)), timeout=10)
    np.testing.assert_allclose(from_tensor(cls.outputs[0].pooled), reference_model(ids)[0][0], atol=1e-5)


async def test_embeddings_input_equals_the_model_on_embeddings(served: Running, tiny_bundle):
    import torch

    from model.bundle import load_bundle

    embeddings = np.random.default_rng(2).standard_normal((7, 32)).astype(np.float32)
    module = load_bundle(tiny_bundle).module
    expected = module(None, torch.from_numpy(embeddings)[None], torch.tensor([7]), False, [])[0][0].numpy()
    response = await served.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(embeddings))]),
                                        timeout=10)
    np.testing.assert_allclose(from_tensor(response.outputs[0].hidden), expected, atol=1e-5)


async def test_stream_answers_each_request_and_reports_errors_in_band(served: Running, reference_model):
    seqs = [np.arange(1, n) for n in (4, 9, 17)]

    async def requests():
        for i, ids in enumerate(seqs):
            yield ids_request(ids, request_id=f"r{i}")
        yield ids_request([1000], request_id="bad")

    responses = {r.request_id: r async for r in served.stub.EncodeStream(requests(), timeout=30)}
    assert set(responses) == {"r0", "r1", "r2", "bad"}
    for i, ids in enumerate(seqs):
        np.testing.assert_allclose(from_tensor(responses[f"r{i}"].outputs[0].hidden), reference_model(ids)[0],
                                   atol=1e-5)
    bad = responses["bad"]
    assert bad.error.code == "INVALID_ARGUMENT" and bad.error.field == "sequences[0].token_ids[0]"
    assert not bad.outputs


async def test_model_info_health_and_reflection(served: Running):
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.name, info.d_model, info.n_heads, info.n_layers, info.vocab_size, info.max_length) == (
        "tiny", 32, 4, 2, 100, 64)
    assert info.limits.max_sequences_per_call == 64 and len(info.checksum) == 64
    assert await health(served.channel, "") == health_pb2.HealthCheckResponse.SERVING
    assert await health(served.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)

    async def ask():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    [answer] = [r async for r in stub.ServerReflectionInfo(ask(), timeout=10)]
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


async def test_not_serving_until_warm_then_serving(start_server, tmp_path):
    # The built-in default model (REFERENCE, built from its seed on first use) takes seconds to build
    # and warm: long enough to see the service refuse work meanwhile.
    s = await start_server(wait_ready=False, model="", cache_dir=str(tmp_path), max_batch_tokens=1024)
    assert await health(s.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await health(s.channel, "") == health_pb2.HealthCheckResponse.SERVING  # alive
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(ids_request([1, 2]), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.wait_for(s.server.ready(), 120)
    assert await health(s.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    info_ = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info_.name, info_.d_model, info_.n_layers, info_.max_length) == ("attention-reference", 256, 4, 512)


async def test_the_model_is_loaded_and_warmed_on_the_thread_that_runs_every_wide_forward(start_server, monkeypatch):
    # The lead model thread loads, warms and runs every batch that runs alone with all the cores: a
    # second OpenMP master with a team of its own made small forwards ~30% slower (Batcher.call).
    import threading

    from service.runner import Runner

    threads: dict[str, str] = {}
    widths: list[tuple[str, bool]] = []
    for name in ("load", "warmup", "execute"):
        original = getattr(Runner, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            threads[_name] = threading.current_thread().name
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Runner, name, spy)
    set_wide = Runner.set_wide
    monkeypatch.setattr(Runner, "set_wide", lambda self, wide: (
        widths.append((threading.current_thread().name, wide)), set_wide(self, wide)))
    s = await start_server(model_workers=2)
    await s.stub.Encode(ids_request(np.arange(5)), timeout=10)
    assert threads == {"load": "model-runner-0", "warmup": "model-runner-0", "execute": "model-runner-0"}
    assert widths == [("model-runner-0", True)]
    assert s.sample("attention_batches_total", {"width": "wide"}) == 1
    assert s.sample("attention_batches_total", {"width": "narrow"}) == 0


async def test_the_default_token_budget_grows_to_the_models_max_length(start_server, tmp_path):
    # The CPU default (1024 tokens) is sized for the reference model; a model with longer sequences must
    # still serve its longest one. A budget set explicitly below max_length is a configuration error.
    import dataclasses

    from model.bundle import save_bundle
    from model.config import TINY
    from model.encoder import Encoder

    long = tmp_path / "long"
    save_bundle(Encoder(dataclasses.replace(TINY, max_length=1100)).init_weights(0), long, name="long",
                version="1", source="seed:0")
    unmeasured = await start_server(bundle=long, max_batch_tokens=0, warmup=False)  # the device default, grown
    assert unmeasured.server.batcher.limits.max_batch_tokens == 1100
    s = await start_server(bundle=long, max_batch_tokens=0)  # measured at warm-up: never below max_length
    assert s.server.batcher.limits.max_batch_tokens >= 1100
    reply = await s.stub.Encode(ids_request(np.arange(1100) % 100), timeout=30)
    assert from_tensor(reply.outputs[0].hidden).shape == (1100, 32)
    with pytest.raises(ValueError, match=r"max_batch_tokens \(1024\) is below the model's max_length \(1100\)"):
        await start_server(bundle=long, max_batch_tokens=1024)


def test_model_workers_are_refused_on_cuda(tiny_bundle):
    from prometheus_client import CollectorRegistry

    from service.server import build_server

    with pytest.raises(ValueError, match="model_workers > 1 is for CPUs"):
        build_server(helpers.test_config(tiny_bundle, device="cuda", model_workers=2), CollectorRegistry())
