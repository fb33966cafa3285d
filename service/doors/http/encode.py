"""attention.v1 as JSON: POST /v1/encode takes an `EncodeRequest` in protobuf's JSON mapping and answers its
`EncodeResponse` so, through the same wire codec as the gRPC servicer (service/doors/attention_wire.py).
Errors: {"error": {"code", "message", "field"}}, the gRPC status's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from proto.attention.v1 import attention_pb2 as pb
from service.doors import attention_wire as wire
from service.doors.calls import Calls, Model
from service.doors.http import deadline
from service.doors.http.wire import (
    INLINE_BYTES,
    Dialect,
    Route,
    Routes,
    field_of,
    json_object,
    json_response,
    read_json,
)
from service.errors import InvalidInput, ServiceError, status_of
from service.plan import Ask

MAX_VALUES = 1 << 16


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    """attention.v1 over HTTP: the gRPC status's code, message and field."""
    return {"error": {"code": status_of(error), "message": error.message, "field": field_of(error) or ""}}


DIALECT = Dialect("attention.v1", error_body)


class EncodeJson:
    def __init__(self, calls: Calls) -> None:
        self._calls = calls

    def routes(self) -> Routes:
        return Routes(DIALECT, "/v1/encode", [Route("POST", "/v1/encode", self.encode)])

    async def encode(self, request: web.Request) -> web.StreamResponse:
        self._calls.model()  # UNAVAILABLE while loading or draining, before the body is read
        config = self._calls.config

        def decode(body: Any) -> tuple[Model, Ask]:
            try:
                message = json_format.ParseDict(json_object(body), pb.EncodeRequest(), ignore_unknown_fields=False)
            except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
                raise InvalidInput("body", f"not an attention.v1.EncodeRequest: {str(exc)[:160]}") from None
            model = self._calls.model(message.model)
            return model, wire.encode_ask(message, model.spec, config)

        # Tensors are base64 strings: a call's JSON values are its options, shapes and calibration ranges.
        model, ask = await read_json(request, config, MAX_VALUES + 16 * config.max_sequences_per_call, decode)
        ran = await self._calls.run(model, ask, wire.NAMES, wire.response_bytes, deadline.remaining())
        response = wire.encode_response(ran)
        if response.ByteSize() > INLINE_BYTES:
            return await asyncio.to_thread(_json, response)
        return _json(response)


def _json(response: pb.EncodeResponse) -> web.Response:
    return json_response(json_format.MessageToDict(response, preserving_proto_field_name=True))
