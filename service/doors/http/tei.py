"""Text Embeddings Inference's HTTP routes, in the shapes, status codes and error types of TEI 1.9.3's OpenAPI
document (tests/data/tei/openapi.json):

POST /embed        {"inputs", "normalize" (true), "truncate", "truncation_direction" ("Right"), "prompt_name",
                    "dimensions"} -> [[float]]
POST /embed_all    {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[[float]]] (token embeddings)
POST /embed_sparse {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[{"index", "value"}]] (SPLADE,
                    the non-zero entries, indices ascending)
POST /similarity   {"inputs": {"source_sentence", "sentences"}, "parameters": {"truncate", "truncation_direction",
                    "prompt_name"}} -> [float] (each sentence's cosine with the source, vectors unnormalised)
POST /rerank       {"query", "texts", "truncate", "raw_scores" (false), "return_text" (false),
                    "truncation_direction", "top_n" (ours; all)} -> [{"index", "score"[, "text"]}], highest first
POST /predict      {"inputs": "text" | ["first", "second"] (one pair) | [["text"] or ["first", "second"], ...],
                    "truncate", "raw_scores", "truncation_direction"} -> [{"score", "label"}] (highest first) for
                    one input, [[...]] for a batch
POST /tokenize     {"inputs", "add_special_tokens" (true), "prompt_name"} -> [[{"id", "text", "special", "start",
                    "stop"}]] (start/stop: null, offsets are not kept)
POST /decode       {"ids", "skip_special_tokens" (true)} -> [str]
POST / and /invocations: the route of the model's type (service/doors/tei_wire.py `root_route`), as TEI routes
                    them: /rerank (a reranker), /predict (a classifier), /embed_sparse (SPLADE), else /embed,
                    or /similarity when the body's inputs is {"source_sentence", "sentences"} (TEI needs its
                    TASK=sentence-similarity for that; /embed never takes an object, so the body says which)
GET  /info (TEI's Info), GET /health, / and /ping (health)

Fields:
- Unknown fields are ignored, as TEI ignores them (its serde default): huggingface_hub and LangChain send
  "parameters" with every call. The TEI options of a route are also read from "parameters" (the body of a
  Hugging Face Inference Endpoints client), a top-level field winning; on /similarity "parameters" is TEI's own.
- `truncate` unset or null: the `auto_truncate` setting (on by default, as TEI 1.9; reported in /info).
- `truncation_direction` "Right" keeps a text's start, "Left" its end (any case), for texts and pairs alike.
- An empty text is embedded (its special tokens alone), as TEI embeds it; an empty batch is 400 `Empty`.
- /predict with "parameters" in the body and a single input (huggingface_hub's text_classification) answers
  [[...]], the Inference API's shape (also TEI's batch shape), which that client reads.

Answers carry TEI's headers: x-compute-time, x-total-time, x-tokenization-time, x-queue-time, x-inference-time
(milliseconds), x-compute-characters, x-compute-tokens, x-compute-type (the device).

Errors: {"error", "error_type"} with TEI's error types: 400 Empty; 413 Validation, more inputs than
max_sequences_per_call or a body over max_message_bytes; 422 Validation, invalid input, a text over the
model's limit with truncate false (as TEI's own code answers it; its document lists 413 for "Batch size error"
and 422 for the rest); 424 Backend, a model failure; 429 Overloaded (Retry-After); 503 Unhealthy, not ready or
draining; 504 Backend, the caller's deadline passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from aiohttp import web

from service.config import ServiceConfig
from service.doors.calls import Calls, Model, Ran
from service.doors.http import deadline
from service.doors.http.inputs import Inputs, decode_inputs, json_size, names, pooled, pooled_ask
from service.doors.http.wire import (
    Dialect,
    Route,
    Routes,
    json_answer,
    json_object,
    json_response,
    kind,
    optional,
    read_json,
    text_values,
)
from service.doors.tei_wire import (
    Timing,
    characters,
    decode_rows,
    error_type,
    info,
    root_route,
    side,
    special_token_ids,
)
from service.errors import EmptyInput, InvalidInput, ServiceError, TooLarge
from service.plan import Ask, head_response_bytes
from service.tasks import sparse_entries


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    return {"error": error.message, "error_type": error_type(error)}


DIALECT = Dialect("tei", error_body, invalid=422, internal=424)


class Fields:
    """A TEI body's options: its own fields, else the same under "parameters" (Hugging Face Inference Endpoints
    clients put them there). Values are type-checked wherever they are found."""

    def __init__(self, body: dict[str, Any], config: ServiceConfig, nested: bool = True) -> None:
        self._body = body
        self._config = config
        params = body.get("parameters") if nested else None
        if params is not None and not isinstance(params, dict):
            raise InvalidInput("parameters", f"must be an object; got {kind(params)}")
        self._params: Mapping[str, Any] = params or {}

    def get(self, name: str, types: type | tuple[type, ...], default: Any, what: str) -> Any:
        if self._body.get(name) is not None or name not in self._params:
            return optional(self._body, name, types, default, what)
        try:
            return optional(self._params, name, types, default, what)
        except InvalidInput as exc:
            raise InvalidInput(f"parameters.{name}", exc.description) from None

    def truncate(self) -> bool:
        """`truncate`; unset or null: the auto_truncate setting."""
        return bool(self.get("truncate", bool, self._config.auto_truncate, "a boolean"))

    def side(self) -> str | None:
        """`truncation_direction` as the side a cut keeps; None when unset (the model's own, right for TEI's)."""
        value = self.get("truncation_direction", str, None, "\"Right\" or \"Left\"")
        return None if value is None else side(value, "truncation_direction")

    def prompt_name(self) -> str:
        return str(self.get("prompt_name", str, "", "a string"))


def _inputs(body: dict[str, Any], config: ServiceConfig) -> Inputs:
    if "inputs" not in body:
        raise InvalidInput("inputs", "required")
    return decode_inputs(body["inputs"], "inputs", max_inputs=config.max_sequences_per_call,
                         max_ids=config.max_tokens_per_call, too_many=TooLarge)


@dataclass(frozen=True)
class EmbedCall:
    inputs: Inputs
    normalize: bool
    truncate: bool
    side: str | None
    prompt_name: str
    dimensions: int | None


def decode_embed(body: Any, config: ServiceConfig) -> EmbedCall:
    body = json_object(body)
    fields = Fields(body, config)
    inputs = _inputs(body, config)
    return EmbedCall(inputs, fields.get("normalize", bool, True, "a boolean"), fields.truncate(), fields.side(),
                     fields.prompt_name(), fields.get("dimensions", int, None, "an integer"))  # range: the plan's


@dataclass(frozen=True)
class SimilarityCall:
    source: str
    sentences: list[str]
    truncate: bool
    side: str | None
    prompt_name: str


def is_similarity(body: Any) -> bool:
    """A body whose inputs is an object: /similarity's (no other embedding route takes one)."""
    return isinstance(body, dict) and isinstance(body.get("inputs"), dict)


