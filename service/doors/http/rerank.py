"""Rerank in the shape Cohere, Jina, Infinity and vLLM share, answered as Cohere's v2 API answers it:
POST /v1/rerank and POST /v2/rerank (the same route; LangChain, LlamaIndex and Haystack point at either).

Request: {"model", "query", "documents", "top_n", "return_documents"}
- `model`: a name (or alias) this service serves; another name is 404; unset or null: the default model;
- `documents`: strings, or objects with a "text" string (Cohere's v1 and Jina's form);
- `top_n`: how many to answer, highest score first (>= 1; more than the documents: all of them); unset: all;
- `return_documents` (false): each result also carries {"document": {"text"}};
- anything else (Cohere's `max_tokens_per_doc`, `rank_fields`, `priority`, ...) is ignored, as Cohere's and
  Jina's servers ignore what they do not know. A pair over the model's limit is cut when `auto_truncate` is on
  (Cohere cuts long documents too).
Answer: {"id", "results": [{"index", "relevance_score"[, "document"]}], "meta": {"api_version": {"version":
"2"}, "billed_units": {"search_units": 1}}, "usage": {"total_tokens"}, "model"}; relevance scores are the
cross-encoder's sigmoid, in [0, 1] as Cohere's are.
Errors: {"message"} (Cohere's), 400 for invalid input, 404 for an unknown model, 413 over the limits, 429
overloaded (Retry-After), 503 not ready or draining.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from service.config import ServiceConfig
from service.doors.calls import Calls, Model, Serving
from service.doors.http import deadline
from service.doors.http.inputs import names
from service.doors.http.wire import (
    Dialect,
    Route,
    Routes,
    json_object,
    json_response,
    kind,
    optional,
    read_json,
    text_values,
)
from service.errors import EmptyInput, InvalidInput, NotFound, ServiceError, TooLarge, shown
from service.plan import Ask, head_response_bytes


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    return {"message": error.message}


DIALECT = Dialect("rerank", error_body)
META = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}


@dataclass(frozen=True)
class RerankCall:
    model: Model
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool


def decode(body: Any, config: ServiceConfig, serving: Serving) -> RerankCall:
    body = json_object(body)
    name = optional(body, "model", str, "", "a string: a model's name")
    model = serving.find(name)
    if model is None:
        raise NotFound(f"model {shown(name)} is not served here; this service serves {serving.names()}")
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidInput("query", f"required: a string; got {kind(query)}")
    documents = body.get("documents")
    if not isinstance(documents, list):
        raise InvalidInput("documents", f"required: an array of strings or of {{\"text\"}} objects; got "
                           f"{kind(documents)}")
    if not documents:
        raise EmptyInput("documents", "cannot be empty")
    if len(documents) > config.max_sequences_per_call:
        raise TooLarge("documents", f"{len(documents)} documents; at most {config.max_sequences_per_call} per call")
    texts = []
    for i, document in enumerate(documents):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise InvalidInput(f"documents[{i}]", "must be a string or an object with a \"text\" string")
        texts.append(text)
    top_n = optional(body, "top_n", int, None, "an integer")
    if top_n is not None and top_n < 1:
        raise InvalidInput("top_n", f"must be >= 1; got {top_n}")
    return RerankCall(model, query, texts, None if top_n is None else min(top_n, len(texts)),
                      optional(body, "return_documents", bool, False, "a boolean"))


class Rerank:
    """The dialect's routes over the shared call layer: decode -> run -> encode."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._values = text_values(calls.config)

    def routes(self) -> Routes:
        return Routes(DIALECT, "/v2/rerank", [Route("POST", "/v1/rerank", self.rerank),
                                              Route("POST", "/v2/rerank", self.rerank)])

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        self._calls.model()  # UNAVAILABLE while loading or draining, before the body is read
        serving, config = self._calls.serving, self._calls.config
        call = await read_json(request, config, self._values, lambda body: decode(body, config, serving))
        ask = Ask(inputs=call.documents, return_hidden=False, task="rerank", query=call.query, top_n=call.top_n,
                  truncate=config.auto_truncate)
        ran = await self._calls.run(call.model, ask, replace(names("documents"), task="rerank"),
                                    head_response_bytes, deadline.remaining())
        assert ran.scores is not None and ran.ranking is not None
        scores = ran.scores
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": call.documents[i]}} if call.return_documents else {})}
                   for i in ran.ranking]
        return json_response({"id": str(uuid.uuid4()), "results": results, "meta": META,
                              "usage": {"total_tokens": ran.plan.tokens}, "model": call.model.spec.name})
