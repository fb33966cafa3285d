"""Text Embeddings Inference's routes, in TEI's shapes and status codes:

POST /embed      {"inputs", "normalize" (true), "truncate" (false), "truncation_direction" ("right"),
                  "prompt_name", "dimensions"} -> [[float]]
POST /embed_all  {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[[float]]] (token embeddings)
POST /embed_sparse {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[{"index", "value"}]] (SPLADE,
                  the non-zero entries, indices ascending)
POST /tokenize   {"inputs", "add_special_tokens" (true), "prompt_name"} -> [[{"id", "text", "special",
                  "start", "stop"}]] (start/stop: null, offsets are not kept)
POST /decode     {"ids", "skip_special_tokens" (true)} -> [str]
POST /rerank     {"query", "texts", "truncate" (false), "raw_scores" (false), "return_text" (false),
                  "truncation_direction", "top_n" (ours; all)} -> [{"index", "score"[, "text"]}], highest first
POST /predict    {"inputs": "text" | ["first", "second"] (one pair) | [["text"] or ["first", "second"], ...],
                  "truncate", "raw_scores", "truncation_direction"} -> [{"score", "label"}] (highest first) for one
                  input, [[...]] for a batch
GET  /info, GET /health

Errors: {"error", "error_type"}; 413 more inputs than max_sequences_per_call, or a body over
max_message_bytes; 422 invalid input; 424 a model failure; 429 overloaded (Retry-After); 503 not
ready or draining. `truncation_direction` other than the bundle's own side is refused (422).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from aiohttp import web

from model.text import special_ids
from service.config import ServiceConfig
from service.doors.calls import Calls
from service.doors.http import deadline
from service.doors.http.inputs import Inputs, decode_inputs, json_size, names, pooled, pooled_ask
from service.doors.http.wire import (
    Dialect,
    Route,
    Routes,
    json_answer,
    json_object,
    json_response,
    known_fields,
    optional,
    read_json,
    text_values,
)
from service.errors import InvalidInput, ServiceError, TooLarge, status_of
from service.jobs import ModelSpec
from service.plan import Ask, head_response_bytes
from service.tasks import sparse_entries

SERVER_VERSION = "0.1.0"  # pyproject.toml's
INLINE_IDS = 4096  # /decode of more ids runs in a worker thread

EMBED = frozenset({"inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions"})
EMBED_ALL = frozenset({"inputs", "truncate", "truncation_direction", "prompt_name"})
TOKENIZE = frozenset({"inputs", "add_special_tokens", "prompt_name"})
DECODE = frozenset({"ids", "skip_special_tokens"})
RERANK = frozenset({"query", "texts", "truncate", "raw_scores", "return_text", "truncation_direction", "top_n"})
PREDICT = frozenset({"inputs", "truncate", "raw_scores", "truncation_direction"})
_ERROR_TYPES = {"INVALID_ARGUMENT": "validation", "FAILED_PRECONDITION": "validation", "NOT_FOUND": "validation",
                "RESOURCE_EXHAUSTED": "overloaded", "UNAVAILABLE": "unhealthy", "DEADLINE_EXCEEDED": "backend",
                "UNAUTHENTICATED": "validation", "INTERNAL": "backend", "CANCELLED": "backend"}


def error_body(error: ServiceError, status: int) -> dict[str, Any]:
    return {"error": error.message, "error_type": _ERROR_TYPES.get(status_of(error), "backend")}


DIALECT = Dialect("tei", error_body, invalid=422, internal=424)


@dataclass(frozen=True)
class EmbedCall:
    inputs: Inputs
    normalize: bool
    truncate: bool
    prompt_name: str
    dimensions: int | None


def _inputs(body: dict[str, Any], config: ServiceConfig) -> Inputs:
    if "inputs" not in body:
        raise InvalidInput("inputs", "required")
    return decode_inputs(body["inputs"], "inputs", max_inputs=config.max_sequences_per_call,
                         max_ids=config.max_tokens_per_call, too_many=TooLarge)


def _direction(body: dict[str, Any], side: str) -> None:
    direction = optional(body, "truncation_direction", str, side, "\"right\" or \"left\"")
    if direction.lower() not in ("right", "left"):
        raise InvalidInput("truncation_direction", "must be \"right\" or \"left\"")
    if direction.lower() != side:
        raise InvalidInput("truncation_direction", f"this model truncates on the {side} only")


def decode_embed(body: Any, config: ServiceConfig, *, side: str, all_tokens: bool = False) -> EmbedCall:
    body = json_object(body)
    known_fields(body, EMBED_ALL if all_tokens else EMBED)
    inputs = _inputs(body, config)
    truncate = optional(body, "truncate", bool, False, "a boolean")
    _direction(body, side)
    prompt = optional(body, "prompt_name", str, "", "a string")
    normalize = optional(body, "normalize", bool, True, "a boolean")
    dims = optional(body, "dimensions", int, None, "an integer")  # its range: the plan's check
    return EmbedCall(inputs, normalize, truncate, prompt, dims)


def decode_tokenize(body: Any, config: ServiceConfig) -> tuple[list[str], str]:
    body = json_object(body)
    known_fields(body, TOKENIZE)
    inputs = _inputs(body, config)
    if not all(isinstance(x, str) for x in inputs):
        raise InvalidInput("inputs", "must be a string or an array of strings")
    if not optional(body, "add_special_tokens", bool, True, "a boolean"):
        raise InvalidInput("add_special_tokens", "false is not supported: the model's special tokens are always added")
    return [str(x) for x in inputs], optional(body, "prompt_name", str, "", "a string")


def decode_decode(body: Any, config: ServiceConfig, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The ids to decode: at most max_sequences_per_call rows and max_tokens_per_call ids, checked first."""
    body = json_object(body)
    known_fields(body, DECODE)
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


