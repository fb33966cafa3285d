"""Token vectors over HTTP, in vLLM's pooling API shape: POST /pooling on a late-interaction model (ColBERT,
BGE-M3) answers each text's token vectors (after the projection, normalised: the ColBERT vectors MaxSim scores).

  request   {"model": name (optional: the default model), "input": a text or texts, "input_type": "query" |
             "document" (ours: how the text is encoded, markers and [MASK] expansion for a query, the skip
             list for a document; default "document"), "encoding_format": "float" | "base64"}
  response  {"id", "object": "list", "created", "model", "data": [{"index", "object": "pooling", "data": [[float]]
             (n x vector_dim; base64: the little-endian float32 bytes of the n x vector_dim matrix)}],
             "usage": {"prompt_tokens", "total_tokens"}}

vLLM answers its token-embedding task with this shape; Infinity's ColBERT embeddings and Jina's multi-vector API
are the same nested lists under other keys. Errors in vLLM's body (`error_body`). Ids are not taken: token vectors
are defined by the texts' query or document encoding.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
from aiohttp import web

from service.doors.calls import Calls, Model, Serving
from service.doors.http import deadline
from service.doors.http.inputs import json_size, names
from service.doors.http.wire import (
    Dialect,
    Route,
    Routes,
    field_of,
    json_answer,
    json_object,
    kind,
    optional,
    read_json,
    text_values,
)
from service.errors import InvalidInput, NotFound, ServiceError, TooLarge, status_of
from service.plan import Ask


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    """vLLM's error answer: {"object": "error", "message", "type", "param", "code": the HTTP status}."""
    return {"object": "error", "message": error.message, "type": status_of(error).lower(), "param": field_of(error),
            "code": status}


DIALECT = Dialect("vllm", error_body)
FIELDS = frozenset({"model", "input", "input_type", "encoding_format", "user", "truncate"})


def decode(body: Any, serving: Serving, max_inputs: int) -> tuple[Model, list[str], str, bool, bool]:
    """(model, texts, input_type, base64, truncate), the model found before the texts are looked at."""
    body = json_object(body)
    for name in body:
        if name not in FIELDS:
            shown = name if name.isidentifier() and len(name) <= 64 else "(not shown)"
            raise InvalidInput(shown, f"unknown field; known: {', '.join(sorted(FIELDS))}")
    name = optional(body, "model", str, "", "a string")
    model = serving.find(name)
    if model is None:
        raise NotFound(f"The model {name!r} does not exist; this service serves {serving.names()}"
                       if len(name) <= 64 and name.isprintable() else "unknown model")
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise InvalidInput("input", f"required: a text or an array of texts; got {kind(value)}")
    if len(texts) > max_inputs:
        raise TooLarge("input", f"batch size {len(texts)} > maximum allowed batch size {max_inputs}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInput(f"input[{i}]", "must be a text (token vectors are encoded from text)")
    input_type = optional(body, "input_type", str, "document", "\"query\" or \"document\"")
    fmt = optional(body, "encoding_format", str, "float", "\"float\" or \"base64\"")
    if fmt not in ("float", "base64"):
        raise InvalidInput("encoding_format", "must be \"float\" or \"base64\"")
    optional(body, "user", str, "", "a string")
    return model, texts, input_type, fmt == "base64", optional(body, "truncate", bool, False, "a boolean")


class Pooling:
    """POST /pooling over the shared call layer: decode -> run -> encode."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._values = text_values(calls.config)

    def routes(self) -> Routes:
        return Routes(DIALECT, "/pooling", [Route("POST", "/pooling", self.pooling)])

    async def pooling(self, request: web.Request) -> web.StreamResponse:
        self._calls.model()  # UNAVAILABLE while loading or draining, before the body is read
        config, serving = self._calls.config, self._calls.serving
        model, texts, input_type, b64, truncate = await read_json(
            request, config, self._values, lambda body: decode(body, serving, config.max_sequences_per_call))
        ask = Ask(inputs=texts, return_hidden=False, vectors=input_type, truncate=truncate)
        ran = await self._calls.run(model, ask, replace(names("input"), vectors="input_type"), json_size,
                                    deadline.remaining())
        data = []
        for i, out in enumerate(ran.outputs):
            assert out.vectors is not None, "token vectors asked for, none returned. This is a bug."
            v = np.ascontiguousarray(out.vectors, "<f4")
            data.append({"index": i, "object": "pooling", "data": base64.b64encode(v.data).decode() if b64 else v})
        tokens = sum(job.length for job in ran.plan.sequences)
        answer = {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": model.spec.name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return await json_answer(answer, sum(o.vectors.size for o in ran.outputs if o.vectors is not None))
