"""What a call may get back (issue 16, items 4 and 6): a response that would not fit the message limit
is refused before compute, framing included; a result that is not finite in the dtype it is sent in
is never returned.

Real servers on 127.0.0.1:0 serving the TINY bundle (d_model 32, 4 heads, 2 layers, max_length 64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from proto.attention.v1 import attention_pb2 as pb
from service import validation
from tests.conftest import ids_request
from tests.reliability_helpers import assert_clean_status, batches

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

    # Just under: a limit a few bytes above the real size is enough (the estimate is tight).
    fits = await start_server(max_message_bytes=size + 64)
    response = await fits.stub.Encode(ids_request(IDS), timeout=10)
    assert response.ByteSize() == size and batches(fits) == 1


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
    spec = served.server.state.spec
    estimate = validation.response_bytes(validation.validate(request, spec, served.server.config), spec)
    assert response.ByteSize() <= estimate <= response.ByteSize() + 64 * len(request.sequences) + 64
