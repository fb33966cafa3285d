"""Reliability, round three (issue 27): work before limits and values converted outside validation.

- a KServe `text` BYTES tensor of millions of tiny strings is refused by its count before any string
  is decoded (memory bounded, health answered meanwhile);
- `long_inputs=CHUNK` with `chunk_stride=1` on a long input is refused by arithmetic before any window
  is planned, on both gRPC doors (memory bounded, health answered meanwhile);
- KServe `attention_layers` outside int32 is INVALID_ARGUMENT naming the parameter, never INTERNAL;
- long ids and prompt names are not echoed back; `prompt_name` on an id call is refused on both doors.
Real servers: a process (its RSS is what is measured) or in-process on 127.0.0.1:0.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2 as v2
from tritonclient.grpc import service_pb2_grpc

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import to_tensor
from tests.support.helpers import Running, details_of, health, ids_request
from tests.support.server_process import ServerProcess

BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
RSS_BOUND = 100 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def violation(error: grpc.aio.AioRpcError) -> str:
    from google.rpc import error_details_pb2

    for detail in details_of(error):
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return bad.field_violations[0].field
    return ""


async def refused_while_healthy(channel: grpc.aio.Channel, call: Any) -> grpc.aio.AioRpcError:
    """Send `call` and, while the server handles it, a health Check that must be answered within 1 s."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.05)  # the big message is on its way
    assert await health(channel, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await task
    return info.value


@pytest.fixture(scope="module")
def text_server(tiny_text_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = ServerProcess(tiny_text_bundle, directory=tmp_path_factory.mktemp("round3-text"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ids_server(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = ServerProcess(tiny_bundle, directory=tmp_path_factory.mktemp("round3-ids"))
    yield server
    server.stop()


async def test_a_bytes_tensor_of_millions_of_strings_is_refused_by_its_count(text_server: ServerProcess):
    count = 2_000_000
    raw = (struct.pack("<I", 1) + b"a") * count  # 10 MB: two million one-character strings
    request = v2.ModelInferRequest(model_name="tiny-bert", inputs=[
        v2.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[count])],
        raw_input_contents=[raw])
    async with grpc.aio.insecure_channel(text_server.target, options=BIG) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        before = rss(text_server.pid)
        for _ in range(3):  # the old decoder kept most of its memory: three calls grew RSS by GBs
            error = await refused_while_healthy(channel, stub.ModelInfer(request, timeout=60))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert "must hold 1..64 sequences; got 2000000" in (error.details() or "")
            assert violation(error) == "text"
        grown = rss(text_server.pid) - before
        assert grown < RSS_BOUND, f"RSS grew {grown / 2**20:.0f} MB refusing three calls"


async def test_a_bytes_tensor_over_the_character_limit_is_refused_before_decoding(text_server: ServerProcess):
    raw = struct.pack("<I", 5_000_000) + b"a" * 5_000_000  # one text of 5 M characters; the limit is 1 Mi
    request = v2.ModelInferRequest(model_name="tiny-bert", inputs=[
        v2.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])], raw_input_contents=[raw])
    async with grpc.aio.insecure_channel(text_server.target, options=BIG) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters per call" in (info.value.details() or "") and violation(info.value) == "text"


async def test_a_chunk_bomb_is_refused_by_arithmetic_on_both_doors(ids_server: ServerProcess):
    tokens = 4_000_000  # 16 MB of int32 ids; stride 1 would be four million windows
    ids = (np.arange(tokens) % 90 + 1).astype(np.int32)
    v1 = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=to_tensor(ids))], long_inputs=pb.LONG_INPUTS_CHUNK,
                          chunk_stride=1)
    kserve = v2.ModelInferRequest(model_name="tiny", inputs=[
        v2.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT32", shape=[1, tokens])],
        raw_input_contents=[ids.tobytes()])
    kserve.parameters["long_inputs"].string_param = "chunk"
    kserve.parameters["chunk_stride"].int64_param = 1
    async with grpc.aio.insecure_channel(ids_server.target, options=BIG) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        before = rss(ids_server.pid)
        error = await refused_while_healthy(channel, stub.Encode(v1, timeout=60))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "tokens in all (the windows of chunked sequences counted); at most 32768" in (error.details() or "")
        assert violation(error) == "sequences"
        grown = rss(ids_server.pid) - before
        assert grown < RSS_BOUND, f"RSS grew {grown / 2**20:.0f} MB refusing a 16 MB chunk bomb (attention.v1)"
        triton = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        before = rss(ids_server.pid)
        error = await refused_while_healthy(channel, triton.ModelInfer(kserve, timeout=60))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "at most 32768" in (error.details() or "") and violation(error) == "input_ids"
        grown = rss(ids_server.pid) - before
        assert grown < RSS_BOUND, f"RSS grew {grown / 2**20:.0f} MB refusing a 16 MB chunk bomb (KServe)"
        # And the service still computes.
        response = await stub.Encode(ids_request(np.arange(1, 9)), timeout=30)
        assert response.outputs[0].token_count == 8


@pytest.mark.parametrize("value", [{"int64_param": 2**62}, {"string_param": "99999999999999999999"},
                                   {"string_param": "0," + "9" * 30}])
async def test_kserve_attention_layers_outside_int32_is_invalid_argument(served: Running, value: dict[str, Any]):
    request = v2.ModelInferRequest(model_name="tiny", inputs=[
        v2.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=[1, 3])],
        raw_input_contents=[np.array([[1, 2, 3]], np.int64).tobytes()],
        outputs=[v2.ModelInferRequest.InferRequestedOutputTensor(name="attention")])
    for key, v in value.items():
        setattr(request.parameters["attention_layers"], key, v)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(served.channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "attention_layers" in violation(info.value)
    assert served.sample("attention_failures_total", {"reason": "internal"}) == 0


async def test_long_ids_are_not_echoed_back_in_streams(served: Running):
    long_id = "x" * 100_000
    stub = attention_pb2_grpc.AttentionServiceStub(served.channel)

    async def one_request() -> Any:
        yield ids_request(np.array([1, 2]), request_id=long_id)

    responses = [r async for r in stub.EncodeStream(one_request(), timeout=10)]
    assert len(responses) == 1 and responses[0].error.code == "INVALID_ARGUMENT"
    assert responses[0].request_id == "" and long_id not in str(responses[0])
    triton = service_pb2_grpc.GRPCInferenceServiceStub(served.channel)

    async def one_infer() -> Any:
        yield v2.ModelInferRequest(model_name="tiny", id=long_id, inputs=[
            v2.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=[1, 2])],
            raw_input_contents=[np.array([[1, 2]], np.int64).tobytes()])

    answers = [r async for r in triton.ModelStreamInfer(one_infer(), timeout=10)]
    assert len(answers) == 1 and answers[0].error_message.startswith("[StatusCode.INVALID_ARGUMENT]")
    assert answers[0].infer_response.id == "" and long_id not in answers[0].error_message