def decode_similarity(body: Any, config: ServiceConfig) -> SimilarityCall:
    body = json_object(body)
    value = json_object(body.get("inputs"), "inputs")
    source = value.get("source_sentence")
    if not isinstance(source, str):
        raise InvalidInput("inputs.source_sentence", f"required: a string; got {kind(source)}")
    sentences = value.get("sentences")
    if not isinstance(sentences, list):
        raise InvalidInput("inputs.sentences", f"required: an array of strings; got {kind(sentences)}")
    if not sentences:
        raise EmptyInput("inputs.sentences", "cannot be empty")
    if len(sentences) + 1 > config.max_sequences_per_call:  # the source is one more, as TEI counts it
        raise TooLarge("inputs.sentences", f"batch size {len(sentences) + 1} > maximum allowed batch size "
                       f"{config.max_sequences_per_call}")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise InvalidInput(f"inputs.sentences[{i}]", "must be a string")
    params = body.get("parameters")
    fields = Fields(json_object(params, "parameters") if params is not None else {}, config, nested=False)
    return SimilarityCall(source, sentences, fields.truncate(), fields.side(), fields.prompt_name())


def cosines(vectors: Sequence[np.ndarray]) -> list[float]:
    """Each vector's cosine with the first (0 for a zero vector), in float32 as TEI computes it."""
    first = vectors[0].astype(np.float32)
    rest = np.stack(vectors[1:]).astype(np.float32)
    norms = np.linalg.norm(rest, axis=1) * np.linalg.norm(first)
    dots = rest @ first
    return [float(d / n) if n > 0 else 0.0 for d, n in zip(dots.tolist(), norms.tolist(), strict=True)]


