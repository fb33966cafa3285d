"""Fuzzing the KServe v2 front door: hypothesis over ModelInferRequest messages and over raw bytes,
against a real `python -m service` process, with bounded example counts. Only documented codes come
back (never UNKNOWN or INTERNAL), every status passes the hygiene rule, every OK answer is finite and
shaped like its request, and the server is healthy afterwards."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as v2

from service.doors.kserve.grpc_door import SERVICE_NAME
from tests.support.reliability_helpers import assert_clean_status, byte_mutations
from tests.support.server_process import ServerProcess

Code = grpc.StatusCode
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED, Code.NOT_FOUND}
FUZZ = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
D_MODEL, VOCAB = 32, 100  # the TINY model's
Tensor = v2.ModelInferRequest.InferInputTensor


@pytest.fixture(scope="module")
def server(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tiny_bundle, "--max-attention-bytes", "200000", "--max-message-bytes", str(1 << 20),
                            directory=tmp_path_factory.mktemp("kserve-fuzz"))
    yield process
    process.kill()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def check(channel: grpc.Channel, raw: bytes, want: v2.ModelInferRequest | None = None) -> None:
    infer = channel.unary_unary(f"/{SERVICE_NAME}/ModelInfer")  # raw bytes in and out
    try:
        answer = infer(raw, timeout=10)
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, (error.code(), error.details())  # type: ignore[attr-defined]
        assert_clean_status(error)
        return
    response = v2.ModelInferResponse.FromString(answer)
    assert len(response.outputs) == len(response.raw_output_contents) >= 1
    for output, data in zip(response.outputs, response.raw_output_contents, strict=True):
        dtype = {"FP32": "<f4", "FP16": "<f2", "BF16": "<u2"}[output.datatype]
        values = np.frombuffer(data, dtype).reshape(output.shape)
        if output.datatype != "BF16":
            assert np.isfinite(values).all()
        if want is not None:
            assert output.shape[0] == want.inputs[0].shape[0]


def choose(draw: st.DrawFn, usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `usual` (valid), 1 in 10 `rare` (a request makes a dozen such choices)."""
    return rare if draw(st.sampled_from([False] * 9 + [True])) else usual


def pick(draw: st.DrawFn, usual: st.SearchStrategy, rare: st.SearchStrategy) -> Any:
    return draw(choose(draw, usual, rare))


