"""The one call path (service/doors/calls.py `Calls.run`), door by door: every door that takes embeddings counts
a non-finite one, every door that sends 16-bit floats refuses a result its dtype cannot hold, and every door
answers a non-finite model output as its wire's internal error, counted once, the server serving on. Real
servers on 127.0.0.1, real clients of each wire (grpc stubs, tritonclient over gRPC and HTTP, httpx)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http.aio as http_aio
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from model import faults
from model.bundle import save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import to_tensor
from tests.support.helpers import Running, ids_request

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def loud_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pre-LN without a final LayerNorm and token embeddings of magnitude ~1e5: from ids alone, hidden states
    past FLOAT16's 65504 (finite in float32)."""
    path = tmp_path_factory.mktemp("bundles") / "loud"
    encoder = Encoder(dataclasses.replace(TINY, norm_first=True, final_norm=False)).init_weights(0)
    with torch.no_grad():
        encoder.tok_emb.weight.mul_(1e5 / encoder.tok_emb.weight.abs().max())
    save_bundle(encoder, path, name="loud", version="1", source="seed:0 x1e5")
    return path


def http(s: Running) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30)


async def stream_one(s: Running, request: pb.EncodeRequest) -> pb.EncodeResponse:
    async def one() -> AsyncIterator[pb.EncodeRequest]:
        yield request

    answers = [r async for r in s.stub.EncodeStream(one(), timeout=30)]
    assert len(answers) == 1
    return answers[0]


def failures(s: Running, reason: str) -> float:
    return s.sample("attention_failures_total", {"reason": reason})


NAN_EMBEDDINGS = np.zeros((3, TINY.d_model), np.float32)
NAN_EMBEDDINGS[1, 2] = np.nan


async def test_every_door_that_takes_embeddings_counts_a_nonfinite_one(start_server: Callable[..., Any]) -> None:
    s = await start_server(http_port=0)
    request = pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(NAN_EMBEDDINGS))])

    async def encode() -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.Encode(request, timeout=30)
        assert info.value.code() == Code.INVALID_ARGUMENT
        return info.value.details() or ""

    async def stream() -> str:
        answer = await stream_one(s, request)
        assert answer.error.code == "INVALID_ARGUMENT"
        return answer.error.message

    async def encode_json() -> str:
        async with http(s) as client:
            r = await client.post("/v1/encode", json=json_format.MessageToDict(request))
        assert r.status_code == 400, r.text
        return str(r.json()["error"]["message"])

    for n, door in enumerate((encode, stream, encode_json), start=1):
        message = await door()
        assert message.startswith("sequences[0].embeddings: ") and "NaN or Inf" in message, (door, message)
        assert s.sample("attention_nonfinite_inputs_total") == n, door
        assert failures(s, "nonfinite_input") == n, door


async def test_every_door_refuses_a_result_its_16_bit_dtype_cannot_hold(
        start_server: Callable[..., Any], loud_bundle: Path) -> None:
    s = await start_server(bundle=loud_bundle, http_port=0)
    ids = np.arange(1, 9)
    loud = await s.stub.Encode(ids_request(ids), timeout=30)  # FLOAT32 holds it
    assert not loud.outputs[0].nonfinite
    half = ids_request(ids, output=pb.OutputOptions(dtype=pb.DTYPE_FLOAT16))

    async def encode() -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.Encode(half, timeout=30)
        assert info.value.code() == Code.INVALID_ARGUMENT
        return info.value.details() or ""

    async def stream() -> str:
        answer = await stream_one(s, half)
        assert answer.error.code == "INVALID_ARGUMENT"
        return answer.error.message

    async def encode_json() -> str:
        async with http(s) as client:
            r = await client.post("/v1/encode", json=json_format.MessageToDict(half))
        assert r.status_code == 400, r.text
        return str(r.json()["error"]["message"])

    def kserve_inputs(module: Any) -> tuple[list[Any], list[Any]]:
        tensor = module.InferInput("input_ids", [1, len(ids)], "INT64")
        tensor.set_data_from_numpy(ids[None].astype(np.int64))
        return [tensor], [module.InferRequestedOutput("last_hidden_state")]

    async def kserve_grpc() -> str:
        client = grpc_aio.InferenceServerClient(s.target)
        try:
            inputs, outputs = kserve_inputs(grpc_aio)
            with pytest.raises(InferenceServerException) as info:
                await client.infer("loud", inputs, outputs=outputs, parameters={"datatype": "FP16"})
        finally:
            await client.close()
        assert "INVALID_ARGUMENT" in str(info.value.status()), info.value
        return str(info.value.message())

    async def kserve_rest() -> str:
        client = http_aio.InferenceServerClient(f"127.0.0.1:{s.server.http_port}")
        try:
            inputs, outputs = kserve_inputs(http_aio)
            with pytest.raises(InferenceServerException) as info:
                await client.infer("loud", inputs, outputs=outputs, parameters={"datatype": "FP16"})
        finally:
            await client.close()
        assert str(info.value.status()) == "400", info.value
        return str(info.value.message())

    for n, door in enumerate((encode, stream, encode_json, kserve_grpc, kserve_rest), start=1):
        message = await door()
        assert "FLOAT16 cannot hold this result" in message and "65504" in message, (door, message)
        assert failures(s, "output_overflow") == n, door
    # The JSON dialects send float32: the same results go out whole.
    async with http(s) as client:
        r = await client.post("/embed_all", json={"inputs": [ids.tolist()]})
        assert r.status_code == 200 and np.abs(np.asarray(r.json()[0])).max() > 65504


async def test_every_door_answers_a_nonfinite_output_as_its_internal_error(
        start_server: Callable[..., Any], fault_bundle: Path) -> None:
    s = await start_server(bundle=fault_bundle, http_port=0, openai_token_ids=True)  # an ids-only model
    ids = [1, 2, faults.NAN_ALWAYS, 3]

    async def encode() -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.Encode(ids_request(np.asarray(ids)), timeout=30)
        return info.value.code().name

    async def kserve_grpc() -> str:
        client = grpc_aio.InferenceServerClient(s.target)
        tensor = grpc_aio.InferInput("input_ids", [1, len(ids)], "INT64")
        tensor.set_data_from_numpy(np.asarray([ids], np.int64))
        try:
            with pytest.raises(InferenceServerException) as info:
                await client.infer("fault-model", [tensor])
        finally:
            await client.close()
        return str(info.value.status()).removeprefix("StatusCode.")

    async def post(path: str, body: Any) -> str:
        async with http(s) as client:
            r = await client.post(path, json=body)
        assert "ref=" in r.text and "Traceback" not in r.text, r.text
        return str(r.status_code)

    doors: list[tuple[Callable[[], Any], str]] = [
        (encode, "INTERNAL"), (kserve_grpc, "INTERNAL"),
        (lambda: post("/v1/embeddings", {"model": "fault-model", "input": [ids]}), "500"),
        (lambda: post("/embed", {"inputs": [ids]}), "424"),
        (lambda: post("/v2/models/fault-model/infer", {"inputs": [
            {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}]}), "500"),
    ]
    for n, (door, code) in enumerate(doors, start=1):
        assert await door() == code, door
        assert failures(s, "nonfinite_output") == n, door
    assert (await s.stub.Encode(ids_request(np.arange(1, 5)), timeout=30)).outputs  # and serves on
