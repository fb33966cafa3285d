"""Fuzzing the wire (RELIABILITY.md F-01, F-02, C-04): hypothesis over request messages and over raw
bytes, against a real `python -m service` process, with bounded example counts.

Only the documented codes may come back, never UNKNOWN or INTERNAL, every status passes the hygiene
rule, every OK answer is finite and shaped like its request, and the server is healthy afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import SERVICE_NAME, from_tensor, to_tensor
from tests.support.helpers import ids_request
from tests.support.reliability_helpers import assert_clean_status, byte_mutations
from tests.support.server_process import ServerProcess

Code = grpc.StatusCode
# NOT_FOUND: bytes that parse as EncodeRequest.model name a model this service does not serve.
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED, Code.NOT_FOUND}
FUZZ = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
D_MODEL, VOCAB, MAX_LENGTH = 32, 100, 64  # the TINY model's


@pytest.fixture(scope="module")
def fuzz_server(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_bundle, "--max-attention-bytes", "200000", "--max-message-bytes", str(1 << 20),
                           directory=tmp_path_factory.mktemp("fuzz-server"))
    yield server
    server.kill()


@pytest.fixture(scope="module")
def channel(fuzz_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzz_server.target) as ch:
        yield ch


def check(channel: grpc.Channel, request: bytes, want: pb.EncodeRequest | None = None) -> Code:
    encode = channel.unary_unary(f"/{SERVICE_NAME}/Encode")  # raw bytes in and out
    try:
        raw = encode(request, timeout=10)
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, (error.code(), error.details(), request[:200])  # type: ignore[attr-defined]
        secrets = [want.request_id] if want is not None and len(want.request_id) >= 12 else []
        assert_clean_status(error, secrets=secrets)
        return error.code()  # type: ignore[attr-defined, no-any-return]
    response = pb.EncodeResponse.FromString(raw)
    if want is not None:
        assert len(response.outputs) == len(want.sequences) and response.request_id == want.request_id
    for out in response.outputs:
        for tensor in (out.hidden, out.pooled, out.attention):
            if tensor.data:
                assert np.isfinite(from_tensor(tensor)).all()
    return Code.OK


# -- request messages ------------------------------------------------------------------------------

def choose(draw: st.DrawFn, usual: st.SearchStrategy, rare: st.SearchStrategy, p_rare: int = 2) -> st.SearchStrategy:
    """Mostly `usual` (valid), sometimes (`p_rare` in 10) `rare`, so that both paths are exercised.
    (Not `integers(0, 9) < p`: hypothesis favours small integers, so "rare" would be common.)"""
    return rare if draw(st.sampled_from([False] * (10 - p_rare) + [True] * p_rare)) else usual


def often(draw: st.DrawFn, usual: st.SearchStrategy, rare: st.SearchStrategy, p_rare: int = 2) -> Any:
    return draw(choose(draw, usual, rare, p_rare))


any_enum = st.integers(-3, 2**31 - 1)
float_dtypes = st.sampled_from([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16])
moderate = st.floats(-1e4, 1e4, width=32) | st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0])


@st.composite
def tensors(draw: st.DrawFn, kind: str) -> pb.Tensor:
    if often(draw, st.just(False), st.just(True), 1):  # anything at all
        return pb.Tensor(dtype=draw(any_enum), shape=draw(st.lists(st.integers(-2, 70), max_size=3)),
                         data=draw(st.binary(max_size=300)))
    length = often(draw, st.integers(1, MAX_LENGTH), st.integers(0, MAX_LENGTH + 3))
    if kind == "token_ids":
        token = choose(draw, st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3), 1)
        values = draw(st.lists(token, min_size=length, max_size=length))
        return to_tensor(np.array(values, np.int64), draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_INT64])))
    width = often(draw, st.just(D_MODEL), st.sampled_from([D_MODEL - 1, 1]), 1)
    finite = st.floats(-10, 10, width=32)
    values = draw(st.lists(choose(draw, finite, moderate, 1),
                           min_size=length * width, max_size=length * width))
    dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16]))
    return to_tensor(np.array(values, np.float32).reshape(length, width), dtype)


@st.composite
def sequences(draw: st.DrawFn) -> pb.Sequence:
    which = often(draw, st.sampled_from(["token_ids", "token_ids", "embeddings"]), st.just("none"), 1)
    return pb.Sequence() if which == "none" else pb.Sequence(**{which: draw(tensors(which))})


@st.composite
def requests(draw: st.DrawFn) -> pb.EncodeRequest:
    many = often(draw, st.just(False), st.just(True), 1)  # now and then, at or over the 64-per-call limit
    seqs = draw(st.lists(sequences(), min_size=63 if many else 1, max_size=66 if many else 4))
    if often(draw, st.just(False), st.just(True), 1):
        seqs = seqs[:0]
    output = pb.OutputOptions(pooling=often(draw, st.integers(0, 2), any_enum, 1),
                              dtype=often(draw, float_dtypes, any_enum, 1))
    if draw(st.booleans()):
        output.return_hidden = draw(st.booleans())
    attention = pb.AttentionOptions()
    if often(draw, st.just(False), st.just(True), 3):
        attention = pb.AttentionOptions(return_attention=True, heads=often(draw, st.integers(0, 1), any_enum, 1),
                                        dtype=often(draw, float_dtypes, any_enum, 1),
                                        layers=draw(st.lists(st.integers(-3, 2), max_size=3)))
    elif often(draw, st.just(False), st.just(True), 1):
        attention.layers.append(draw(st.integers(-3, 2)))  # layers without return_attention
    request_id = often(draw, st.text(max_size=40), st.text(min_size=120, max_size=140), 1)
    return pb.EncodeRequest(request_id=request_id, sequences=seqs, output=output, attention=attention,
                            causal=draw(st.booleans()))


@settings(max_examples=150, **FUZZ)
@given(request=requests())
def test_fuzzed_requests_get_only_documented_codes(channel: grpc.Channel, request: pb.EncodeRequest):
    check(channel, request.SerializeToString(), request)


# -- raw bytes -------------------------------------------------------------------------------------

SEED = ids_request(np.arange(1, 40), np.arange(5, 9), request_id="seed-request-0001",
                   output=pb.OutputOptions(pooling=pb.POOLING_MEAN),
                   attention=pb.AttentionOptions(return_attention=True, layers=[-1])).SerializeToString()




@settings(max_examples=400, **FUZZ)
@given(raw=byte_mutations(SEED, random_max=2048))
def test_fuzzed_bytes_get_only_documented_codes(channel: grpc.Channel, raw: bytes):
    check(channel, raw)


def test_the_server_is_healthy_and_never_said_unknown_after_fuzzing(channel: grpc.Channel,
                                                                     fuzz_server: ServerProcess):
    """After fuzzing (its own burst, so it holds alone and in any order; the fuzz tests above add theirs
    when they ran first): same process, no restart, nothing UNKNOWN or INTERNAL."""
    rng = random.Random(0)
    valid = ids_request([1, 2, 3], [4, 5], request_id="fuzz").SerializeToString()
    for _ in range(150):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        check(channel, bytes(data[: rng.randint(0, len(data))]))
    assert fuzz_server.proc.poll() is None
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = attention_pb2_grpc.AttentionServiceStub(channel)
    assert len(stub.Encode(ids_request([1, 2, 3]), timeout=10).outputs) == 1
    assert fuzz_server.started() > 100
    assert fuzz_server.sample("grpc_server_handled_total", {"grpc_code": "UNKNOWN"}) == 0
    assert fuzz_server.sample("grpc_server_handled_total", {"grpc_code": "INTERNAL"}) == 0
    assert fuzz_server.sample("attention_queue_depth") == 0


def test_huge_finite_embeddings_are_invalid_argument_not_internal(channel: grpc.Channel):
    embeddings = np.full((3, D_MODEL), 1e30, np.float32)
    request = pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(embeddings))])
    with pytest.raises(grpc.RpcError) as info:
        pb.EncodeResponse.FromString(channel.unary_unary(f"/{SERVICE_NAME}/Encode")(
            request.SerializeToString(), timeout=10))
    assert info.value.code() == Code.INVALID_ARGUMENT  # type: ignore[attr-defined]
