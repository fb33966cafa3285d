"""`inference.GRPCInferenceService` (KServe v2 over gRPC): each RPC parsed from its bytes and answered by the
transport-free core (service/doors/kserve/core.py); answers and the stream loop are service/doors/rpc.py's,
shared with every gRPC door.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as v2

from service.doors.kserve.core import SERVER_NAME, SERVER_VERSION, KServe
from service.doors.kserve.wire import final_flag
from service.doors.rpc import Rpc, parse, public, remaining, serialize
from service.errors import ServiceError, status_of
from service.plan import MAX_REQUEST_ID

SERVICE_NAME = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class KServeServicer:
    SERVICE_NAME = SERVICE_NAME

    def __init__(self, core: KServe) -> None:
        self._core = core
        self._rpc = Rpc(core.calls, SERVICE_NAME, "kserve")
        self._config = core.calls.config

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        core = self._core
        handlers: dict[str, tuple[Any, Callable[[Any], Any]]] = {
            "ServerLive": (v2.ServerLiveRequest, lambda _: v2.ServerLiveResponse(live=True)),
            "ServerReady": (v2.ServerReadyRequest, lambda _: v2.ServerReadyResponse(ready=core.ready())),
            "ModelReady": (v2.ModelReadyRequest, core.model_ready),
            "ServerMetadata": (v2.ServerMetadataRequest, lambda _: v2.ServerMetadataResponse(
                name=SERVER_NAME, version=SERVER_VERSION, extensions=core.extensions())),
            "ModelMetadata": (v2.ModelMetadataRequest, core.model_metadata),
            "ModelConfig": (v2.ModelConfigRequest, core.model_config),
            "ModelStatistics": (v2.ModelStatisticsRequest, core.model_statistics),
            "RepositoryIndex": (v2.RepositoryIndexRequest, core.repository_index),
        }
        methods = {name: grpc.unary_unary_rpc_method_handler(self._unary(name, *h), response_serializer=bytes)
                   for name, h in handlers.items()}
        methods["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer, response_serializer=bytes)
        for name, request_type, handle in (("RepositoryModelLoad", v2.RepositoryModelLoadRequest, core.load),
                                           ("RepositoryModelUnload", v2.RepositoryModelUnloadRequest, core.unload)):
            methods[name] = grpc.unary_unary_rpc_method_handler(self._awaited(name, request_type, handle),
                                                                response_serializer=bytes)
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer, response_serializer=bytes)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    def _unary(self, method: str, request_type: Any, handle: Callable[[Any], Any]) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async def work() -> bytes:
                return await serialize(handle(await parse(request_type, raw, self._config)))

            return await self._rpc.answer(method, context, work)

        return call

    def _awaited(self, method: str, request_type: Any, handle: Callable[[Any], Awaitable[Any]]) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async def work() -> bytes:
                return await serialize(await handle(await parse(request_type, raw, self._config)))

            return await self._rpc.answer(method, context, work)

        return call

    async def model_infer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = await parse(v2.ModelInferRequest, raw, self._config)
            return await serialize(await self._core.infer(request, remaining(context, self._config)))

        return await self._rpc.answer("ModelInfer", context, work)

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """One response per request, in completion order (`id` echoed). A failed request answers with
        `error_message` "[StatusCode.X] message" (the text tritonclient shows for a unary error; the
        stream has no code field) and the stream goes on."""
        async def one(raw: bytes) -> bytes:
            request_id, final = "", False

            async def work() -> bytes:
                nonlocal request_id, final
                request = await parse(v2.ModelInferRequest, raw, self._config)
                if len(request.id) <= MAX_REQUEST_ID:  # echoed in a refusal too: never a long one
                    request_id = request.id
                final = final_flag(request)
                response = v2.ModelStreamInferResponse(
                    infer_response=await self._core.infer(request, remaining(context, self._config)))
                if final:
                    response.infer_response.parameters["triton_final_response"].bool_param = True
                return await serialize(response)

            def failed(error: ServiceError) -> bytes:
                response = v2.ModelStreamInferResponse(
                    error_message=public(f"[StatusCode.{status_of(error)}] {error.message}"),
                    infer_response=v2.ModelInferResponse(id=request_id))
                if final:
                    response.infer_response.parameters["triton_final_response"].bool_param = True
                data: bytes = response.SerializeToString()
                return data

            return await self._rpc.answer_in_stream("ModelStreamInfer", work, failed, context)

        async with contextlib.aclosing(self._rpc.stream(requests, one)) as responses:
            async for response in responses:
                yield response
