"""The KServe v2 front door (inference.GRPCInferenceService) end to end: tritonclient, sync and aio,
against a real server on 127.0.0.1:0, beside attention.v1 on the same port and the same batcher."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2 as v2
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from model import faults
from model.bundle import save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from service.doors.grpc_server import ledger
from tests.support.helpers import Running, ids_request, wait_for
from tests.support.reliability_helpers import fault_state  # noqa: F401  (a fixture)

MODEL, D = "tiny", 32  # tests/conftest.py's tiny bundle: d_model 32, 4 heads, 2 layers, vocab 100


def ragged(lengths: list[int], T: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [batch, T] for rows of these lengths, right-padded with id 0."""
    rng = np.random.default_rng(seed)
    T = T or max(lengths)
    ids = np.zeros((len(lengths), T), np.int64)
    mask = np.zeros((len(lengths), T), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, 90, n)
        mask[i, :n] = 1
    return ids, mask


def inputs(ids: np.ndarray, mask: np.ndarray | None = None, datatype: str = "INT64") -> list[Any]:
    arrays = [("input_ids", ids)] + ([("attention_mask", mask)] if mask is not None else [])
    out = []
    for name, array in arrays:
        array = array.astype(np.int32 if datatype == "INT32" else np.int64)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def outputs(*names: str) -> list[Any]:
    return [triton.InferRequestedOutput(name) for name in names]


@pytest.fixture
async def aio(served: Running) -> Any:
    client = triton_aio.InferenceServerClient(served.target)
    yield client
    await client.close()


async def test_health_metadata_and_config_describe_the_served_model(served: Running, aio: Any):
    assert await aio.is_server_live() and await aio.is_server_ready()
    assert await aio.is_model_ready(MODEL) and await aio.is_model_ready(MODEL, "1")
    assert not await aio.is_model_ready("other") and not await aio.is_model_ready(MODEL, "2")
    server = await aio.get_server_metadata()
    assert server.name == "attention-service" and "statistics" in server.extensions
    meta = await aio.get_model_metadata(MODEL)
    assert (meta.name, list(meta.versions), meta.platform) == (MODEL, ["1"], "pytorch_libtorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]), ("token_type_ids", "INT64", [-1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("last_hidden_state", "FP32", [-1, -1, D]), ("pooled", "FP32", [-1, D]), ("attention", "FP32", [-1] * 5)]
    config = (await aio.get_model_config(MODEL)).config
    assert config.name == MODEL and config.max_batch_size == served.server.config.max_sequences_per_call
    assert [(i.name, list(i.dims), i.optional) for i in config.input] == [
        ("input_ids", [-1], False), ("attention_mask", [-1], True), ("token_type_ids", [-1], True)]
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.default_queue_policy.max_queue_size == served.server.config.max_queue_requests
    assert config.parameters["max_length"].string_value == "64"
    # perf_analyzer needs metadata for every output the config names, with the batch dim added.
    assert {(o.name, (-1, *o.dims)) for o in config.output} == {(t.name, tuple(t.shape)) for t in meta.outputs}

    async def ask() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    [answer] = [r async for r in stub.ServerReflectionInfo(ask(), timeout=10)]
    assert "inference.GRPCInferenceService" in {s.name for s in answer.list_services_response.service}


async def test_unknown_model_or_version_is_not_found_with_tritons_text(aio: Any):
    for call in (aio.get_model_metadata("other"), aio.get_model_config(MODEL, "7"),
                 aio.infer("other", inputs(np.ones((1, 3), np.int64)))):
        with pytest.raises(InferenceServerException) as info:
            await call
        assert info.value.status() == "StatusCode.NOT_FOUND"
        assert info.value.message().startswith("Request for unknown model: ")


async def test_ragged_rows_equal_the_model_and_attention_v1_sync_and_aio(served: Running, aio: Any, reference_model):
    lengths = [10, 4, 7]
    ids, mask = ragged(lengths, T=12)
    sync = triton.InferenceServerClient(served.target)
    try:
        sync_result = await asyncio.to_thread(sync.infer, MODEL, inputs(ids, mask, "INT32"))
    finally:
        sync.close()
    aio_result = await aio.infer(MODEL, inputs(ids, mask))
    v1 = await served.stub.Encode(ids_request(*(ids[i, :n] for i, n in enumerate(lengths)),
                                              output=pb.OutputOptions(pooling=pb.POOLING_MEAN)), timeout=10)
    for result in (sync_result, aio_result):
        hidden, pooled = result.as_numpy("last_hidden_state"), result.as_numpy("pooled")
        assert hidden.shape == (3, 12, D) and pooled.shape == (3, D) and hidden.dtype == np.float32
        for i, n in enumerate(lengths):
            want = reference_model(ids[i, :n])[0]
            np.testing.assert_allclose(hidden[i, :n], want, atol=1e-5, rtol=0)
            assert not hidden[i, n:].any()  # padded back to the request's T with zeros
            np.testing.assert_allclose(pooled[i], want.mean(axis=0), atol=1e-5, rtol=0)
            np.testing.assert_allclose(hidden[i, :n], from_tensor(v1.outputs[i].hidden), atol=1e-5, rtol=0)
            np.testing.assert_allclose(pooled[i], from_tensor(v1.outputs[i].pooled), atol=1e-5, rtol=0)
        response = result.get_response()
        assert response.model_name == MODEL and response.parameters["batch_size"].int64_param >= 1
    assert served.sample("attention_requests_total", {"method": "ModelInfer", "code": "OK"}) == 2


async def test_typed_contents_and_no_mask_give_the_same_as_raw_bytes(served: Running, reference_model):
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(served.channel)
    request = v2.ModelInferRequest(model_name=MODEL, id="typed", inputs=[v2.ModelInferRequest.InferInputTensor(
        name="input_ids", datatype="INT32", shape=[2, 4], contents=v2.InferTensorContents(int_contents=ids.ravel()))],
        outputs=[v2.ModelInferRequest.InferRequestedOutputTensor(name="last_hidden_state")])
    response = await stub.ModelInfer(request, timeout=10)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["last_hidden_state"]
    hidden = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)
    for i in range(2):
        np.testing.assert_allclose(hidden[i], reference_model(ids[i])[0], atol=1e-5, rtol=0)