def decode_tokenize(body: Any, config: ServiceConfig) -> tuple[list[str], str, bool]:
    body = json_object(body)
    inputs = _inputs(body, config)
    if not all(isinstance(x, str) for x in inputs):
        raise InvalidInput("inputs", "must be a string or an array of strings")
    fields = Fields(body, config)
    return ([str(x) for x in inputs], fields.prompt_name(),
            bool(fields.get("add_special_tokens", bool, True, "a boolean")))


def decode_decode(body: Any, config: ServiceConfig, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The ids to decode: at most max_sequences_per_call rows and max_tokens_per_call ids, checked first."""
    body = json_object(body)
    if "ids" not in body:
        raise InvalidInput("ids", "required")
    rows = decode_inputs(body["ids"], "ids", max_inputs=config.max_sequences_per_call,
                         max_ids=config.max_tokens_per_call, too_many=TooLarge)
    if any(isinstance(r, str) for r in rows):
        raise InvalidInput("ids", "must be an array of token ids, or an array of arrays of them")
    out = []
    for i, row in enumerate(rows):
        assert isinstance(row, np.ndarray)
        bad = np.flatnonzero((row < 0) | (row >= vocab_size))
        if len(bad):
            raise InvalidInput(f"ids[{i}][{int(bad[0])}]", f"id not in [0, {vocab_size})")
        out.append(row.tolist())
    return out, optional(body, "skip_special_tokens", bool, True, "a boolean")


def tokens(ids: Sequence[int], texts: Sequence[str], special: frozenset[int]) -> list[dict[str, Any]]:
    return [{"id": int(i), "text": t, "special": int(i) in special, "start": None, "stop": None}
            for i, t in zip(ids, texts, strict=True)]


@dataclass(frozen=True)
class RerankCall:
    query: str
    texts: list[str]
    top_n: int | None
    return_text: bool
    raw_scores: bool
    truncate: bool
    side: str | None


def decode_rerank(body: Any, config: ServiceConfig) -> RerankCall:
    body = json_object(body)
    if "query" not in body:
        raise InvalidInput("query", "required")
    query = optional(body, "query", str, "", "a string")
    texts = body.get("texts")
    if not isinstance(texts, list):
        raise InvalidInput("texts", "required: an array of strings")
    if not texts:
        raise EmptyInput("texts", "cannot be empty")
    max_inputs = config.max_sequences_per_call
    if len(texts) > max_inputs:
        raise TooLarge("texts", f"batch size {len(texts)} > maximum allowed batch size {max_inputs}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInput(f"texts[{i}]", "must be a string")
    fields = Fields(body, config)
    return RerankCall(query, texts, fields.get("top_n", int, None, "an integer"),
                      fields.get("return_text", bool, False, "a boolean"),
                      fields.get("raw_scores", bool, False, "a boolean"), fields.truncate(), fields.side())


@dataclass(frozen=True)
class PredictCall:
    inputs: list[str | tuple[str, str]]
    batch: bool  # a batch answers a list per input; a single input its list alone
    raw_scores: bool
    truncate: bool
    side: str | None


def _sequence(value: Any) -> str | tuple[str, str] | None:
    """A text, ["text"] or ["first", "second"]; None if it is none of these."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and 1 <= len(value) <= 2 and all(isinstance(v, str) for v in value):
        return value[0] if len(value) == 1 else (value[0], value[1])
    return None


def decode_predict(body: Any, config: ServiceConfig) -> PredictCall:
    body = json_object(body)
    if "inputs" not in body:
        raise InvalidInput("inputs", "required")
    value = body["inputs"]
    max_inputs = config.max_sequences_per_call
    single = _sequence(value)
    if single is not None and not (isinstance(value, list) and len(value) == 1):
        inputs, batch = [single], False  # "text", or ["first", "second"]: one pair, as TEI reads it
    elif isinstance(value, list):
        if not value:
            raise EmptyInput("inputs", "cannot be empty")
        if len(value) > max_inputs:
            raise TooLarge("inputs", f"batch size {len(value)} > maximum allowed batch size {max_inputs}")
        inputs = []
        for i, item in enumerate(value):
            one = _sequence(item)
            if one is None:
                raise InvalidInput(f"inputs[{i}]", "must be a string, [\"text\"] or [\"first\", \"second\"]")
            inputs.append(one)
        batch = True
    else:
        raise InvalidInput("inputs", "must be a string, a pair of strings, or an array of them")
    fields = Fields(body, config)
    # An Inference Endpoints client (its "parameters") reads a single input's answer as a batch of one.
    batch = batch or isinstance(body.get("parameters"), dict)
    return PredictCall(inputs, batch, fields.get("raw_scores", bool, False, "a boolean"), fields.truncate(),
                       fields.side())


def predictions(labels: Sequence[str], scores: Sequence[float]) -> list[dict[str, Any]]:
    """One input's [{"score", "label"}], highest score first (TEI's order)."""
    order = sorted(range(len(labels)), key=lambda i: -scores[i])
    return [{"score": float(scores[i]), "label": labels[i]} for i in order]


def sparse(indices: np.ndarray, values: np.ndarray) -> list[dict[str, Any]]:
    """One input's /embed_sparse entries."""
    return [{"index": int(i), "value": float(v)} for i, v in zip(indices.tolist(), values.tolist(), strict=True)]


def decode_root(body: Any, config: ServiceConfig, route: str) -> Any:
    """`POST /`'s call: the body decoded as the route of the model's type (`root_route`) reads it."""
    if route == "embed":
        return decode_similarity(body, config) if is_similarity(body) else decode_embed(body, config)
    if route == "embed_sparse":
        return SparseCall(decode_embed(body, config))
    return decode_rerank(body, config) if route == "rerank" else decode_predict(body, config)


@dataclass(frozen=True)
class SparseCall:
    embed: EmbedCall


class TEI:
    """The dialect's routes over the shared call layer: decode -> run -> encode. A body is read, parsed and
    decoded (its counts checked first) in a worker thread when it is big (service/doors/http/wire.py)."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._config = calls.config
        self._values = text_values(calls.config)

    def routes(self) -> Routes:
        return Routes(DIALECT, "/", [
            Route("POST", "/embed", self.embed), Route("POST", "/embed_all", self.embed_all),
            Route("POST", "/embed_sparse", self.embed_sparse), Route("POST", "/similarity", self.similarity),
            Route("POST", "/tokenize", self.tokenize), Route("POST", "/decode", self.decode),
            Route("POST", "/rerank", self.rerank), Route("POST", "/predict", self.predict),
            Route("POST", "/", self.root), Route("POST", "/invocations", self.root),
            Route("GET", "/info", self.info), Route("GET", "/health", self.health, health=True),
            Route("GET", "/", self.health, health=True), Route("GET", "/ping", self.health, health=True)])

    async def _read(self, request: web.Request, decode: Callable[[Any], Any]) -> Any:
        return await read_json(request, self._config, self._values, decode)

    # -- routes: read and decode, then run ---------------------------------------------------------

    async def embed(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config))
        return await self._embed(model, call, started)

    async def embed_all(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config))
        ask = pooled_ask(model.spec, call.inputs, normalize=None, truncate=call.truncate, side=call.side,
                         prompt_name=call.prompt_name, hidden=True)
        ran = await self._calls.run(model, ask, names("inputs"), json_size, deadline.remaining())
        hidden = pooled(ran)
        return await json_answer(hidden, sum(h.size for h in hidden), _headers(ran, call.inputs, started))

    async def embed_sparse(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config))
        return await self._sparse(model, call, started)

    async def similarity(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_similarity(body, self._config))
        return await self._similarity(model, call, started)

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_rerank(body, self._config))
        return await self._rerank(model, call, started)

    async def predict(self, request: web.Request) -> web.StreamResponse:
        started, model = time.perf_counter(), self._calls.model()
        call = await self._read(request, lambda body: decode_predict(body, self._config))
        return await self._predict(model, call, started)

    async def root(self, request: web.Request) -> web.StreamResponse:
        """POST / and /invocations: the route of the model's type (module docstring)."""
        started, model = time.perf_counter(), self._calls.model()
        route = root_route(model.spec)
        call = await self._read(request, lambda body: decode_root(body, self._config, route))
        if isinstance(call, EmbedCall):
            return await self._embed(model, call, started)
        if isinstance(call, SimilarityCall):
            return await self._similarity(model, call, started)
        if isinstance(call, SparseCall):
            return await self._sparse(model, call.embed, started)
        if isinstance(call, RerankCall):
            return await self._rerank(model, call, started)
        return await self._predict(model, call, started)

    # -- run and encode --------------------------------------------------------------------------

    async def _embed(self, model: Model, call: EmbedCall, started: float) -> web.StreamResponse:
        ask = pooled_ask(model.spec, call.inputs, normalize=call.normalize, truncate=call.truncate, side=call.side,
                         prompt_name=call.prompt_name, dimensions=call.dimensions)
        ran = await self._calls.run(model, ask, names("inputs"), json_size, deadline.remaining())
        vectors = pooled(ran)
        return await json_answer(vectors, sum(v.size for v in vectors), _headers(ran, call.inputs, started))

    async def _sparse(self, model: Model, call: EmbedCall, started: float) -> web.StreamResponse:
        ask = pooled_ask(model.spec, call.inputs, normalize=None, truncate=call.truncate, side=call.side,
                         prompt_name=call.prompt_name, sparse=True)
        ran = await self._calls.run(model, ask, replace(names("inputs"), sparse="/embed_sparse"), json_size,
                                    deadline.remaining())
        entries = [sparse_entries(x, 0, 0.0) for x in ran.logits]
        return await json_answer([sparse(*e) for e in entries], sum(2 * len(e[0]) for e in entries),
                                 _headers(ran, call.inputs, started))

    async def _similarity(self, model: Model, call: SimilarityCall, started: float) -> web.StreamResponse:
        texts = [call.source, *call.sentences]
        ask = pooled_ask(model.spec, texts, normalize=False, truncate=call.truncate, side=call.side,
                         prompt_name=call.prompt_name)
        ran = await self._calls.run(model, ask, names("inputs.sentences"), json_size, deadline.remaining())
        return json_response(cosines(pooled(ran)), headers=_headers(ran, texts, started))

    async def _rerank(self, model: Model, call: RerankCall, started: float) -> web.StreamResponse:
        ask = Ask(inputs=call.texts, return_hidden=False, task="rerank", query=call.query, top_n=call.top_n,
                  truncate=call.truncate, truncation_side=call.side, raw_scores=call.raw_scores)
        ran = await self._calls.run(model, ask, replace(names("texts"), task="/rerank"), head_response_bytes,
                                    deadline.remaining())
        assert ran.scores is not None and ran.ranking is not None
        scores = ran.scores
        chars = characters(call.texts) + len(call.query) * len(call.texts)
        return json_response([{"index": i, "score": scores[i], **({"text": call.texts[i]} if call.return_text else {})}
                              for i in ran.ranking], headers=Timing.of(ran, chars, started).headers())

    async def _predict(self, model: Model, call: PredictCall, started: float) -> web.StreamResponse:
        ask = Ask(inputs=call.inputs, return_hidden=False, task="classify", truncate=call.truncate,
                  truncation_side=call.side, raw_scores=call.raw_scores)
        ran = await self._calls.run(model, ask, replace(names("inputs"), task="/predict"), head_response_bytes,
                                    deadline.remaining())
        assert ran.labels is not None
        out = [predictions(model.spec.labels, scores.tolist()) for scores in ran.labels]
        return json_response(out if call.batch else out[0], headers=_headers(ran, call.inputs, started))

    # -- tokens, info, health ----------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        texts, prompt, specials = await self._read(request, lambda body: decode_tokenize(body, self._config))
        model = self._calls.model()
        encoded = await self._calls.tokenize(model, texts, field="inputs", truncate=False, prompt_name=prompt,
                                             specials=specials)
        special = special_token_ids(model.spec)
        return await json_answer([tokens(enc.ids.tolist(), enc.tokens, special) for enc in encoded],
                                 sum(4 * len(enc.ids) for enc in encoded))

    async def decode(self, request: web.Request) -> web.StreamResponse:
        spec = self._calls.model().spec
        rows, skip = await self._read(request, lambda body: decode_decode(body, self._config, spec.vocab_size))
        return await json_answer(await decode_rows(spec, rows, skip), sum(len(row) for row in rows))

    async def info(self, request: web.Request) -> web.StreamResponse:
        return json_response(info(self._calls.model().spec, self._config))

    async def health(self, request: web.Request) -> web.StreamResponse:
        self._calls.serving.require_serving()
        return web.Response(status=200)


def _headers(ran: Ran, inputs: Sequence[Any], started: float) -> dict[str, str]:
    return Timing.of(ran, characters(inputs), started).headers()
