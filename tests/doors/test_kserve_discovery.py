"""What a KServe v2 client discovers before it infers, against real servers through tritonclient:
ModelMetadata and ModelConfig describe every input the door takes and the limits that apply to each,
RepositoryIndex names the served model, ServerReady/ModelReady follow the service's readiness, and
ModelStatistics reports the service's own counts with the compute counts perf_analyzer requires equal."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from grpc_health.v1 import health_pb2
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as v2
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.metrics import summed_counts
from tests.support.helpers import health, ids_request, wait_for

TEXT_MODEL = "tiny-bert"  # tests/support/hf_helpers.py's tiny_text_bundle: max_tokens 8, max_length 16


def ids_input(ids: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    return tensor


def text_input(texts: list[str], shape: list[int] | None = None) -> triton.InferInput:
    tensor = triton.InferInput("text", shape or [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(shape or [len(texts)]))
    return tensor


async def refusal(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        await call
    return info.value


async def test_a_text_models_metadata_and_config_list_every_input_and_the_limit_of_each(start_server,
                                                                                       tiny_text_bundle: Path):
    s = await start_server(bundle=tiny_text_bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        meta = await client.get_model_metadata(TEXT_MODEL)
        config = (await client.get_model_config(TEXT_MODEL)).config
        described = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
        assert described == {"input_ids": ("INT64", [-1, -1]), "attention_mask": ("INT64", [-1, -1]),
                             "token_type_ids": ("INT64", [-1, -1]), "text": ("BYTES", [-1, 1])}
        # Either text or input_ids: neither is required on its own. `text` is one string per row, [batch, 1]
        # as Triton writes it ([batch] is taken too). The metadata is the config with the batch dim.
        assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
            ("input_ids", mc.TYPE_INT64, [-1], True), ("attention_mask", mc.TYPE_INT64, [-1], True),
            ("token_type_ids", mc.TYPE_INT64, [-1], True), ("text", mc.TYPE_STRING, [1], True)]
        assert {(i.name, (-1, *i.dims)) for i in config.input} == {(t.name, tuple(t.shape)) for t in meta.inputs}
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert (params["max_length"], params["text_max_tokens"]) == ("16", "8")
        assert (params["text_pooling"], params["text_normalize"], params["text_prompts"]) == ("mean", "True",
                                                                                              "passage,query")

        # Each input as described is taken, and each limit is the one that applies.
        for tensor in (text_input(["a cat", "the cats"]), text_input(["a cat", "the cats"], [2, 1])):
            result = await client.infer(TEXT_MODEL, [tensor], outputs=[triton.InferRequestedOutput("pooled")])
            assert result.as_numpy("pooled").shape == (2, 32)
        too_long_text = await refusal(client.infer(TEXT_MODEL, [text_input(["a b c a b c a b c"])]))  # 11 tokens
        assert too_long_text.status() == "StatusCode.INVALID_ARGUMENT" and "limit of 8" in too_long_text.message()
        result = await client.infer(TEXT_MODEL, [ids_input(np.full((1, 16), 5))])  # ids: up to max_length
        assert result.as_numpy("last_hidden_state").shape == (1, 16, 32)
        too_long_ids = await refusal(client.infer(TEXT_MODEL, [ids_input(np.full((1, 17), 5))]))
        assert too_long_ids.status() == "StatusCode.INVALID_ARGUMENT" and "16" in too_long_ids.message()

        # An unknown input is refused naming every input the metadata lists.
        unknown = triton.InferInput("pixel_values", [1, 3], "INT64")
        unknown.set_data_from_numpy(np.ones((1, 3), np.int64))
        error = await refusal(client.infer(TEXT_MODEL, [unknown]))
        assert error.status() == "StatusCode.INVALID_ARGUMENT", error.message()
        assert error.message().startswith("inputs[0]: unknown input 'pixel_values'; this model takes ")
        assert all(name in error.message() for name in described), error.message()
    finally:
        await client.close()


async def test_all_minilm_describes_its_text_limit_256_beside_its_positions_512(start_server, minilm_bundle: Path):
    s = await start_server(bundle=minilm_bundle)
    client = triton.InferenceServerClient(s.target)  # the sync client, as a script would
    try:
        meta = await asyncio.to_thread(client.get_model_metadata, "all-MiniLM-L6-v2")
        config = (await asyncio.to_thread(client.get_model_config, "all-MiniLM-L6-v2")).config
    finally:
        client.close()
    assert ("text", "BYTES", [-1, 1]) in [(t.name, t.datatype, list(t.shape)) for t in meta.inputs]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert (params["max_length"], params["text_max_tokens"], params["text_normalize"]) == ("512", "256", "True")


async def test_a_model_without_a_tokenizer_lists_no_text_and_requires_input_ids(served, aio_client):
    meta = await aio_client.get_model_metadata("tiny")
    assert [t.name for t in meta.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    config = (await aio_client.get_model_config("tiny")).config
    assert [(i.name, i.optional) for i in config.input] == [
        ("input_ids", False), ("attention_mask", True), ("token_type_ids", True)]
    assert "text_max_tokens" not in config.parameters and config.parameters["max_length"].string_value == "64"


@pytest.fixture
async def aio_client(served) -> Any:
    client = triton_aio.InferenceServerClient(served.target)
    yield client
    await client.close()


def index_of(response: Any) -> list[tuple[str, str, str, str]]:
    return [(m.name, m.version, m.state, m.reason) for m in response.models]


async def test_readiness_and_the_repository_index_follow_the_services_state(start_server, fault_bundle: Path):
    late = await start_server(wait_ready=False, bundle=fault_bundle, allow_fault_hooks=True,
                              fault_delay_before_ready_ms=30_000)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(late.channel)
    client = triton_aio.InferenceServerClient(late.target)
    try:  # loading: not ready, and no model to name yet
        assert not await client.is_server_ready() and not await client.is_model_ready("fault-model")
        assert (await refusal(client.get_model_repository_index())).status() == "StatusCode.UNAVAILABLE"
        assert index_of(await stub.RepositoryIndex(v2.RepositoryIndexRequest(ready=True), timeout=10)) == []
    finally:
        await client.close()

    s = await start_server(drain_delay_s=30)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(s.channel)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        assert await client.is_server_ready() and await client.is_model_ready("tiny")
        assert index_of(await client.get_model_repository_index()) == [("tiny", "1", "READY", "")]
        sync = triton.InferenceServerClient(s.target)
        try:
            assert index_of(await asyncio.to_thread(sync.get_model_repository_index)) == [("tiny", "1", "READY", "")]
            assert await asyncio.to_thread(sync.is_server_ready)
        finally:
            sync.close()
        assert index_of(await stub.RepositoryIndex(v2.RepositoryIndexRequest(ready=True), timeout=10)) == [
            ("tiny", "1", "READY", "")]
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.RepositoryIndex(v2.RepositoryIndexRequest(repository_name="models"), timeout=10)
        assert other.value.code() == grpc.StatusCode.NOT_FOUND and "repository_name empty" in other.value.details()
        # The gauge exports readiness; it is not where the door reads it.
        s.server.metrics.ready.set(0)
        assert await client.is_server_ready()
        s.server.metrics.ready.set(1)

        stopping = asyncio.create_task(s.server.stop(1))  # readiness off, then a 30 s drain delay
        # The gauge is set once grpc.health.v1 says NOT_SERVING: both moments have passed then.
        await wait_for(lambda: s.sample("attention_ready") == 0, 10, "the shutdown to start")
        assert await health(s.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not await client.is_server_ready() and not await client.is_model_ready("tiny")
        assert index_of(await client.get_model_repository_index()) == [
            ("tiny", "1", "UNAVAILABLE", "server shutting down")]
        assert index_of(await stub.RepositoryIndex(v2.RepositoryIndexRequest(ready=True), timeout=10)) == []
        result = await client.infer("tiny", [ids_input(np.ones((1, 3)))])  # still served through the delay
        assert result.as_numpy("pooled").shape == (1, 32)
        stopping.cancel()
    finally:
        await client.close()


async def test_statistics_are_the_services_own_counts_with_equal_compute_counts(served, aio_client):
    await aio_client.infer("tiny", [ids_input(np.ones((2, 3)))])
    await served.stub.Encode(ids_request([1, 2, 3]), timeout=10)
    await refusal(aio_client.infer("tiny", [ids_input(np.full((1, 2), 100))]))  # id over the vocabulary

    async def one() -> Any:
        yield v2.ModelInferRequest(model_name="tiny", inputs=[v2.ModelInferRequest.InferInputTensor(
            name="input_ids", datatype="INT64", shape=[1, 4], contents=v2.InferTensorContents(
                int64_contents=[1, 2, 3, 4]))])

    stub = service_pb2_grpc.GRPCInferenceServiceStub(served.channel)
    [streamed] = [r async for r in stub.ModelStreamInfer(one(), timeout=10)]
    assert not streamed.error_message
    [s] = (await aio_client.get_inference_statistics("tiny")).model_stats
    calls = s.inference_stats
    assert (s.inference_count, calls.success.count, calls.fail.count, calls.queue.count) == (4, 3, 1, 4)
    assert 1 <= s.execution_count <= 3 and s.last_inference > 0
    forwards = served.sample("attention_compute_duration_seconds_count", {"precision": "fp32"})
    assert calls.compute_infer.count == forwards >= s.execution_count + 1  # warm-up's forwards too
    assert calls.compute_infer.ns > 0
    # perf_analyzer aborts unless the three compute counts are equal; input and output are not timed apart.
    assert calls.compute_input.count == calls.compute_infer.count == calls.compute_output.count
    assert (calls.compute_input.ns, calls.compute_output.ns) == (0, 0)
    # Edge processes read the same numbers from the summed Prometheus samples: both ways agree.
    own = served.server.metrics.stats.counts()
    assert summed_counts(served.registry, own.last_inference_ms) == own
    assert own.success.count == 3 and own.compute.count == calls.compute_infer.count