async def test_attention_only_when_requested_with_layers_heads_and_fp16(aio: Any, reference_model):
    lengths = [6, 3]
    ids, mask = ragged(lengths, seed=1)
    plain = await aio.infer(MODEL, inputs(ids, mask))
    assert plain.as_numpy("attention") is None
    result = await aio.infer(MODEL, inputs(ids, mask), outputs=outputs("attention", "last_hidden_state"),
                             parameters={"attention_layers": "-1,0", "attention_heads": "mean",
                                         "attention_datatype": "FP16"})
    attention = result.as_numpy("attention")
    assert attention.dtype == np.float16 and attention.shape == (2, 2, 1, 6, 6)
    assert result.as_numpy("pooled") is None  # not requested
    for i, n in enumerate(lengths):
        # Layers come back in the order asked: -1 (layer 1) first.
        want = reference_model(ids[i, :n], layers=(0, 1))[1][::-1].mean(axis=1, keepdims=True)  # (L, 1, t, t)
        np.testing.assert_allclose(attention[i, :, :, :n, :n].astype(np.float32), want, atol=1e-3, rtol=0)
        assert not attention[i, :, :, n:].any() and not attention[i, :, :, :, n:].any()


async def test_fp16_bf16_outputs_cls_pooling_and_the_embeddings_name(served: Running, aio: Any, reference_model):
    ids, mask = ragged([5, 8], seed=2)
    result = await aio.infer(MODEL, inputs(ids, mask), outputs=outputs("embeddings", "last_hidden_state"),
                             parameters={"datatype": "FP16", "pooling": "cls"})
    hidden, embeddings = result.as_numpy("last_hidden_state"), result.as_numpy("embeddings")
    assert hidden.dtype == embeddings.dtype == np.float16
    for i, n in enumerate([5, 8]):
        want = reference_model(ids[i, :n])[0]
        np.testing.assert_allclose(hidden[i, :n].astype(np.float32), want, atol=5e-3, rtol=0)
        np.testing.assert_allclose(embeddings[i].astype(np.float32), want[0], atol=5e-3, rtol=0)
    # A per-output datatype (raw stub: tritonclient's InferRequestedOutput cannot set it) overrides the request's.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(served.channel)
    out = v2.ModelInferRequest.InferRequestedOutputTensor(name="pooled")
    out.parameters["datatype"].string_param = "BF16"
    request = v2.ModelInferRequest(model_name=MODEL, inputs=[inputs(ids, mask)[0]._get_tensor()],
                                   raw_input_contents=[ids.tobytes()], outputs=[out])
    response = await stub.ModelInfer(request, timeout=10)
    assert response.outputs[0].datatype == "BF16"
    pooled = np.frombuffer(response.raw_output_contents[0], ml_dtypes.bfloat16).reshape(2, D).astype(np.float32)
    np.testing.assert_allclose(pooled[1], reference_model(ids[1])[0].mean(axis=0), atol=3e-2, rtol=0)


