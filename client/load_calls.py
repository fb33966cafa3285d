"""How the load generator (client/load.py) sends one serialized EncodeRequest and gets its answer:
one Encode call each (`UnaryCalls`), or over one EncodeStream shared by several callers
(`StreamCalls`). A failed request raises `CallFailed` with its gRPC status code name either way."""

from __future__ import annotations

import asyncio
import itertools

import grpc

from client.channel import SERVICE
from proto.attention.v1 import attention_pb2 as pb

ENCODE = f"/{SERVICE}/Encode"
ENCODE_STREAM = f"/{SERVICE}/EncodeStream"


class CallFailed(Exception):
    """A request failed with this gRPC status code name."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Calls:
    """How a caller sends one request (serialized) and gets its response."""

    async def __call__(self, raw: bytes) -> pb.EncodeResponse:
        raise NotImplementedError

    @property
    def broken(self) -> bool:
        """No further request can succeed (a stream that ended)."""
        return False

    async def close(self) -> None:
        pass


class UnaryCalls(Calls):
    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], timeout: float) -> None:
        self._call = channel.unary_unary(ENCODE)
        self._metadata = metadata
        self._timeout = timeout

    async def __call__(self, raw: bytes) -> pb.EncodeResponse:
        try:
            raw_response: bytes = await self._call(raw, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise CallFailed(exc.code().name) from None
        response: pb.EncodeResponse = pb.EncodeResponse.FromString(raw_response)
        return response


class StreamCalls(Calls):
    """One EncodeStream; the server answers in completion order, so responses are matched to their
    requests by request_id. Each request gets a fresh id appended to its prepared bytes: a field that
    occurs twice in a protobuf message takes its last value, so no request is serialized again."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], deadline: float,
                 timeout: float) -> None:
        self._call = channel.stream_stream(ENCODE_STREAM)(timeout=deadline, metadata=metadata)
        self._timeout = timeout  # per request, as a unary call's deadline
        self._writing = asyncio.Lock()  # grpc.aio allows one write in flight per stream
        self._waiting: dict[str, asyncio.Future[pb.EncodeResponse]] = {}
        self._ids = itertools.count()
        self._failed: str | None = None
        self._reader = asyncio.create_task(self._read())

    async def __call__(self, raw: bytes) -> pb.EncodeResponse:
        if self._failed is not None:
            raise CallFailed(self._failed)
        request_id = f"s{next(self._ids)}"
        future: asyncio.Future[pb.EncodeResponse] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            async with self._writing:
                await self._call.write(raw + pb.EncodeRequest(request_id=request_id).SerializeToString())
        except grpc.aio.AioRpcError as exc:
            self._fail(exc.code().name)
        except (asyncio.InvalidStateError, grpc.aio.UsageError):  # written after the stream ended
            self._fail(self._failed or "CANCELLED")
        try:
            response = await asyncio.wait_for(future, self._timeout)
        except TimeoutError:
            self._waiting.pop(request_id, None)
            raise CallFailed("DEADLINE_EXCEEDED") from None
        if response.HasField("error"):
            raise CallFailed(response.error.code or "UNKNOWN")
        return response

    @property
    def broken(self) -> bool:
        return self._failed is not None

    async def _read(self) -> None:
        try:
            async for raw in self._call:
                response = pb.EncodeResponse.FromString(raw)
                future = self._waiting.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response)
            self._fail("CANCELLED")  # the server ended the stream with requests unanswered
        except grpc.aio.AioRpcError as exc:
            self._fail(exc.code().name)

    def _fail(self, code: str) -> None:
        self._failed = self._failed or code
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(CallFailed(self._failed))

    async def close(self) -> None:
        """End the stream the ordinary way (the server answers what is in flight, then OK); cancel it
        only if that fails or takes longer than a request may."""
        try:
            if self._failed is None:
                async with self._writing:
                    await self._call.done_writing()
                await asyncio.wait_for(asyncio.shield(self._reader), self._timeout)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
            pass
        finally:
            self._call.cancel()  # nothing, once the stream has ended
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
