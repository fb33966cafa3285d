"""OpenAI's embeddings API: POST /v1/embeddings (and TEI's alias POST /embeddings) and GET /v1/models, in
OpenAI's shapes.

- `input`: a string or an array of strings (an empty string is embedded, as TEI embeds it). Token ids (an array
  of them, or of arrays of them) are refused with a 400 that says why: OpenAI clients send OpenAI's own
  (tiktoken) ids, LangChain's OpenAIEmbeddings by default, and this model would read them as its own and
  answer a wrong vector. `--openai-token-ids` takes them as the model's own ids;
- `model`: a name (or alias) this service serves (GET /v1/models lists them); another name is 404
  model_not_found; unset or null: the default model (TEI's document has it optional);
- `encoding_format`: "float" (default) or "base64" (little-endian float32 bytes, as OpenAI sends them);
- `dimensions`: the first n values (1..d_model), renormalised to unit length (the plan's, service/vectors.py);
- `user` and any other field: ignored, as OpenAI's and TEI's servers ignore unknown fields.
A text over the model's limit is cut when `auto_truncate` is on (the default, as TEI 1.9 does on this route).
The vector is the model's pooled embedding: a text bundle's own pooling and normalisation, or, for
a model without a tokenizer, mean pooling normalised to unit length (OpenAI's vectors are unit vectors).
`usage` counts tokens (special tokens included). Answers carry TEI's timing headers.
Errors: OpenAI's {"error": {"message", "type", "param", "code"}}, and beside it TEI's fields for this route
({"message", "code": the HTTP status, "error_type"}), so that both kinds of client read them.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from service.config import ServiceConfig
from service.doors.calls import Calls, Model, Serving
from service.doors.http import deadline
from service.doors.http.inputs import Inputs, decode_inputs, json_size, names, pooled, pooled_ask
from service.doors.http.wire import (
    Dialect,
    Route,
    Routes,
    field_of,
    json_answer,
    json_object,
    json_response,
    optional,
    read_json,
    text_values,
)
from service.doors.tei_wire import Timing, characters, error_type
from service.errors import InvalidInput, NotFound, ServiceError, status_of
from service.jobs import Job

TOKEN_IDS = ("token ids are refused here: OpenAI clients send OpenAI's tiktoken ids (LangChain's OpenAIEmbeddings "
             "does by default), which this model would read as its own and embed wrongly; send the texts "
             "(LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False)), or start the service with "
             "--openai-token-ids to take ids as this model's own")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "server_error"}


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    code: str | None = status_of(error).lower()
    if isinstance(error, NotFound) and "model" in error.message:
        code = "model_not_found"
    return {"error": {"message": error.message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                                    else "invalid_request_error"),
                      "param": field_of(error), "code": code},
            "message": error.message, "code": status, "error_type": error_type(error)}


DIALECT = Dialect("openai", error_body)


@dataclass(frozen=True)
class EmbeddingsCall:
    inputs: Inputs
    model: Model
    base64: bool
    dimensions: int | None


def decode(body: Any, config: ServiceConfig, serving: Serving) -> EmbeddingsCall:
    """The call, its model found (by name or alias; none named: the default) before its inputs are decoded
    (their counts checked before anything of them is converted)."""
    body = json_object(body)
    name = optional(body, "model", str, "", "a string: the model's name (GET /v1/models)")
    model = serving.find(name)
    if model is None:
        raise NotFound(f"The model {_shown(name)} does not exist; this service serves {serving.names()}")
    if "input" not in body:
        raise InvalidInput("input", "required")
    inputs = decode_inputs(body["input"], "input", max_inputs=config.max_sequences_per_call,
                           max_ids=config.max_tokens_per_call)
    if not config.openai_token_ids and not isinstance(inputs[0], str):
        raise InvalidInput("input", TOKEN_IDS)
    fmt = optional(body, "encoding_format", str, "float", "\"float\" or \"base64\"")
    if fmt not in ("float", "base64"):
        raise InvalidInput("encoding_format", "must be \"float\" or \"base64\"")
    dims = optional(body, "dimensions", int, None, "an integer")  # its range: the plan's check
    return EmbeddingsCall(inputs, model, fmt == "base64", dims)


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 64 and name.isprintable() else "(not shown)"


def encode(call: EmbeddingsCall, sequences: Sequence[Job], vectors: Sequence[np.ndarray]) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        v = np.ascontiguousarray(v, "<f4")
        embedding: Any = base64.b64encode(v.data).decode() if call.base64 else v
        data.append({"object": "embedding", "embedding": embedding, "index": i})
    tokens = sum(job.length for job in sequences)  # as computed: specials in, a truncated text's cut
    return {"object": "list", "data": data, "model": call.model.spec.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def models(names: Sequence[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                         "owned_by": "attention-service"} for name in names]}


class OpenAI:
    """The dialect's routes over the shared call layer: decode -> run -> encode."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._values = text_values(calls.config)
        self._created = int(time.time())

    def routes(self) -> Routes:
        return Routes(DIALECT, "/v1/", [Route("POST", "/v1/embeddings", self.embeddings),
                                        Route("POST", "/embeddings", self.embeddings),
                                        Route("GET", "/v1/models", self.models)])

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        self._calls.model()  # UNAVAILABLE while loading or draining, before the body is read
        serving, config = self._calls.serving, self._calls.config
        call = await read_json(request, config, self._values, lambda body: decode(body, config, serving))
        spec = call.model.spec
        # OpenAI's vectors are unit vectors: a model without a tokenizer's own defaults normalises them too.
        ask = pooled_ask(spec, call.inputs, normalize=None if spec.tokenizer is not None else True,
                         truncate=config.auto_truncate, dimensions=call.dimensions)
        ran = await self._calls.run(call.model, ask, names("input"), json_size, deadline.remaining())
        vectors = pooled(ran)
        headers = Timing.of(ran, characters(call.inputs), started).headers()
        return await json_answer(encode(call, ran.plan.sequences, vectors), sum(v.size for v in vectors), headers)

    async def models(self, request: web.Request) -> web.StreamResponse:
        self._calls.model()
        return json_response(models(self._calls.serving.names(), self._created))
