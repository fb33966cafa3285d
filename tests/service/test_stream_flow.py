"""EncodeStream under a caller that sends and never reads (issue 16, item 2): the server must stop
reading that stream (HTTP/2 flow control then holds the caller's sends) rather than compute every
request and queue its answer in memory; nothing accepted is lost once the caller reads again."""

from __future__ import annotations

import asyncio

import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import to_tensor

SEQUENCES, LENGTH, D_MODEL = 8, 64, 32  # each request 8 x 64 x 32 float32 = 64 KiB in, as much out
ATTEMPTS = 400  # 26 MiB of requests: far beyond what HTTP/2 windows hold


def request(i: int) -> pb.EncodeRequest:
    rng = np.random.default_rng(i)
    return pb.EncodeRequest(request_id=str(i), sequences=[
        pb.Sequence(embeddings=to_tensor(rng.standard_normal((LENGTH, D_MODEL), dtype=np.float32)))
        for _ in range(SEQUENCES)])


async def test_a_stream_that_is_never_read_stops_being_read_and_loses_nothing(start_server):
    s = await start_server(max_stream_inflight=4)
    call = s.stub.EncodeStream(timeout=120)
    sent = 0

    async def write_all() -> None:
        nonlocal sent
        for i in range(ATTEMPTS):
            await call.write(request(i))  # held by flow control once the server stops reading
            sent += 1
        await call.done_writing()

    writer = asyncio.ensure_future(write_all())
    # Wait (bounded) until the sends stall, or all were taken in: what the old server did.
    last, still_since = -1, asyncio.get_running_loop().time()
    for _ in range(600):
        await asyncio.wait({writer}, timeout=0.1)
        if writer.done() or sent != last:
            last, still_since = sent, asyncio.get_running_loop().time()
        if writer.done() or asyncio.get_running_loop().time() - still_since > 3:
            break
    assert not writer.done() and sent < ATTEMPTS, "every request was taken in although no answer was read"
    computed = s.sample("attention_sequences_total") / SEQUENCES
    assert computed <= sent
    # Reading again resumes the stream: every request gets exactly one answer.
    answers = [response.request_id async for response in call if not response.HasField("error")]
    await asyncio.wait_for(writer, 30)
    assert sorted(map(int, answers)) == list(range(ATTEMPTS))
