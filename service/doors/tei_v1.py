"""tei.v1 over gRPC: Text Embeddings Inference's five services (Info, Embed, Predict, Rerank, Tokenize), on the
gRPC port beside attention.v1 and KServe v2, wire-compatible with TEI 1.9.3's proto (proto/tei/v1/tei.proto).
Each handler parses its request, decodes it into an `Ask`, runs it on the shared call layer
(service/doors/calls.py `Calls.run`) and encodes the `Ran` with TEI's `Metadata` (service/doors/tei_wire.py).

As TEI's gRPC server does: `truncate` is the request's own (TEI's --auto-truncate is "unused for gRPC servers"),
`normalize` unset is true, an empty `inputs` is embedded; a bidirectional stream answers each request in
the order sent and ends with the status of the first request that fails; RerankStream ranks every (query,
text) pair it was sent, each against its own query, once the stream ends (`raw_scores` and `return_text` from
the first request). Statuses are this service's one table's (service/errors.py): INVALID_ARGUMENT for bad
input (a task the model has no head for too: TEI says FAILED_PRECONDITION), RESOURCE_EXHAUSTED overloaded,
UNAVAILABLE not ready, INTERNAL a model failure (TEI: FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from proto.tei.v1 import tei_pb2 as pb
from service.doors.calls import Calls, Model, Ran
from service.doors.rpc import Rpc, grpc_status, parse, remaining, serialize
from service.doors.tei_wire import Timing, decode_rows, info, max_input_length, model_type, special_token_ids
from service.errors import EmptyInput, InvalidInput, ServiceError
from service.jobs import ModelSpec
from service.plan import Ask, Names, Plan, Sizes, head_response_bytes
from service.tasks import sparse_entries

PACKAGE = "tei.v1"
NAMES = Names(sequences="inputs", sequence="inputs", element="inputs[{j}]", texts="inputs", output="inputs",
              pooling="inputs", normalize="normalize", dtype="inputs", prompt_name="prompt_name",
              long_inputs="truncate", chunk_stride="truncate", dimensions="dimensions", query="query",
              top_n="texts", sparse="EmbedSparse")
PREDICT = replace(NAMES, task="Predict")
RERANK = replace(NAMES, sequences="texts", sequence="texts[{i}]", element="texts[{i}][{j}]", texts="texts",
                 task="Rerank")
_SIDES: dict[int, str] = {pb.TRUNCATION_DIRECTION_RIGHT: "right", pb.TRUNCATION_DIRECTION_LEFT: "left"}
_MODEL_TYPES = {"embedding": pb.MODEL_TYPE_EMBEDDING, "classifier": pb.MODEL_TYPE_CLASSIFIER,
                "reranker": pb.MODEL_TYPE_RERANKER}
Work = Callable[[Any, float], Awaitable[Any]]


def _side(value: int) -> str:
    if value not in _SIDES:
        raise InvalidInput("truncation_direction", f"must be TRUNCATION_DIRECTION_RIGHT or _LEFT; got {value}")
    return _SIDES[value]


def response_bytes(plan: Plan, spec: ModelSpec) -> Sizes:
    """An embedding call's response, bounded from above: 5 bytes a float (a packed float, a token's tag and
    length), 8 an entry of a sparse vector, and the metadata."""
    pooled = plan.pooled_size(spec.d_model)[0]
    values = sum((job.length * (spec.d_model + 2) if job.return_hidden else 0) + (pooled if job.pooling else 0)
                 for job in plan.sequences)
    entries = spec.vocab_size * sum(job.head == "sparse" for job in plan.sequences)
    return Sizes(0, 5 * values + 12 * entries + 128)


def label(service: str, method: str) -> str:
    """An RPC's `method` label in attention_requests_total: "tei.v1.Rerank/Rerank"."""
    return f"{PACKAGE}.{service}/{method}"


def metadata(timing: Timing) -> pb.Metadata:
    def ns(seconds: float) -> int:
        return int(seconds * 1e9)

    return pb.Metadata(compute_chars=timing.chars, compute_tokens=timing.tokens, total_time_ns=ns(timing.total_s),
                       tokenization_time_ns=ns(timing.tokenization_s), queue_time_ns=ns(timing.queue_s),
                       inference_time_ns=ns(timing.inference_s))


def _meta(ran: Ran, chars: int, started: float) -> pb.Metadata:
    return metadata(Timing.of(ran, chars, started))


