"""KServe v2 REST (the Open Inference Protocol over HTTP, as Triton and tritonclient.http speak it): routes of
the HTTP door, JSON <-> the v2 protobuf messages, over the transport-free core (service/doors/kserve/core.py).

An infer body is JSON, or, with `Inference-Header-Content-Length: N`, N bytes of JSON followed by
the binary tensors of the inputs whose parameters carry `binary_data_size`, in input order (Triton's
binary-data extension). Outputs come back binary unless the output asks `binary_data: false` (the
request parameter `binary_data_output` sets the default for outputs not listed). Errors: {"error": message}.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as v2

from proto.attention.v1.codec import bfloat16_bits_to_float32
from service.doors.http import deadline
from service.doors.http.wire import (
    INLINE_BYTES,
    JSON,
    Dialect,
    Route,
    Routes,
    json_object,
    json_response,
    kind,
    parse_json,
    read_body,
)
from service.doors.kserve.core import SERVER_NAME, SERVER_VERSION, KServe
from service.errors import InvalidInput, ServiceError

HEADER = "Inference-Header-Content-Length"
_DTYPES = {"INT32": "<i4", "INT64": "<i8", "FP32": "<f4", "FP16": "<f2", "INT8": "i1", "UINT8": "u1"}
_TENSOR_FIELDS = frozenset({"name", "shape", "datatype", "parameters", "data"})


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    return {"error": error.message}


DIALECT = Dialect("kserve", error_body)


def _parameter(into: Any, name: str, value: Any, field: str) -> None:
    p = into[name]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise InvalidInput(field, "integer out of range")
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    elif isinstance(value, str):
        p.string_param = value
    else:
        raise InvalidInput(field, f"must be a boolean, a number or a string; got {kind(value)}")


def _parameters(value: Any, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(field, f"must be an object; got {kind(value)}")
    return value


def split(body: bytes, header_length: str | None, max_values: int) -> tuple[Any, bytes]:
    """(the JSON header, at most `max_values` values, the binary tail) of an infer body."""
    if header_length is None:
        return parse_json(body, max_values=max_values), b""
    try:
        n = int(header_length)
    except ValueError:
        raise InvalidInput(HEADER, "must be an integer") from None
    if not 0 < n <= len(body):
        raise InvalidInput(HEADER, f"must be in 1..{len(body)} (the body's length); got {n}")
    return parse_json(body[:n], max_values=max_values), body[n:]


def infer_request(header: Any, binary: bytes, model: str, version: str) -> tuple[Any, dict[str, bool]]:
    """The v2 ModelInferRequest, and for each output asked for whether it goes back binary (the key
    "" is the default for outputs not listed)."""
    header = json_object(header)
    for name in header:
        if name not in ("id", "parameters", "inputs", "outputs"):
            raise InvalidInput(str(name)[:64], "unknown field; known: id, inputs, outputs, parameters")
    request = v2.ModelInferRequest(model_name=model, model_version=version)
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("id", f"must be a string; got {kind(request_id)}")
    request.id = request_id
    binary_default = False
    for name, value in _parameters(header.get("parameters"), "parameters").items():
        if name == "binary_data_output":
            if not isinstance(value, bool):
                raise InvalidInput("parameters.binary_data_output", "must be a boolean")
            binary_default = value
            continue
        _parameter(request.parameters, str(name), value, f"parameters.{str(name)[:64]}")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("inputs", "required: an array of tensors")
    at = 0
    for i, tensor in enumerate(inputs):
        at = _input(request, json_object(tensor, f"inputs[{i}]"), i, binary, at)
    if at != len(binary):
        raise InvalidInput("body", f"{len(binary) - at} bytes of binary data beyond the inputs' binary_data_size")
    binary_out = {"": binary_default}
    outputs = header.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InvalidInput("outputs", "must be an array")
        for i, output in enumerate(outputs):
            output = json_object(output, f"outputs[{i}]")
            name = output.get("name")
            if not isinstance(name, str):
                raise InvalidInput(f"outputs[{i}].name", "required: a string")
            asked = request.outputs.add(name=name)
            params = dict(_parameters(output.get("parameters"), f"outputs[{i}].parameters"))
            wants_binary = params.pop("binary_data", binary_default)
            if not isinstance(wants_binary, bool):
                raise InvalidInput(f"outputs[{i}].parameters.binary_data", "must be a boolean")
            if params.pop("class_count", 0) not in (0, None):
                raise InvalidInput(f"outputs[{i}].parameters.class_count", "classification is not supported")
            for key, value in params.items():
                _parameter(asked.parameters, str(key), value, f"outputs[{i}].parameters.{str(key)[:64]}")
            binary_out[name] = wants_binary
    return request, binary_out


def _input(request: Any, tensor: dict[str, Any], i: int, binary: bytes, at: int) -> int:
    """Adds input `i` (its data as raw bytes, as tritonclient's gRPC client sends them); returns the offset
    in the binary tail after it."""
    for key in tensor:
        if key not in _TENSOR_FIELDS:
            raise InvalidInput(f"inputs[{i}].{str(key)[:64]}", "unknown field")
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidInput(f"inputs[{i}]", "name and datatype are required strings")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31
                                              for d in shape):
        raise InvalidInput(f"inputs[{i}].shape", "must be an array of non-negative integers")
    params = dict(_parameters(tensor.get("parameters"), f"inputs[{i}].parameters"))
    size = params.pop("binary_data_size", None)
    out = request.inputs.add(name=name, datatype=datatype, shape=shape)
    for key, value in params.items():
        _parameter(out.parameters, str(key), value, f"inputs[{i}].parameters.{str(key)[:64]}")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= len(binary) - at:
            raise InvalidInput(f"inputs[{i}].parameters.binary_data_size",
                               "must be a non-negative integer within the binary data")
        if "data" in tensor:
            raise InvalidInput(f"inputs[{i}]", "both data and binary_data_size given")
        request.raw_input_contents.append(binary[at: at + size])
        return at + size
    if "data" not in tensor:
        raise InvalidInput(f"inputs[{i}].data", "required (or binary_data_size)")
    request.raw_input_contents.append(_raw(tensor["data"], datatype, i))
    return at


def _raw(data: Any, datatype: str, i: int) -> bytes:
    """JSON tensor data (flat or nested, row-major) as the raw bytes the gRPC door decodes."""
    field = f"inputs[{i}].data"
    flat = _flatten(data, field)
    if datatype == "BYTES":
        out = bytearray()
        for item in flat:
            if not isinstance(item, str):
                raise InvalidInput(field, "BYTES data must be strings")
            raw = item.encode("utf-8", "surrogatepass")
            out += len(raw).to_bytes(4, "little") + raw
        return bytes(out)
    dtype = _DTYPES.get(datatype)
    if dtype is None or dtype.startswith("<f"):
        return b""  # the gRPC door names the datatype it takes (a byte-size mismatch never hides it)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        raise InvalidInput(field, f"{datatype} data must be integers")
    info = np.iinfo(dtype)
    if any(not info.min <= v <= info.max for v in flat):
        raise InvalidInput(field, f"a value is out of the {datatype} range")
    return np.asarray(flat, dtype).tobytes()


def _flatten(data: Any, field: str, depth: int = 0) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if depth > 8:
        raise InvalidInput(field, "nested too deep")
    out: list[Any] = []
    for item in data:
        out.extend(_flatten(item, field, depth + 1) if isinstance(item, list) else [item])
    return out


def infer_response(response: Any, binary_out: Mapping[str, bool]) -> tuple[bytes, int | None]:
    """(body, JSON header length or None) of a ModelInferResponse; outputs as JSON numbers written by orjson
    from their arrays (float64: the decimal text of each value exactly, as before)."""
    outputs, tail = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = [int(d) for d in tensor.shape]
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": shape}
        if binary_out.get(tensor.name, binary_out[""]):
            out["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            out["data"] = _values(raw, tensor.datatype)
        outputs.append(out)
    header = {"model_name": response.model_name, "model_version": response.model_version, "outputs": outputs}
    if response.id:
        header["id"] = response.id
    header["parameters"] = parameters(response.parameters)
    body = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tail:
        return body, None
    return body + b"".join(tail), len(body)


def _values(raw: bytes, datatype: str) -> np.ndarray:
    """A raw output's values, flat, as JSON writes them."""
    if datatype == "BF16":
        return bfloat16_bits_to_float32(np.frombuffer(raw, "<u2")).astype(np.float64)
    array = np.frombuffer(raw, _DTYPES[datatype])
    return np.ascontiguousarray(array if array.dtype.kind in "iu" else array.astype(np.float64))


def parameters(params: Any) -> dict[str, Any]:
    out = {}
    for name, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[name] = getattr(value, choice)
    return out


def message(msg: Any) -> dict[str, Any]:
    """A v2 message as JSON: protobuf's own mapping, proto field names (Triton's HTTP shapes)."""
    value: dict[str, Any] = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    return value


class KServeRest:
    """The REST routes (Triton's HTTP endpoints) over the KServe core."""

    def __init__(self, core: KServe) -> None:
        self._core = core
        self._config = core.calls.config

    def routes(self) -> Routes:
        routes = [Route("GET", "/v2", self.server_metadata),
                  Route("GET", "/v2/health/live", self.live, health=True),
                  Route("GET", "/v2/health/ready", self.ready, health=True),
                  Route("GET", "/v2/models/stats", self.all_stats)]  # before /v2/models/{model}
        routes += [Route("POST", "/v2/repository/index", self.repository_index),
                   Route("POST", "/v2/repository/models/{model}/load", self.load),
                   Route("POST", "/v2/repository/models/{model}/unload", self.unload)]
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            routes += [Route("GET", base, self.model_metadata), Route("GET", f"{base}/ready", self.model_ready),
                       Route("GET", f"{base}/config", self.model_config),
                       Route("GET", f"{base}/stats", self.model_stats), Route("POST", f"{base}/infer", self.infer)]
        return Routes(DIALECT, "/v2", routes)

    async def server_metadata(self, request: web.Request) -> web.StreamResponse:
        return json_response({"name": SERVER_NAME, "version": SERVER_VERSION,
                              "extensions": [*self._core.extensions(), "binary_tensor_data"]})

    async def live(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.StreamResponse:
        self._core.calls.serving.require_serving()
        return web.Response(status=200)

    def _names(self, request: web.Request) -> tuple[str, str]:
        return request.match_info["model"], request.match_info.get("version", "")

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        name, version = self._names(request)
        meta = self._core.model_metadata(v2.ModelMetadataRequest(name=name, version=version))
        tensors = [[{"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]} for t in group]
                   for group in (meta.inputs, meta.outputs)]
        return json_response({"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                              "inputs": tensors[0], "outputs": tensors[1]})

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        name, version = self._names(request)
        self._core.served(name, version)  # unknown: 404
        self._core.calls.serving.require_serving()
        ready = self._core.model_ready(v2.ModelReadyRequest(name=name, version=version)).ready
        return web.Response(status=200 if ready else 503)

    async def model_config(self, request: web.Request) -> web.StreamResponse:
        name, version = self._names(request)
        config = self._core.model_config(v2.ModelConfigRequest(name=name, version=version)).config
        return json_response(message(config))

    async def model_stats(self, request: web.Request) -> web.StreamResponse:
        name, version = self._names(request)
        return json_response(message(self._core.model_statistics(v2.ModelStatisticsRequest(name=name,
                                                                                          version=version))))

    async def all_stats(self, request: web.Request) -> web.StreamResponse:
        return json_response(message(self._core.model_statistics(v2.ModelStatisticsRequest())))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await read_body(request, 1 << 16, self._config.http_read_timeout_s)
        return json_object(parse_json(raw, max_values=1024)) if raw.strip() else {}

    async def repository_index(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("ready", "must be a boolean")
        index = self._core.repository_index(v2.RepositoryIndexRequest(ready=ready))
        return json_response([{"name": m.name, "version": m.version, "state": m.state,
                               **({"reason": m.reason} if m.reason else {})} for m in index.models])

    async def load(self, request: web.Request) -> web.StreamResponse:
        message = v2.RepositoryModelLoadRequest(model_name=request.match_info["model"])
        for name, value in _parameters(self._body_parameters(await self._body(request)), "parameters").items():
            _parameter(message.parameters, str(name), value, f"parameters.{str(name)[:64]}")
        await self._core.load(message)
        return web.Response(status=200)

    async def unload(self, request: web.Request) -> web.StreamResponse:
        await self._body(request)  # {"parameters": {"unload_dependents": ...}}: nothing depends on a model here
        await self._core.unload(v2.RepositoryModelUnloadRequest(model_name=request.match_info["model"]))
        return web.Response(status=200)

    @staticmethod
    def _body_parameters(body: dict[str, Any]) -> Any:
        for name in body:
            if name != "parameters":
                raise InvalidInput(str(name)[:64], "unknown field; known: parameters")
        return body.get("parameters")

    async def infer(self, request: web.Request) -> web.StreamResponse:
        config = self._config
        raw = await read_body(request, config.max_message_bytes, config.http_read_timeout_s)
        sent_length, (name, version) = request.headers.get(HEADER), self._names(request)
        # every id of every input (ids, mask, types), or a call's texts, and the options
        values = 3 * config.max_tokens_per_call + 4 * config.max_sequences_per_call + 4096

        def decode() -> tuple[Any, dict[str, bool]]:
            header, binary = split(raw, sent_length, values)
            return infer_request(header, binary, name, version)

        infer, binary_out = await asyncio.to_thread(decode) if len(raw) > INLINE_BYTES else decode()
        response = await self._core.infer(infer, deadline.remaining(),
                                          text=lambda output: not binary_out.get(output, binary_out[""]))
        if sum(len(raw) for raw in response.raw_output_contents) > INLINE_BYTES:
            body, header_length = await asyncio.to_thread(infer_response, response, binary_out)
        else:
            body, header_length = infer_response(response, binary_out)
        if header_length is None:
            return web.Response(body=body, content_type=JSON)
        return web.Response(body=body, content_type="application/octet-stream", headers={HEADER: str(header_length)})
