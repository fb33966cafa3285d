"""What a call may get back (issue 16, items 4 and 6): a response that would not fit the message limit
is refused before compute, framing included; a result that is not finite in the dtype it is sent in
is never returned.

Real servers on 127.0.0.1:0 serving the TINY bundle (d_model 32, 4 heads, 2 layers, max_length 64).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from model.bundle import save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor, to_tensor
from service.doors.attention_wire import response_bytes
from service.errors import OutputOverflow
from service.jobs import Output
from service.output_range import check_representable
from tests.support.helpers import ids_request, plan_request
from tests.support.reliability_helpers import assert_clean_status, batches

Code = grpc.StatusCode
IDS = np.arange(64) % 100  # 64 tokens: fp32 hidden states are 64 x 32 x 4 = 8192 bytes of data


async def test_a_response_over_the_limit_by_its_framing_alone_is_refused_before_compute(
        start_server: Callable[..., Any]):
    roomy = await start_server()
    size = (await roomy.stub.Encode(ids_request(IDS), timeout=10)).ByteSize()
    assert 8192 < size < 8192 + 1300  # the tensor data, plus tags, lengths and metadata

    # The tensor data fits exactly; the framing does not. Refused up front, not computed and then
    # refused by grpcio at send ("Sent message larger than max", RESOURCE_EXHAUSTED).
    tight = await start_server(max_message_bytes=8192)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tight.stub.Encode(ids_request(IDS), timeout=10)
    assert_clean_status(info.value)
    assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
    assert "over max_message_bytes 8192" in (info.value.details() or "")
    assert batches(tight) == 0

    # Just under: a limit a few bytes above the real size is enough (the estimate is tight). The real
    # size moves by a byte or two with the timings in the metadata (varints).
    fits = await start_server(max_message_bytes=size + 64)
    response = await fits.stub.Encode(ids_request(IDS), timeout=10)
    assert abs(response.ByteSize() - size) <= 8 and batches(fits) == 1


REQUESTS = [
    ids_request(IDS),
    ids_request(IDS, request_id="r" * 128),
    ids_request(IDS[:5], IDS[:64], IDS[:1], request_id="é" * 40),
    ids_request(IDS[:17], output=pb.OutputOptions(pooling=pb.POOLING_MEAN, dtype=pb.DTYPE_FLOAT16)),
    ids_request(IDS[:9], IDS[:3], output=pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_CLS,
                                                          dtype=pb.DTYPE_BFLOAT16)),
    ids_request(IDS[:20], attention=pb.AttentionOptions(return_attention=True, dtype=pb.DTYPE_FLOAT16)),
    ids_request(IDS[:12], IDS[:30], attention=pb.AttentionOptions(return_attention=True, layers=[-1],
                                                                  heads=pb.HEADS_MEAN)),
]


@pytest.mark.parametrize("request_index", range(len(REQUESTS)))
async def test_the_response_size_estimate_bounds_the_real_response_from_above(
        served: Any, request_index: int):
    request = REQUESTS[request_index]
    response = await served.stub.Encode(request, timeout=10)
    spec = served.server.serving.spec
    estimate = response_bytes(plan_request(request, spec, served.server.config), spec).total
    assert response.ByteSize() <= estimate <= response.ByteSize() + 64 * len(request.sequences) + 64


# -- a result the output dtype cannot hold (item 4) ------------------------------------------------


@pytest.fixture(scope="module")
def unnormed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pre-LN without a final LayerNorm: the residual stream, and so the hidden states, keep the
    magnitude of the input embeddings."""
    path = tmp_path_factory.mktemp("bundles") / "unnormed"
    config = dataclasses.replace(TINY, norm_first=True, final_norm=False)
    save_bundle(Encoder(config).init_weights(0), path, name="unnormed", version="1", source="seed:0")
    return path


def embeddings_request(scale: float, **fields: Any) -> pb.EncodeRequest:
    values = np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32)
    values *= scale / np.abs(values).max()  # the largest |value| is `scale`, allowed (<= 1e6)
    return pb.EncodeRequest(sequences=[pb.Sequence(embeddings=to_tensor(values))], **fields)