def decode_rerank(body: Any, config: ServiceConfig, *, side: str) -> RerankCall:
    body = json_object(body)
    known_fields(body, RERANK)
    if "query" not in body:
        raise InvalidInput("query", "required")
    query = optional(body, "query", str, "", "a string")
    texts = body.get("texts")
    if not isinstance(texts, list):
        raise InvalidInput("texts", "required: an array of strings")
    max_inputs = config.max_sequences_per_call
    if len(texts) > max_inputs:
        raise TooLarge("texts", f"batch size {len(texts)} > maximum allowed batch size {max_inputs}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInput(f"texts[{i}]", "must be a string")
    _direction(body, side)
    top_n = optional(body, "top_n", int, None, "an integer")
    return RerankCall(query, texts, top_n, optional(body, "return_text", bool, False, "a boolean"),
                      optional(body, "raw_scores", bool, False, "a boolean"),
                      optional(body, "truncate", bool, False, "a boolean"))


@dataclass(frozen=True)
class PredictCall:
    inputs: list[str | tuple[str, str]]
    batch: bool  # a batch answers a list per input; a single input its list alone
    raw_scores: bool
    truncate: bool


def _sequence(value: Any, field: str) -> str | tuple[str, str] | None:
    """A text, ["text"] or ["first", "second"]; None if it is none of these."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and 1 <= len(value) <= 2 and all(isinstance(v, str) for v in value):
        return value[0] if len(value) == 1 else (value[0], value[1])
    return None


def decode_predict(body: Any, config: ServiceConfig, *, side: str) -> PredictCall:
    body = json_object(body)
    known_fields(body, PREDICT)
    if "inputs" not in body:
        raise InvalidInput("inputs", "required")
    value = body["inputs"]
    max_inputs = config.max_sequences_per_call
    single = _sequence(value, "inputs")
    if single is not None and not (isinstance(value, list) and len(value) == 1):
        inputs, batch = [single], False  # "text", or ["first", "second"]: one pair, as TEI reads it
    elif isinstance(value, list):
        if len(value) > max_inputs:
            raise TooLarge("inputs", f"batch size {len(value)} > maximum allowed batch size {max_inputs}")
        inputs = []
        for i, item in enumerate(value):
            one = _sequence(item, f"inputs[{i}]")
            if one is None:
                raise InvalidInput(f"inputs[{i}]", "must be a string, [\"text\"] or [\"first\", \"second\"]")
            inputs.append(one)
        batch = True
    else:
        raise InvalidInput("inputs", "must be a string, a pair of strings, or an array of them")
    _direction(body, side)
    return PredictCall(inputs, batch, optional(body, "raw_scores", bool, False, "a boolean"),
                       optional(body, "truncate", bool, False, "a boolean"))


def predictions(labels: Sequence[str], scores: Sequence[float]) -> list[dict[str, Any]]:
    """One input's [{"score", "label"}], highest score first (TEI's order)."""
    order = sorted(range(len(labels)), key=lambda i: -scores[i])
    return [{"score": float(scores[i]), "label": labels[i]} for i in order]


def sparse(indices: np.ndarray, values: np.ndarray) -> list[dict[str, Any]]:
    """One input's /embed_sparse entries."""
    return [{"index": int(i), "value": float(v)} for i, v in zip(indices.tolist(), values.tolist(), strict=True)]


