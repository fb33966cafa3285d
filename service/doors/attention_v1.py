"""attention.v1.AttentionService over gRPC: each handler parses its request, decodes it into an `Ask`
(service/doors/attention_wire.py), runs it on the shared call layer (service/doors/calls.py `Calls.run`)
and encodes the `Ran`. Nothing else: the call's orchestration is the call layer's, a handler's answer
and the stream loop service/doors/rpc.py's, shared with every gRPC door.

Handlers take raw request bytes and parse them here, so that a malformed message is answered
INVALID_ARGUMENT instead of grpcio's UNKNOWN.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import SERVICE_NAME
from service.doors import attention_wire as wire
from service.doors.calls import Calls
from service.doors.rpc import Rpc, parse, public, remaining, serialize
from service.errors import ServiceError, status_of
from service.plan import MAX_REQUEST_ID, head_response_bytes

Work = Callable[[Any, float], Awaitable[Any]]


class AttentionServicer:
    SERVICE_NAME = SERVICE_NAME

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._rpc = Rpc(calls, SERVICE_NAME, "attention.v1")
        self._config = calls.config

    # -- one call each: decode -> run -> encode ----------------------------------------------------

    async def _encode(self, request: pb.EncodeRequest, seconds: float) -> pb.EncodeResponse:
        model = self._calls.model(request.model)
        ask = wire.encode_ask(request, model.spec, model.config or self._config)
        return wire.encode_response(await self._calls.run(model, ask, wire.NAMES, wire.response_bytes, seconds))

    async def _classify(self, request: pb.ClassifyRequest, seconds: float) -> pb.ClassifyResponse:
        model = self._calls.model(request.model)
        ask, names = wire.classify_ask(request)
        return wire.classify_response(await self._calls.run(model, ask, names, head_response_bytes, seconds))

    async def _rerank(self, request: pb.RerankRequest, seconds: float) -> pb.RerankResponse:
        model = self._calls.model(request.model)
        ask = wire.rerank_ask(request)
        ran = await self._calls.run(model, ask, wire.RERANK, head_response_bytes, seconds)
        return wire.rerank_response(ran, request.texts, request.return_text)

    async def _tokenize(self, request: pb.TokenizeRequest, seconds: float) -> pb.TokenizeResponse:
        encoded = await self._calls.tokenize(self._calls.model(request.model), request.texts, field="texts",
                                             truncate=request.truncate, prompt_name=request.prompt_name)
        response = pb.TokenizeResponse()
        for enc in encoded:
            text = response.texts.add(token_count=len(enc.ids), truncated=enc.truncated, tokens=enc.tokens)
            text.ids.extend(enc.ids.tolist())
        return response

    async def _model_info(self, request: pb.GetModelInfoRequest, seconds: float) -> pb.ModelInfo:
        model = self._calls.model(request.model)
        return wire.model_info(model.spec, self._config, model.aliases)

    async def _list_models(self, request: pb.ListModelsRequest, seconds: float) -> pb.ListModelsResponse:
        serving = self._calls.serving
        self._calls.model()  # UNAVAILABLE while loading or draining
        models = sorted(serving.models.values(), key=lambda m: m.spec.name != serving.default)
        return pb.ListModelsResponse(models=[wire.model_info(m.spec, self._config, m.aliases) for m in models])

    # -- handlers (raw bytes in, raw bytes out) --------------------------------------------------

    def _unary(self, method: str, request_type: Any, work: Work) -> Any:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async def answer() -> bytes:
                request = await parse(request_type, raw, self._config)
                return await serialize(await work(request, remaining(context, self._config)))

            return await self._rpc.answer(method, context, answer)

        return grpc.unary_unary_rpc_method_handler(handle, response_serializer=bytes)

    async def encode_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """One response per request, in completion order, flow-controlled (`Rpc.stream`); a failed
        request answers with `error` set."""
        async def one(raw: bytes) -> bytes:
            request_id = ""

            async def work() -> bytes:
                nonlocal request_id
                request = await parse(pb.EncodeRequest, raw, self._config)
                if len(request.request_id) <= MAX_REQUEST_ID:  # echoed in a refusal too: never a long one
                    request_id = request.request_id
                return await serialize(await self._encode(request, remaining(context, self._config)))

            return await self._rpc.answer_in_stream(
                "EncodeStream", work, lambda error: _stream_error(request_id, error).SerializeToString(), context)

        async with contextlib.aclosing(self._rpc.stream(requests, one)) as responses:
            async for response in responses:
                yield response

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Encode": self._unary("Encode", pb.EncodeRequest, self._encode),
            "EncodeStream": grpc.stream_stream_rpc_method_handler(self.encode_stream, response_serializer=bytes),
            "GetModelInfo": self._unary("GetModelInfo", pb.GetModelInfoRequest, self._model_info),
            "Tokenize": self._unary("Tokenize", pb.TokenizeRequest, self._tokenize),
            "Classify": self._unary("Classify", pb.ClassifyRequest, self._classify),
            "Rerank": self._unary("Rerank", pb.RerankRequest, self._rerank),
            "ListModels": self._unary("ListModels", pb.ListModelsRequest, self._list_models),
        })


def _stream_error(request_id: str, error: ServiceError) -> pb.EncodeResponse:
    """A failed EncodeStream request's answer: the same code and message a unary call would get."""
    return pb.EncodeResponse(request_id=request_id, error=pb.StreamError(
        code=status_of(error), message=public(error.message), field=public(getattr(error, "field", ""))))