class Service:
    """One tei.v1 service as a gRPC door: its full name and its handlers (service/doors/grpc_server.py)."""

    def __init__(self, name: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self.SERVICE_NAME = f"{PACKAGE}.{name}"
        self.METHOD_LABEL = label(name, "{method}")  # attention.v1 has a Rerank and a Tokenize too
        self._handlers = dict(handlers)

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(self.SERVICE_NAME, self._handlers)


class TeiV1:
    """The five services' calls: decode -> run -> encode (module docstring). `services()` are the doors."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._rpc = Rpc(calls, "tei.v1", "tei.v1")  # five services: each method named "tei.v1.<Service>/<Method>"
        self._config = calls.config

    def services(self) -> list[Service]:
        unary, stream = self._unary, self._stream
        return [
            Service("Info", {"Info": unary("Info", pb.InfoRequest, self._info)}),
            Service("Embed", {
                "Embed": unary("Embed", pb.EmbedRequest, self._embed),
                "EmbedStream": stream(label("Embed", "EmbedStream"), pb.EmbedRequest, self._embed),
                "EmbedSparse": unary("EmbedSparse", pb.EmbedSparseRequest, self._embed_sparse),
                "EmbedSparseStream": stream(label("Embed", "EmbedSparseStream"), pb.EmbedSparseRequest,
                                            self._embed_sparse),
                "EmbedAll": unary("EmbedAll", pb.EmbedAllRequest, self._embed_all),
                "EmbedAllStream": stream(label("Embed", "EmbedAllStream"), pb.EmbedAllRequest, self._embed_all)}),
            Service("Predict", {
                "Predict": unary("Predict", pb.PredictRequest, self._predict),
                "PredictPair": unary("PredictPair", pb.PredictPairRequest, self._predict),
                "PredictStream": stream(label("Predict", "PredictStream"), pb.PredictRequest, self._predict),
                "PredictPairStream": stream(label("Predict", "PredictPairStream"), pb.PredictPairRequest,
                                            self._predict)}),
            Service("Rerank", {
                "Rerank": unary("Rerank", pb.RerankRequest, self._rerank),
                "RerankStream": grpc.stream_unary_rpc_method_handler(self._rerank_stream, response_serializer=bytes)}),
            Service("Tokenize", {
                "Tokenize": unary("Tokenize", pb.EncodeRequest, self._tokenize),
                "TokenizeStream": stream(label("Tokenize", "TokenizeStream"), pb.EncodeRequest, self._tokenize),
                "Decode": unary("Decode", pb.DecodeRequest, self._decode),
                "DecodeStream": stream(label("Tokenize", "DecodeStream"), pb.DecodeRequest, self._decode)}),
        ]

    # -- one call each: decode -> run -> encode ----------------------------------------------------

    def _pooling(self, spec: ModelSpec) -> str:
        return "model" if spec.tokenizer is not None else "mean"

    async def _embed(self, request: pb.EmbedRequest, seconds: float) -> pb.EmbedResponse:
        started, model = time.perf_counter(), self._calls.model()
        ask = Ask(inputs=[request.inputs], return_hidden=False, pooling=self._pooling(model.spec),
                  normalize=request.normalize if request.HasField("normalize") else True,
                  truncate=request.truncate, truncation_side=_side(request.truncation_direction),
                  prompt_name=request.prompt_name, dimensions=request.dimensions if request.HasField("dimensions")
                  else None)
        ran = await self._calls.run(model, ask, NAMES, response_bytes, seconds)
        pooled = ran.outputs[0].pooled
        assert pooled is not None
        return pb.EmbedResponse(embeddings=pooled.astype(np.float32, copy=False).tolist(),
                                metadata=_meta(ran, len(request.inputs), started))

    async def _embed_all(self, request: pb.EmbedAllRequest, seconds: float) -> pb.EmbedAllResponse:
        started, model = time.perf_counter(), self._calls.model()
        ask = Ask(inputs=[request.inputs], return_hidden=True, truncate=request.truncate,
                  truncation_side=_side(request.truncation_direction), prompt_name=request.prompt_name)
        ran = await self._calls.run(model, ask, NAMES, response_bytes, seconds)
        hidden = ran.outputs[0].hidden
        assert hidden is not None
        return pb.EmbedAllResponse(token_embeddings=[pb.TokenEmbedding(embeddings=row) for row in
                                                     hidden.astype(np.float32, copy=False).tolist()],
                                   metadata=_meta(ran, len(request.inputs), started))

    async def _embed_sparse(self, request: pb.EmbedSparseRequest, seconds: float) -> pb.EmbedSparseResponse:
        started, model = time.perf_counter(), self._calls.model()
        ask = Ask(inputs=[request.inputs], return_hidden=False, truncate=request.truncate,
                  truncation_side=_side(request.truncation_direction), prompt_name=request.prompt_name,
                  sparse=(0, 0.0))
        ran = await self._calls.run(model, ask, NAMES, response_bytes, seconds)
        indices, values = sparse_entries(ran.logits[0], 0, 0.0)
        return pb.EmbedSparseResponse(
            sparse_embeddings=[pb.SparseValue(index=i, value=v) for i, v in zip(indices.tolist(), values.tolist(),
                                                                                strict=True)],
            metadata=_meta(ran, len(request.inputs), started))

    async def _predict(self, request: pb.PredictRequest | pb.PredictPairRequest, seconds: float) -> pb.PredictResponse:
        started, model = time.perf_counter(), self._calls.model()
        item: str | tuple[str, str]
        if isinstance(request, pb.PredictRequest):
            item = request.inputs
        elif len(request.inputs) in (1, 2):
            item = request.inputs[0] if len(request.inputs) == 1 else (request.inputs[0], request.inputs[1])
        else:
            raise InvalidInput("inputs", f"must hold one text or a pair of texts; got {len(request.inputs)}")
        ask = Ask(inputs=[item], return_hidden=False, task="classify", truncate=request.truncate,
                  truncation_side=_side(request.truncation_direction), raw_scores=request.raw_scores)
        ran = await self._calls.run(model, ask, PREDICT, head_response_bytes, seconds)
        assert ran.labels is not None
        scores = ran.labels[0].tolist()
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        chars = len(item) if isinstance(item, str) else len(item[0]) + len(item[1])
        return pb.PredictResponse(predictions=[pb.Prediction(score=scores[i], label=model.spec.labels[i])
                                               for i in order], metadata=_meta(ran, chars, started))

    async def _rank(self, model: Model, query: str, texts: list[str], truncate: bool, side: str, raw: bool,
                    seconds: float) -> Ran:
        ask = Ask(inputs=texts, return_hidden=False, task="rerank", query=query, truncate=truncate,
                  truncation_side=side, raw_scores=raw)
        return await self._calls.run(model, ask, RERANK, head_response_bytes, seconds)

    async def _rerank(self, request: pb.RerankRequest, seconds: float) -> pb.RerankResponse:
        started, model = time.perf_counter(), self._calls.model()
        if not request.texts:
            raise EmptyInput("texts", "cannot be empty")
        texts = list(request.texts)
        ran = await self._rank(model, request.query, texts, request.truncate, _side(request.truncation_direction),
                               request.raw_scores, seconds)
        assert ran.scores is not None and ran.ranking is not None
        ranks = [pb.Rank(index=i, score=ran.scores[i], text=texts[i] if request.return_text else None)
                 for i in ran.ranking]
        chars = sum(map(len, texts)) + len(request.query) * len(texts)
        return pb.RerankResponse(ranks=ranks, metadata=_meta(ran, chars, started))

    async def _rerank_stream_work(self, requests: AsyncIterator[bytes], seconds: float) -> pb.RerankResponse:
        """Every pair of the stream ranked against its own query: one call per distinct query, side by side."""
        started, model = time.perf_counter(), self._calls.model()
        pairs: list[pb.RerankStreamRequest] = []
        async for raw in requests:
            if len(pairs) == self._config.max_sequences_per_call:
                raise InvalidInput("text", f"a stream of more than {self._config.max_sequences_per_call} texts; "
                                   f"at most max_sequences_per_call")
            pairs.append(await parse(pb.RerankStreamRequest, raw, self._config))
        if not pairs:
            raise EmptyInput("text", "the stream sent nothing to rank")
        first = pairs[0]
        by_query: dict[tuple[str, bool, int], list[int]] = {}
        for i, pair in enumerate(pairs):
            by_query.setdefault((pair.query, pair.truncate, pair.truncation_direction), []).append(i)
        left = seconds - (time.perf_counter() - started)
        runs = await asyncio.gather(*(self._rank(model, query, [pairs[i].text for i in where], truncate, _side(side),
                                                 first.raw_scores, left)
                                      for (query, truncate, side), where in by_query.items()))
        scores: dict[int, float] = {}
        tokens = 0
        for ran, where in zip(runs, by_query.values(), strict=True):
            assert ran.scores is not None
            scores.update(zip(where, ran.scores, strict=True))
            tokens += ran.plan.tokens
        order = sorted(scores, key=lambda i: -scores[i])
        slowest = max(runs, key=lambda ran: ran.batch.queue_s + ran.batch.compute_s)
        timing = Timing.of(slowest, sum(len(p.query) + len(p.text) for p in pairs), started)
        return pb.RerankResponse(
            ranks=[pb.Rank(index=i, score=scores[i], text=pairs[i].text if first.return_text else None) for i in order],
            metadata=metadata(Timing(timing.device, timing.chars, tokens, timing.total_s, timing.tokenization_s,
                                     timing.queue_s, timing.inference_s)))

    async def _rerank_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async def answer() -> bytes:
            return await serialize(await self._rerank_stream_work(requests, remaining(context, self._config)))

        return await self._rpc.answer("RerankStream", context, answer)

    async def _tokenize(self, request: pb.EncodeRequest, seconds: float) -> pb.EncodeResponse:
        model = self._calls.model()
        encoded = (await self._calls.tokenize(model, [request.inputs], field="inputs", truncate=False,
                                              prompt_name=request.prompt_name,
                                              specials=request.add_special_tokens))[0]
        special = special_token_ids(model.spec)
        return pb.EncodeResponse(tokens=[pb.SimpleToken(id=i, text=t, special=i in special)
                                         for i, t in zip(encoded.ids.tolist(), encoded.tokens, strict=True)])

    async def _decode(self, request: pb.DecodeRequest, seconds: float) -> pb.DecodeResponse:
        spec = self._calls.model().spec
        if len(request.ids) > self._config.max_tokens_per_call:
            raise InvalidInput("ids", f"{len(request.ids)} ids; at most {self._config.max_tokens_per_call} per call")
        ids = np.asarray(request.ids, np.int64)
        bad = np.flatnonzero(ids >= spec.vocab_size)
        if len(bad):
            raise InvalidInput(f"ids[{int(bad[0])}]", f"id not in [0, {spec.vocab_size})")
        return pb.DecodeResponse(text=(await decode_rows(spec, [ids.tolist()], request.skip_special_tokens))[0])

    async def _info(self, request: pb.InfoRequest, seconds: float) -> pb.InfoResponse:
        spec = self._calls.model().spec
        fields = info(spec, self._config)
        return pb.InfoResponse(
            version=fields["version"], model_id=fields["model_id"], model_sha=fields["model_sha"],
            model_dtype=fields["model_dtype"], model_type=_MODEL_TYPES[model_type(spec)[0]],
            max_concurrent_requests=fields["max_concurrent_requests"], max_input_length=max_input_length(spec),
            max_batch_tokens=fields["max_batch_tokens"], max_batch_requests=fields["max_batch_requests"],
            max_client_batch_size=fields["max_client_batch_size"],
            tokenization_workers=fields["tokenization_workers"])

    # -- handlers (raw bytes in, raw bytes out) --------------------------------------------------

    def _unary(self, method: str, request_type: Any, work: Work) -> grpc.RpcMethodHandler:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async def answer() -> bytes:
                request = await parse(request_type, raw, self._config)
                return await serialize(await work(request, remaining(context, self._config)))

            return await self._rpc.answer(method, context, answer)

        return grpc.unary_unary_rpc_method_handler(handle, response_serializer=bytes)

    def _stream(self, method: str, request_type: Any, work: Work) -> grpc.RpcMethodHandler:
        """A bidirectional stream (`Rpc.stream`): each request answered in the order of the requests (TEI's
        messages carry no id); the first that fails ends the stream with its status, as TEI's streams end."""
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            async def one(raw: bytes) -> bytes | ServiceError:
                async def answer() -> bytes | ServiceError:
                    request = await parse(request_type, raw, self._config)
                    return await serialize(await work(request, remaining(context, self._config)))

                return await self._rpc.answer_in_stream(method, answer, lambda error: error, context)

            async with contextlib.aclosing(self._rpc.stream(requests, one, ordered=True)) as answers:
                async for answer in answers:
                    if isinstance(answer, ServiceError):
                        await context.abort_with_status(grpc_status(answer))
                    else:
                        yield answer

        return grpc.stream_stream_rpc_method_handler(handle, response_serializer=bytes)