async def test_statistics_count_both_front_doors_model_wide(served: Running, aio: Any):
    ids, mask = ragged([3, 5])
    await aio.infer(MODEL, inputs(ids, mask))
    await served.stub.Encode(ids_request([1, 2, 3]), timeout=10)
    with pytest.raises(InferenceServerException):
        await aio.infer(MODEL, inputs(np.full((1, 2), 100, np.int64)))  # id over vocab
    stats = (await aio.get_inference_statistics(MODEL)).model_stats
    assert [(s.name, s.version) for s in stats] == [(MODEL, "1")]
    s = stats[0]
    assert s.inference_count == 3 and 1 <= s.execution_count <= 3 and s.last_inference > 0
    assert s.inference_stats.success.count == 2 and s.inference_stats.fail.count == 1
    assert s.inference_stats.success.ns > 0 and s.inference_stats.queue.count == 3
    assert s.inference_stats.compute_infer.count >= s.execution_count  # forwards, warm-up's included


async def test_v1_and_v2_callers_ride_one_batch(start_server, fault_bundle, fault_state, reference_model):  # noqa: F811
    s = await start_server(bundle=fault_bundle, model_workers=1)
    holder = asyncio.ensure_future(s.stub.Encode(ids_request([faults.HANG, 1]), timeout=30))
    assert await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        # One length for all three: then a batch of all of them scores best whatever their ages
        # (service/window.py), so what this holds is the front doors', not the batch policy's.
        ids, mask = ragged([5, 5], T=7, seed=3)
        v2_call = asyncio.ensure_future(client.infer("fault-model", inputs(ids, mask), client_timeout=30))
        v1_call = asyncio.ensure_future(s.stub.Encode(ids_request([7, 8, 9, 10, 11]), timeout=30))
        await wait_for(lambda: s.sample("attention_queue_depth") == 3, 10, "three queued sequences")
        faults.HANG_RELEASE.set()
        await holder
        v2_result, v1_result = await asyncio.gather(v2_call, v1_call)
        # The model frees, and the next batch takes everything queued: both callers' sequences.
        assert v2_result.get_response().parameters["batch_size"].int64_param == 3
        assert v1_result.metadata.batch_size == 3
        hidden = v2_result.as_numpy("last_hidden_state")
        assert hidden.shape == (2, 7, D) and not hidden[:, 5:].any()
        for i in range(2):
            np.testing.assert_allclose(hidden[i, :5], reference_model(ids[i, :5])[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(from_tensor(v1_result.outputs[0].hidden),
                                   reference_model(np.array([7, 8, 9, 10, 11]))[0], atol=1e-5, rtol=0)
        stats = (await client.get_inference_statistics("fault-model")).model_stats[0]
        assert (stats.inference_count, stats.execution_count) == (4, 2)  # the holder's batch, then 3 together
    finally:
        await client.close()


def request_with(**changes: Any) -> v2.ModelInferRequest:
    """A valid two-row request (INT64 ids + mask, raw bytes), then `changes` applied by the test."""
    ids, mask = ragged([3, 2])
    request = v2.ModelInferRequest(model_name=MODEL, inputs=[t._get_tensor() for t in inputs(ids, mask)],
                                   raw_input_contents=[ids.tobytes(), mask.tobytes()])
    for key, value in changes.items():
        value(request) if callable(value) else setattr(request, key, value)
    return request


def set_param(name: str, **value: Any) -> Any:
    return lambda r: r.parameters[name].MergeFrom(v2.InferParameter(**value))


def add_output(name: str) -> Any:
    return lambda r: r.outputs.add(name=name)


def set_input(i: int, **fields: Any) -> Any:
    def change(r: v2.ModelInferRequest) -> None:
        for key, value in fields.items():
            if key == "shape":
                r.inputs[i].shape[:] = value
            else:
                setattr(r.inputs[i], key, value)
    return change


def set_raw(i: int, data: bytes) -> Any:
    return lambda r: r.raw_input_contents.__setitem__(i, data)


def mask_row(row: list[int]) -> Any:
    def change(r: v2.ModelInferRequest) -> None:
        mask = np.frombuffer(r.raw_input_contents[1], np.int64).reshape(2, 3).copy()
        mask[1] = row
        r.raw_input_contents[1] = mask.tobytes()
    return change


def token_types(values: list[int]) -> Any:
    def change(r: v2.ModelInferRequest) -> None:
        r.inputs.add(name="token_type_ids", datatype="INT64", shape=[2, 3])
        r.raw_input_contents.append(np.array(values, np.int64).tobytes())
    return change


BAD = {  # case: (changes, field the message starts with)
    "ids as float": ({"_": set_input(0, datatype="FP32")}, "input_ids"),
    "ids of rank 1": ({"_": set_input(0, shape=[6])}, "input_ids"),
    "byte size mismatch": ({"_": set_raw(0, b"\0" * 47)}, "input_ids"),
    "mask of another shape": ({"_": set_input(1, shape=[3, 2])}, "attention_mask"),
    "mask with a hole": ({"_": mask_row([1, 0, 1])}, "attention_mask[1]"),
    "left-padded mask": ({"_": mask_row([0, 1, 1])}, "attention_mask[1]"),
    "all-zero mask row": ({"_": mask_row([0, 0, 0])}, "attention_mask[1]"),
    "mask value 2": ({"_": mask_row([1, 2, 0])}, "attention_mask[1, 1]"),
    "nonzero token type": ({"_": token_types([0, 0, 0, 0, 1, 0])}, "token_type_ids[1, 1]"),
    "id over vocab": ({"_": set_raw(0, np.array([1, 2, 3, 4, 100, 0], np.int64).tobytes())}, "input_ids[1, 1]"),
    "unknown input": ({"_": set_input(1, name="pixel_values")}, "inputs[1]"),
    "input twice": ({"_": set_input(1, name="input_ids")}, "input_ids"),
    "missing raw tensor": ({"_": lambda r: r.raw_input_contents.pop()}, "raw_input_contents"),
    "unknown output": ({"_": add_output("logits")}, "outputs[0]"),
    "output twice": ({"a": add_output("pooled"), "b": add_output("pooled")}, "pooled"),
    "id too long": ({"id": "x" * 129}, "id"),
    "unknown parameter": ({"_": set_param("pooling_mode", string_param="mean")}, "parameters.pooling_mode"),
    "unknown pooling": ({"_": set_param("pooling", string_param="max")}, "parameters.pooling"),
    "int datatype": ({"_": set_param("datatype", string_param="INT8")}, "parameters.datatype"),
    "layer out of range": ({"a": add_output("attention"), "b": set_param("attention_layers", string_param="0,2")},
                           "attention_layers[1]"),
    "layers without attention": ({"_": set_param("attention_layers", int64_param=0)}, "parameters.attention_layers"),
    "attention over budget": ({"a": add_output("attention"),
                               "b": lambda r: r.parameters["attention_datatype"].MergeFrom(
                                   v2.InferParameter(string_param="FP32"))}, "attention"),
}


@pytest.mark.parametrize("case", BAD)
async def test_bad_requests_are_invalid_argument_naming_the_tensor(start_server, case):
    # One 2 x 3 request's attention, all layers and heads in fp32, is 2*2*4*9*4 = 576 bytes: over.
    s = await start_server(max_attention_bytes=575)
    changes, field = BAD[case]
    request = request_with(**changes)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(s.channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(field + ":"), info.value.details()
    # Counted before the status is sent (attention_requests_total is counted after: it could race the assert).
    assert s.sample("attention_failures_total", {"reason": "invalid_argument"}) == 1
    assert s.sample("attention_batch_size_count") == 0  # nothing reached a batch


async def test_other_refusals_have_their_codes(start_server):
    s = await start_server(max_queue_requests=1, allow_attention=False)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(s.channel)
    cases = [
        (request_with(), grpc.StatusCode.RESOURCE_EXHAUSTED),  # two rows, a queue of one
        (request_with(_=add_output("attention")), grpc.StatusCode.FAILED_PRECONDITION),
        (v2.ModelInferRequest(model_name=MODEL, inputs=[v2.ModelInferRequest.InferInputTensor(
            name="text", datatype="BYTES", shape=[1], contents=v2.InferTensorContents(bytes_contents=[b"hi"]))]),
         grpc.StatusCode.INVALID_ARGUMENT),  # no tokenizer in this bundle: as attention.v1 answers text
    ]
    for request, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(request, timeout=10)
        assert info.value.code() == code, info.value.details()
    raw = s.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw(b"\xff\xff\xff garbage", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid inference.ModelInferRequest" in info.value.details()
    assert s.sample("attention_failures_total", {"reason": "queue_full"}) == 1
    assert s.sample("attention_requests_total", {"method": "ModelInfer", "code": "UNKNOWN"}) == 0
    # With attention off, the metadata (which perf_analyzer requests every output of) leaves it out.
    meta = await stub.ModelMetadata(v2.ModelMetadataRequest(name=MODEL), timeout=10)
    assert [t.name for t in meta.outputs] == ["last_hidden_state", "pooled"]


async def test_deadline_cancellation_and_not_ready_hold_as_for_v1(start_server, fault_bundle, fault_state):  # noqa: F811
    s = await start_server(bundle=fault_bundle, model_workers=1)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        holder = asyncio.ensure_future(s.stub.Encode(ids_request([faults.HANG]), timeout=30))
        assert await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("fault-model", inputs(np.ones((1, 3), np.int64)), client_timeout=0.2)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        await wait_for(lambda: s.sample("attention_requests_total", {
            "method": "ModelInfer", "code": "DEADLINE_EXCEEDED"}) == 1, 10, "the expired call answered")
        await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) + s.sample(
            "attention_dropped_total", {"reason": "deadline"}) == 1, 10, "the expired sequence dropped")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(s.channel)
        call = stub.ModelInfer(request_with(model_name="fault-model"), timeout=30)
        await wait_for(lambda: s.sample("attention_queue_depth") == 2, 10, "the call's two rows queued")
        call.cancel()
        await wait_for(lambda: s.sample("attention_requests_total", {
            "method": "ModelInfer", "code": "CANCELLED"}) == 1, 10, "the cancelled call counted")
        await wait_for(lambda: s.sample("attention_dropped_total", {"reason": "cancelled"}) + s.sample(
            "attention_dropped_total", {"reason": "deadline"}) == 3, 10, "its two rows dropped too")
        faults.HANG_RELEASE.set()
        await holder
        assert s.sample("attention_batch_size_count") == 1  # only the holder's batch ran
    finally:
        await client.close()
    late = await start_server(wait_ready=False, bundle=fault_bundle, allow_fault_hooks=True,
                              fault_delay_before_ready_ms=30_000)
    client = triton_aio.InferenceServerClient(late.target)
    try:
        assert await client.is_server_live() and not await client.is_server_ready()
        assert not await client.is_model_ready("fault-model")
        with pytest.raises(InferenceServerException) as info:
            await client.infer("fault-model", inputs(np.ones((1, 3), np.int64)))
        assert info.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        await client.close()


async def test_v2_calls_are_counted_in_both_metric_families(served: Running, aio: Any):
    await aio.is_server_live()
    await aio.get_model_metadata(MODEL)
    await aio.infer(MODEL, inputs(np.ones((2, 3), np.int64)))
    for method in ("ServerLive", "ModelMetadata", "ModelInfer"):
        assert served.sample("attention_requests_total", {"method": method, "code": "OK"}) == 1
        assert served.sample("grpc_server_handled_total", {
            "grpc_type": "unary", "grpc_service": "inference.GRPCInferenceService", "grpc_method": method,
            "grpc_code": "OK"}) == 1
    assert served.sample("attention_sequences_total") == 2


async def test_stream_answers_every_request_and_goes_on_after_a_failure(served: Running, aio: Any, reference_model):
    ids, mask = ragged([5, 2], seed=4)
    bad = np.full((1, 2), 100, np.int64)  # id over vocab

    async def requests() -> Any:
        for i, (x, m) in enumerate([(ids, mask), (bad, None), (ids[:1, :5], None)]):
            yield {"model_name": MODEL, "inputs": inputs(x, m), "request_id": f"r{i}",
                   "outputs": outputs("last_hidden_state")}

    answers: dict[str, Any] = {}
    async for result, error in aio.stream_infer(requests()):
        if error is not None:
            answers["error"] = error
        else:
            answers[result.get_response().id] = result
        if len(answers) == 3:
            break
    assert set(answers) == {"r0", "r2", "error"}
    assert answers["error"].message() == "[StatusCode.INVALID_ARGUMENT] input_ids[0, 0]: id 100 not in [0, 100)"
    for i, n in enumerate([5, 2]):
        np.testing.assert_allclose(answers["r0"].as_numpy("last_hidden_state")[i, :n],
                                   reference_model(ids[i, :n])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(answers["r2"].as_numpy("last_hidden_state")[0], reference_model(ids[0, :5])[0],
                               atol=1e-5, rtol=0)
    assert served.sample("attention_requests_total", {"method": "ModelStreamInfer", "code": "OK"}) == 2
    assert served.sample("attention_requests_total", {"method": "ModelStreamInfer", "code": "INVALID_ARGUMENT"}) == 1

    # The sync client's stream: results arrive on its callback thread.
    sync = triton.InferenceServerClient(served.target)
    got: list[Any] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def callback(result: Any, error: Any) -> None:
        got.append((result, error))
        loop.call_soon_threadsafe(done.set)

    try:
        await asyncio.to_thread(sync.start_stream, callback)
        await asyncio.to_thread(sync.async_stream_infer, MODEL, inputs(ids, mask), request_id="sync")
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await asyncio.to_thread(sync.stop_stream)
        sync.close()
    (result, error), = got
    assert error is None and result.get_response().id == "sync"
    np.testing.assert_allclose(result.as_numpy("pooled")[1], reference_model(ids[1, :2])[0].mean(axis=0),
                               atol=1e-5, rtol=0)


async def test_model_failures_are_internal_with_a_ref_and_nothing_leaked(start_server, fault_bundle, fault_state):  # noqa: F811
    s = await start_server(bundle=fault_bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        for sentinel, text in ((faults.NAN_ALWAYS, "non-finite model output (ref="),
                               (faults.RAISE, "inference failed (ref=")):
            with pytest.raises(InferenceServerException) as info:
                await client.infer("fault-model", inputs(np.array([[1, sentinel, 2]], np.int64)))
            assert info.value.status() == "StatusCode.INTERNAL" and info.value.message().startswith(text)
            assert "fault-model" not in info.value.message() and "Traceback" not in info.value.message()
        ok = await client.infer("fault-model", inputs(np.array([[1, 2, 3]], np.int64)))  # still serving
        assert ok.as_numpy("pooled").shape == (1, D)
        assert s.sample("attention_nonfinite_outputs_total", {"precision": "fp32"}) == 1
    finally:
        await client.close()


async def test_ready_turns_false_when_a_shutdown_starts_while_calls_are_still_served(start_server):
    s = await start_server(drain_delay_s=30)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        assert await client.is_server_ready() and await client.is_model_ready(MODEL)
        stopping = asyncio.create_task(s.server.stop(1))  # readiness off, then a 30 s drain delay
        await wait_for(lambda: s.sample("attention_ready") == 0, 10, "shutdown to start")
        assert not await client.is_server_ready() and not await client.is_model_ready(MODEL)
        assert await client.is_server_live()
        result = await client.infer(MODEL, inputs(np.ones((1, 3), np.int64)))  # still served in the delay
        assert result.as_numpy("pooled").shape == (1, D)
        stopping.cancel()
    finally:
        await client.close()


async def test_all_zero_token_type_ids_are_accepted_and_change_nothing(served: Running, aio: Any, reference_model):
    ids, mask = ragged([4, 6], seed=5)
    tensors = inputs(ids, mask, "INT32")
    types = triton.InferInput("token_type_ids", list(ids.shape), "INT32")
    types.set_data_from_numpy(np.zeros(ids.shape, np.int32))
    result = await aio.infer(MODEL, [*tensors, types], outputs=outputs("pooled"))
    for i, n in enumerate([4, 6]):
        np.testing.assert_allclose(result.as_numpy("pooled")[i], reference_model(ids[i, :n])[0].mean(axis=0),
                                   atol=1e-5, rtol=0)
    book = ledger(served.registry)  # the exit ledger counts the v2 calls too
    assert book["started"] == sum(book["handled"].values()) >= 1 and book["batched_sequences"] == 2


@pytest.fixture(scope="module")
def loud_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pre-LN without a final LayerNorm and token embeddings scaled by 1e5: hidden states beyond
    FP16's 65504 from ordinary token ids (the v2 door takes no embeddings)."""
    path = tmp_path_factory.mktemp("bundles") / "loud"
    encoder = Encoder(dataclasses.replace(TINY, norm_first=True, final_norm=False)).init_weights(0)
    with torch.no_grad():
        encoder.tok_emb.weight.mul_(1e5)
    save_bundle(encoder, path, name="loud", version="1", source="seed:0 x1e5")
    return path


async def test_a_result_fp16_cannot_hold_is_refused_naming_the_tensor(start_server, loud_bundle: Path):
    s = await start_server(bundle=loud_bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        ids = inputs(np.array([[1, 2, 3, 4]], np.int64))
        exact = await client.infer("loud", ids, outputs=outputs("last_hidden_state"))
        hidden = exact.as_numpy("last_hidden_state")
        assert np.isfinite(hidden).all() and np.abs(hidden).max() > 65504
        with pytest.raises(InferenceServerException) as info:
            await client.infer("loud", ids, outputs=outputs("last_hidden_state"), parameters={"datatype": "FP16"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message().startswith("last_hidden_state: FLOAT16 cannot hold this result"), \
            info.value.message()
        wide = await client.infer("loud", ids, outputs=outputs("last_hidden_state"), parameters={"datatype": "BF16"})
        assert np.isfinite(wide.as_numpy("last_hidden_state").astype(np.float32)).all()
        assert s.sample("attention_failures_total", {"reason": "output_overflow"}) == 1
    finally:
        await client.close()