async def test_a_result_float16_cannot_hold_is_refused_naming_the_dtype_never_sent_as_inf(
        start_server: Callable[..., Any], unnormed_bundle: Path):
    s = await start_server(bundle=unnormed_bundle)
    exact = await s.stub.Encode(embeddings_request(1e5), timeout=10)  # FLOAT32: finite, beyond 65504
    hidden = from_tensor(exact.outputs[0].hidden)
    assert np.isfinite(hidden).all() and np.abs(hidden).max() > 65504

    for options in (pb.OutputOptions(dtype=pb.DTYPE_FLOAT16),
                    pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_CLS, dtype=pb.DTYPE_FLOAT16)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.Encode(embeddings_request(1e5, output=options), timeout=10)
        assert_clean_status(info.value)
        assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
        details = info.value.details() or ""
        assert details.startswith("output.dtype: ") and "65504" in details, details
        assert "FLOAT32" in details and "BFLOAT16" in details, details
    assert s.sample("attention_failures_total", {"reason": "output_overflow"}) == 2

    # The same results in the dtypes that hold them; attention weights (in [0, 1]) always fit FLOAT16.
    wide = await s.stub.Encode(embeddings_request(1e5, output=pb.OutputOptions(dtype=pb.DTYPE_BFLOAT16)), timeout=10)
    np.testing.assert_allclose(from_tensor(wide.outputs[0].hidden), hidden, rtol=1e-2)
    weights = await s.stub.Encode(embeddings_request(1e5, attention=pb.AttentionOptions(
        return_attention=True, dtype=pb.DTYPE_FLOAT16)), timeout=10)
    assert np.isfinite(from_tensor(weights.outputs[0].attention)).all()
    small = await s.stub.Encode(embeddings_request(1e3, output=pb.OutputOptions(dtype=pb.DTYPE_FLOAT16)), timeout=10)
    assert np.isfinite(from_tensor(small.outputs[0].hidden)).all()
    assert s.sample("attention_failures_total", {"reason": "output_overflow"}) == 2


async def test_a_stream_request_whose_result_float16_cannot_hold_gets_its_own_error(
        start_server: Callable[..., Any], unnormed_bundle: Path):
    s = await start_server(bundle=unnormed_bundle)
    requests = [embeddings_request(1e5, request_id="big", output=pb.OutputOptions(dtype=pb.DTYPE_FLOAT16)),
                embeddings_request(1.0, request_id="small", output=pb.OutputOptions(dtype=pb.DTYPE_FLOAT16))]
    answers = {r.request_id: r async for r in s.stub.EncodeStream(iter(requests), timeout=10)}
    assert answers["big"].error.code == "INVALID_ARGUMENT" and answers["big"].error.field == "output.dtype"
    assert not answers["big"].outputs
    assert not answers["small"].HasField("error")
    assert np.isfinite(from_tensor(answers["small"].outputs[0].hidden)).all()


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16])
def test_the_range_check_refuses_exactly_the_values_the_wire_cast_turns_into_inf(dtype: int):
    edge = np.float32(65520.0) if dtype == pb.DTYPE_FLOAT16 else np.uint32(0x7F7F8000).view(np.float32)
    for value in (np.nextafter(edge, np.float32(0)), edge, np.nextafter(edge, np.float32(np.inf))):
        for sign in (1, -1):
            array = np.array([0.5, sign * value], np.float32)
            with np.errstate(over="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the cast's own overflow warning
                sent = from_tensor(to_tensor(array, dtype))
            name = "float16" if dtype == pb.DTYPE_FLOAT16 else "bfloat16"  # the plan's name for the wire's dtype
            for output in (Output(array, None, None, False), Output(None, array, None, False)):
                if np.isfinite(sent).all():
                    check_representable([output], name, "float32")
                else:
                    with pytest.raises(OutputOverflow):
                        check_representable([output], name, "float32")
            attention = Output(None, None, array.reshape(1, 1, 1, 2), False)
            if np.isfinite(sent).all():
                check_representable([attention], "float32", name)
            else:
                with pytest.raises(OutputOverflow, match="attention.dtype"):
                    check_representable([attention], "float32", name)