@st.composite
def requests(draw: st.DrawFn) -> v2.ModelInferRequest:
    batch = pick(draw, st.integers(1, 4), st.integers(0, 70))
    T = pick(draw, st.integers(1, 16), st.integers(0, 70))
    datatype = pick(draw, st.sampled_from(["INT32", "INT64"]), st.sampled_from(["FP32", "BYTES", "", "INT8"]))
    request = v2.ModelInferRequest(model_name=pick(draw, st.just("tiny"), st.text(max_size=20)),
                                   model_version=pick(draw, st.sampled_from(["", "1"]), st.text(max_size=5)))
    ids = np.array(draw(st.lists(choose(draw, st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3)),
                                 min_size=batch * T, max_size=batch * T)), np.int64)
    lengths = draw(st.lists(choose(draw, st.integers(min(1, T), T), st.integers(0, T)), min_size=batch,
                            max_size=batch))
    mask = (np.arange(T)[None, :] < np.array(lengths, np.int64).reshape(batch, 1)).astype(np.int64)
    if pick(draw, st.just(False), st.just(True)):
        mask = np.array(draw(st.lists(st.integers(-1, 2), min_size=batch * T, max_size=batch * T)), np.int64)
    names = pick(draw, st.just(["input_ids", "attention_mask"]),
                 st.lists(st.sampled_from(["input_ids", "attention_mask", "token_type_ids", "text", "x"]),
                          max_size=3))
    itemsize = 4 if datatype == "INT32" else 8
    for name in names:
        array = ids if name == "input_ids" else mask if name == "attention_mask" else np.zeros(batch * T, np.int64)
        shape = pick(draw, st.just([batch, T]), st.lists(st.integers(-1, 5), max_size=3))
        request.inputs.append(Tensor(name=name, datatype=datatype, shape=shape))
        data = array.astype(np.int32 if itemsize == 4 else np.int64).tobytes()
        request.raw_input_contents.append(pick(draw, st.just(data), st.binary(max_size=64)))
    known = st.sampled_from(["last_hidden_state", "pooled", "embeddings", "attention"])
    for name in draw(st.lists(choose(draw, known, known | st.just("y")), max_size=3)):
        output = request.outputs.add(name=name)
        if draw(st.booleans()):
            output.parameters["datatype"].string_param = pick(draw, st.sampled_from(["FP16", "BF16", "FP32"]),
                                                              st.just("int"))

    def one_of(usual: list[str], rare: list[str]) -> v2.InferParameter:
        return v2.InferParameter(string_param=pick(draw, st.sampled_from(usual), st.sampled_from(rare)))

    params = {"pooling": one_of(["mean", "cls"], ["max"]),
              "attention_layers": one_of(["-1", "0,1", "0"], ["1,1", "x", "9"]),
              "attention_heads": one_of(["all", "mean"], [""]),
              "datatype": one_of(["FP16", "FP32", "BF16"], ["INT64"]),
              "timeout": v2.InferParameter(int64_param=pick(draw, st.sampled_from([0, 5 * 10**6]), st.just(-1))),
              "bogus": v2.InferParameter(bool_param=True)}
    names = choose(draw, st.sampled_from(sorted(set(params) - {"bogus"})), st.sampled_from(sorted(params)))
    for name in draw(st.lists(names, max_size=3, unique=True)):
        request.parameters[name].CopyFrom(params[name])
    return request


@settings(max_examples=200, **FUZZ)
@given(request=requests())
def test_fuzzed_v2_requests_get_only_documented_codes(channel: grpc.Channel, request: v2.ModelInferRequest):
    check(channel, request.SerializeToString(), request)


SEED = v2.ModelInferRequest(model_name="tiny", id="seed", inputs=[Tensor(name="input_ids", datatype="INT64",
                                                                         shape=[2, 3])],
                            raw_input_contents=[np.arange(1, 7, dtype=np.int64).tobytes()]).SerializeToString()




@settings(max_examples=300, **FUZZ)
@given(raw=byte_mutations(SEED, random_max=1024))
def test_fuzzed_v2_bytes_get_only_documented_codes(channel: grpc.Channel, raw: bytes):
    check(channel, raw)


def test_the_server_never_said_unknown_or_internal_after_fuzzing(channel: grpc.Channel, server: ServerProcess):
    """Its own burst (so it holds alone and in any order; the fuzz tests above add theirs when they ran
    first), valid requests among them: same process, no restart, nothing UNKNOWN or INTERNAL."""
    rng = random.Random(0)
    for _ in range(150):
        data = bytearray(SEED)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        check(channel, bytes(data[: rng.randint(0, len(data))]))
    for batch, T in ((1, 1), (2, 5), (4, 16), (64, 2)):
        ids = np.arange(batch * T, dtype=np.int64).reshape(batch, T) % VOCAB
        request = v2.ModelInferRequest(model_name="tiny", inputs=[Tensor(name="input_ids", datatype="INT64",
                                                                         shape=[batch, T])],
                                       raw_input_contents=[ids.tobytes()])
        check(channel, request.SerializeToString(), request)
    assert server.proc.poll() is None
    assert server.sample("grpc_server_handled_total", {"grpc_service": SERVICE_NAME}) >= 154
    assert server.sample("grpc_server_handled_total", {"grpc_service": SERVICE_NAME, "grpc_code": "OK"}) >= 4
    assert server.sample("grpc_server_handled_total", {"grpc_code": "UNKNOWN"}) == 0
    assert server.sample("grpc_server_handled_total", {"grpc_code": "INTERNAL"}) == 0
    assert server.sample("attention_queue_depth") == 0