async def test_prompt_names_are_not_echoed_and_are_refused_on_id_calls(served: Running, start_server: Any,
                                                                       tiny_text_bundle: Path):
    text = await start_server(bundle=tiny_text_bundle)
    name = "p" * 5000
    stub = attention_pb2_grpc.AttentionServiceStub(text.channel)
    request = pb.EncodeRequest(sequences=[pb.Sequence(text="hello")], output=pb.OutputOptions(prompt_name=name))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name[:100] not in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(pb.TokenizeRequest(texts=["hello"], prompt_name=name), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name[:100] not in (info.value.details() or "")
    # KServe: prompt_name on an id call is refused, as attention.v1 refuses it.
    request = v2.ModelInferRequest(model_name="tiny", inputs=[
        v2.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=[1, 2])],
        raw_input_contents=[np.array([[1, 2]], np.int64).tobytes()])
    request.parameters["prompt_name"].string_param = "query"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await service_pb2_grpc.GRPCInferenceServiceStub(served.channel).ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violation(info.value) == "parameters.prompt_name"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await attention_pb2_grpc.AttentionServiceStub(served.channel).Encode(
            ids_request(np.array([1, 2]), output=pb.OutputOptions(prompt_name="query")), timeout=10)
    assert violation(info.value) == "output.prompt_name"
