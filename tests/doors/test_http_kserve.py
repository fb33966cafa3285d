"""KServe v2 REST through tritonclient.http (its aio client: the server runs in this test's event loop)
and attention.v1 as JSON on POST /v1/encode: equal to the gRPC doors' answers for the same calls."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http as triton_http
import tritonclient.http.aio as http_aio
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from model import faults
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor, to_tensor
from tests.support.helpers import Running, wait_for

MODEL = "tiny"


def ids_inputs(ids: np.ndarray, mask: np.ndarray, binary: bool, mod: Any = triton_http) -> list[Any]:
    out = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        tensor = mod.InferInput(name, list(array.shape), "INT64")
        if mod is triton_http:
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def ragged() -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int64)
    return ids, (ids != 0).astype(np.int64)


@pytest.fixture
async def served_http(start_server: Any) -> Running:
    return await start_server(http_port=0)


async def grpc_result(s: Running, inputs: list[Any], outputs: list[Any] | None = None, model: str = MODEL) -> Any:
    client = grpc_aio.InferenceServerClient(s.target)
    try:
        return await client.infer(model, inputs, outputs=outputs)
    finally:
        await client.close()


async def test_health_metadata_config_and_stats(served_http: Running) -> None:
    client = http_aio.InferenceServerClient(f"127.0.0.1:{served_http.server.http_port}")
    try:
        assert await client.is_server_live() and await client.is_server_ready()
        assert await client.is_model_ready(MODEL) and await client.is_model_ready(MODEL, "1")
        assert not await client.is_model_ready("other")
        meta = await client.get_server_metadata()
        assert meta["name"] == "attention-service" and "binary_tensor_data" in meta["extensions"]
        model = await client.get_model_metadata(MODEL)
        assert model["name"] == MODEL and model["versions"] == ["1"]
        assert [t["name"] for t in model["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
        assert model["outputs"][0] == {"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, -1, 32]}
        config = await client.get_model_config(MODEL)
        assert config["name"] == MODEL and config["max_batch_size"] == 64
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'other' is not found"):
            await client.get_model_metadata("other")
        with pytest.raises(InferenceServerException, match="unknown model"):
            await client.get_model_metadata(MODEL, "7")
        ids, mask = ragged()
        await client.infer(MODEL, ids_inputs(ids, mask, True, http_aio))
        stats = await client.get_inference_statistics(MODEL)
        assert stats["model_stats"][0]["name"] == MODEL
        assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) == 1
    finally:
        await client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_infer_with_ids_equals_the_grpc_door(served_http: Running, binary: bool) -> None:
    s = served_http
    ids, mask = ragged()
    want = await grpc_result(s, ids_inputs(ids, mask, True, grpc_aio))
    outputs = [triton_http.InferRequestedOutput(name, binary_data=binary) for name in ("last_hidden_state", "pooled")]
    client = http_aio.InferenceServerClient(f"127.0.0.1:{s.server.http_port}")
    try:
        for asked in (outputs, None):  # None: every default output, binary (tritonclient's binary_data_output)
            result = await client.infer(MODEL, ids_inputs(ids, mask, binary, triton_http), outputs=asked,
                                        request_id="r-1")
            for name in ("last_hidden_state", "pooled"):
                got = result.as_numpy(name)
                assert got.dtype == np.float32 and got.shape == want.as_numpy(name).shape
                np.testing.assert_allclose(got, want.as_numpy(name), rtol=0, atol=1e-6)
            response = result.get_response()
            assert response["id"] == "r-1" and response["model_name"] == MODEL
            sent_binary = all("binary_data_size" in o.get("parameters", {}) for o in response["outputs"])
            assert sent_binary == (binary or asked is None)
        fp16 = await client.infer(MODEL, ids_inputs(ids, mask, binary, triton_http), outputs=[
            triton_http.InferRequestedOutput("pooled", binary_data=binary)], parameters={"datatype": "FP16"})
        assert fp16.as_numpy("pooled").dtype == np.float16
        np.testing.assert_allclose(fp16.as_numpy("pooled"), want.as_numpy("pooled"), rtol=0, atol=2e-3)
    finally:
        await client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_infer_with_text_equals_the_grpc_door(start_server: Any, tiny_text_bundle: Path, binary: bool) -> None:
    s = await start_server(bundle=tiny_text_bundle, http_port=0)
    texts = np.array([b"the cat", b"a b c."], dtype=np.object_)
    g = grpc_aio.InferInput("text", [2], "BYTES")
    g.set_data_from_numpy(texts)
    want = await grpc_result(s, [g], model=s.server.serving.spec.name)
    h = triton_http.InferInput("text", [2], "BYTES")
    h.set_data_from_numpy(texts, binary_data=binary)
    client = http_aio.InferenceServerClient(f"127.0.0.1:{s.server.http_port}")
    try:
        result = await client.infer(s.server.serving.spec.name, [h], outputs=[
            triton_http.InferRequestedOutput("pooled", binary_data=binary)])
        np.testing.assert_allclose(result.as_numpy("pooled"), want.as_numpy("pooled"), rtol=0, atol=1e-6)
    finally:
        await client.close()


async def test_infer_errors_are_tritons_json_with_the_tables_status(start_server: Any, fault_bundle: Path) -> None:
    faults.reset()
    s = await start_server(bundle=fault_bundle, http_port=0, model_workers=1)
    base = f"http://127.0.0.1:{s.server.http_port}/v2/models/{s.server.serving.spec.name}"
    ids = {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}
    async with httpx.AsyncClient(timeout=30) as http:
        async def infer(body: Any, status: int, **kwargs: Any) -> dict[str, Any]:
            r = await http.post(base + "/infer", json=body, **kwargs) if body is not None else \
                await http.post(base + "/infer", **kwargs)
            assert r.status_code == status, r.text
            return dict(r.json())

        assert "input_ids" in (await infer({"inputs": [{**ids, "shape": [1, 3]}]}, 400))["error"]
        assert "parameters.sharpness" in (await infer({"inputs": [ids], "parameters": {"sharpness": 1}}, 400))["error"]
        assert (await infer(None, 400, content=b"{", headers={"Inference-Header-Content-Length": "9"}))["error"]
        assert "not valid JSON" in (await infer(None, 400, content=b"\xff\xfe"))["error"]
        r = await http.post(base.replace("/models/", "/models/x") + "/infer", json={"inputs": [ids]})
        assert r.status_code == 404 and "unknown model" in r.json()["error"]
        # A deadline that passes in the queue: the holder hangs the one model thread.
        held = asyncio.ensure_future(http.post(base + "/infer", json={"inputs": [{**ids, "data": [faults.HANG, 1]}]}))
        try:
            await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)
            late = await infer({"inputs": [ids], "parameters": {"timeout": 50_000}}, 504)
            assert "deadline" in late["error"]
        finally:
            faults.HANG_RELEASE.set()
        assert (await held).status_code == 200
    await wait_for(lambda: s.sample("attention_requests_total", {
        "method": "POST /v2/models/{model}/infer", "code": "DEADLINE_EXCEEDED"}) == 1, 10, "the 504 counted")


async def test_attention_v1_json_on_v1_encode_equals_grpc(served_http: Running) -> None:
    s = served_http
    request = pb.EncodeRequest(
        request_id="j-1", sequences=[pb.Sequence(token_ids=to_tensor(np.array([3, 4, 5], np.int64)))],
        output=pb.OutputOptions(pooling=pb.POOLING_MEAN), attention=pb.AttentionOptions(return_attention=True,
                                                                                         layers=[-1]))
    want = await s.stub.Encode(request, timeout=30)
    body = json_format.MessageToDict(request)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}") as http:
        r = await http.post("/v1/encode", json=body)
        assert r.status_code == 200, r.text
        got = json_format.ParseDict(r.json(), pb.EncodeResponse())
        assert got.request_id == "j-1"
        for name in ("hidden", "pooled", "attention"):
            np.testing.assert_allclose(from_tensor(getattr(got.outputs[0], name)),
                                       from_tensor(getattr(want.outputs[0], name)), rtol=0, atol=1e-6)
        assert from_tensor(got.outputs[0].attention).shape == (1, 4, 3, 3)
        assert base64.b64decode(r.json()["outputs"][0]["pooled"]["data"])  # bytes as protobuf's JSON: base64
        bad = await http.post("/v1/encode", json={"sequences": [{"token_ids": {"dtype": "DTYPE_INT64", "shape": [1],
                                                                               "data": "AQAAAAAAAAA="}}],
                                                  "output": {"pooling": "POOLING_NOPE"}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_ARGUMENT"
        wrong = await http.post("/v1/encode", json={"sequences": [{"token_ids": {"dtype": "DTYPE_INT64", "shape": [1],
                                                                                 "data": base64.b64encode(
                                                                                     np.array([500], "<i8").tobytes())
                                                                                 .decode()}}]})
        assert wrong.status_code == 400 and wrong.json()["error"]["field"] == "sequences[0].token_ids[0]"