def _side(spec: ModelSpec) -> str:
    return spec.tokenizer.settings.truncation_side if spec.tokenizer is not None else "right"


class TEI:
    """The dialect's routes over the shared call layer: decode -> run -> encode. A body is read, parsed and
    decoded (its counts checked first) in a worker thread when it is big (service/doors/http/wire.py)."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._config = calls.config
        self._values = text_values(calls.config)
        self._special: dict[int, frozenset[int]] = {}

    def routes(self) -> Routes:
        return Routes(DIALECT, "/", [
            Route("POST", "/embed", self.embed), Route("POST", "/embed_all", self.embed_all),
            Route("POST", "/embed_sparse", self.embed_sparse), Route("POST", "/tokenize", self.tokenize),
            Route("POST", "/decode", self.decode), Route("POST", "/rerank", self.rerank),
            Route("POST", "/predict", self.predict), Route("GET", "/info", self.info),
            Route("GET", "/health", self.health, health=True)])

    async def _read(self, request: web.Request, decode: Callable[[Any], Any]) -> Any:
        return await read_json(request, self._config, self._values, decode)

    async def embed(self, request: web.Request) -> web.StreamResponse:
        model = self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config, side=_side(model.spec)))
        ask = pooled_ask(model.spec, call.inputs, normalize=call.normalize, truncate=call.truncate,
                         prompt_name=call.prompt_name, dimensions=call.dimensions)
        ran = await self._calls.run(model, ask, names("inputs"), json_size, deadline.remaining())
        vectors = pooled(ran)
        return await json_answer(vectors, sum(v.size for v in vectors))

    async def embed_all(self, request: web.Request) -> web.StreamResponse:
        model = self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config, side=_side(model.spec),
                                                                   all_tokens=True))
        ask = pooled_ask(model.spec, call.inputs, normalize=None, truncate=call.truncate,
                         prompt_name=call.prompt_name, hidden=True)
        ran = await self._calls.run(model, ask, names("inputs"), json_size, deadline.remaining())
        hidden = pooled(ran)
        return await json_answer(hidden, sum(h.size for h in hidden))

    async def embed_sparse(self, request: web.Request) -> web.StreamResponse:
        model = self._calls.model()
        call = await self._read(request, lambda body: decode_embed(body, self._config, side=_side(model.spec),
                                                                   all_tokens=True))
        ask = pooled_ask(model.spec, call.inputs, normalize=None, truncate=call.truncate,
                         prompt_name=call.prompt_name, sparse=True)
        ran = await self._calls.run(model, ask, replace(names("inputs"), sparse="/embed_sparse"), json_size,
                                    deadline.remaining())
        entries = [sparse_entries(x, 0, 0.0) for x in ran.logits]
        return await json_answer([sparse(*e) for e in entries], sum(2 * len(e[0]) for e in entries))

    def _specials(self, spec: ModelSpec) -> frozenset[int]:
        if spec.tokenizer is None:
            return frozenset()
        key = id(spec.tokenizer)
        if key not in self._special:
            self._special[key] = frozenset(special_ids(spec.tokenizer.data).values())
        return self._special[key]

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        texts, prompt = await self._read(request, lambda body: decode_tokenize(body, self._config))
        model = self._calls.model()
        encoded = await self._calls.tokenize(model, texts, field="inputs", truncate=False, prompt_name=prompt)
        special = self._specials(model.spec)
        return await json_answer([tokens(enc.ids.tolist(), enc.tokens, special) for enc in encoded],
                                 sum(4 * len(enc.ids) for enc in encoded))

    async def decode(self, request: web.Request) -> web.StreamResponse:
        spec = self._calls.model().spec
        rows, skip = await self._read(request, lambda body: decode_decode(body, self._config, spec.vocab_size))
        tokenizer = spec.tokenizer
        if tokenizer is None:
            raise InvalidInput("ids", f"model {spec.name} has no tokenizer to decode with")
        ids = sum(len(row) for row in rows)
        if ids > INLINE_IDS:  # the Rust tokenizer releases the GIL
            texts = await asyncio.to_thread(tokenizer.decode, rows, skip_special_tokens=skip)
        else:
            texts = tokenizer.decode(rows, skip_special_tokens=skip)
        return await json_answer(texts, ids)

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        model = self._calls.model()
        call = await self._read(request, lambda body: decode_rerank(body, self._config, side=_side(model.spec)))
        ask = Ask(inputs=call.texts, return_hidden=False, task="rerank", query=call.query, top_n=call.top_n,
                  truncate=call.truncate, raw_scores=call.raw_scores)
        ran = await self._calls.run(model, ask, replace(names("texts"), task="/rerank"), head_response_bytes,
                                    deadline.remaining())
        assert ran.scores is not None and ran.ranking is not None
        scores = ran.scores
        return json_response([{"index": i, "score": scores[i], **({"text": call.texts[i]} if call.return_text else {})}
                              for i in ran.ranking])

    async def predict(self, request: web.Request) -> web.StreamResponse:
        model = self._calls.model()
        call = await self._read(request, lambda body: decode_predict(body, self._config, side=_side(model.spec)))
        ask = Ask(inputs=call.inputs, return_hidden=False, task="classify", truncate=call.truncate,
                  raw_scores=call.raw_scores)
        ran = await self._calls.run(model, ask, replace(names("inputs"), task="/predict"), head_response_bytes,
                                    deadline.remaining())
        assert ran.labels is not None
        out = [predictions(model.spec.labels, scores.tolist()) for scores in ran.labels]
        return json_response(out if call.batch else out[0])

    async def info(self, request: web.Request) -> web.StreamResponse:
        spec, c = self._calls.model().spec, self._config
        settings = spec.tokenizer.settings if spec.tokenizer is not None else None
        return json_response({
            "model_id": spec.name, "model_sha": spec.checksum, "model_dtype": spec.precision,
            "model_type": {"embedding": {"pooling": settings.pooling if settings is not None else "mean"}},
            "max_concurrent_requests": c.max_queue_requests,
            "max_input_length": settings.max_tokens if settings is not None else spec.max_length,
            # max_batch_tokens: the one in force (measured at warm-up or configured)
            "max_batch_tokens": spec.max_batch_tokens, "max_batch_requests": c.max_batch_size,
            "max_client_batch_size": c.max_sequences_per_call, "auto_truncate": False, "tokenization_workers": 1,
            "version": SERVER_VERSION, "sha": None, "docker_label": None})

    async def health(self, request: web.Request) -> web.StreamResponse:
        self._calls.serving.require_serving()
        return web.Response(status=200)
