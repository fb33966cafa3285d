"""attention.v1.AttentionService: its messages -> an `Ask` (service/plan.py) -> the plan -> the outputs as
its messages. Nothing else: admission, waiting and every call's outcome are service/doors/calls.py's,
shared with every other front door.

Handlers take raw request bytes and parse them here, so that a malformed message is answered
INVALID_ARGUMENT instead of grpcio's UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import (
    FLOAT_DTYPES,
    INT_DTYPES,
    SERVICE_NAME,
    TensorError,
    dtype_name,
    fill_tensor,
    from_tensor,
)
from service.batching import Done
from service.config import ServiceConfig
from service.doors.calls import Calls, parse, public, remaining
from service.errors import InvalidInput, NonFiniteInput, ServiceError, status_of
from service.jobs import ModelSpec, Output
from service.metrics import Metrics
from service.output_range import check_representable
from service.plan import (
    INLINE_CHARS,
    MAX_REQUEST_ID,
    Ask,
    Names,
    Plan,
    check_count,
    head_response_bytes,
    plan,
    plan_call,
    response_bytes,
    tokenize,
)
from service.tasks import label_scores, ranked, rerank_scores, sparse_entries

NAMES = Names()  # the plan's default names are this door's
_DTYPE = {pb.DTYPE_UNSPECIFIED: "float32", pb.DTYPE_FLOAT32: "float32", pb.DTYPE_FLOAT16: "float16",
          pb.DTYPE_BFLOAT16: "bfloat16"}
_WIRE_DTYPE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16}
_POOLING = {pb.POOLING_NONE: "none", pb.POOLING_MEAN: "mean", pb.POOLING_CLS: "cls", pb.POOLING_MODEL: "model"}
_HEADS = {pb.HEADS_ALL: "all", pb.HEADS_MEAN: "mean"}
_QUANTIZATION = {pb.QUANTIZATION_NONE: "none", pb.QUANTIZATION_INT8: "int8", pb.QUANTIZATION_UINT8: "uint8",
                 pb.QUANTIZATION_BINARY: "binary", pb.QUANTIZATION_UBINARY: "ubinary"}
_QUANTIZED_DTYPE = {"int8": pb.DTYPE_INT8, "uint8": pb.DTYPE_UINT8}
_LONG = {pb.LONG_INPUTS_UNSPECIFIED: None, pb.LONG_INPUTS_ERROR: "error", pb.LONG_INPUTS_TRUNCATE: "truncate",
         pb.LONG_INPUTS_CHUNK: "chunk"}


class AttentionServicer:
    def __init__(self, calls: Calls, metrics: Metrics) -> None:
        self._calls = calls
        self._config = calls.config
        self._metrics = metrics

    # -- handlers (raw bytes in, raw bytes out) --------------------------------------------------

    async def encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = parse(pb.EncodeRequest, raw)
            response = await self._encode(request, remaining(context, self._config))
            data: bytes = response.SerializeToString()
            return data

        return await self._calls.answer("Encode", context, work)

    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            parse(pb.GetModelInfoRequest, raw)
            data: bytes = self._model_info().SerializeToString()
            return data

        return await self._calls.answer("GetModelInfo", context, work)

    async def tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = parse(pb.TokenizeRequest, raw)
            if sum(len(t) for t in request.texts) > INLINE_CHARS:
                response = await asyncio.to_thread(self._tokenize, request)  # beside the loop, as _encode does
            else:
                response = self._tokenize(request)
            data: bytes = response.SerializeToString()
            return data

        return await self._calls.answer("Tokenize", context, work)

    async def classify(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = parse(pb.ClassifyRequest, raw)
            data: bytes = (await self._classify(request, remaining(context, self._config))).SerializeToString()
            return data

        return await self._calls.answer("Classify", context, work)

    async def rerank(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = parse(pb.RerankRequest, raw)
            data: bytes = (await self._rerank(request, remaining(context, self._config))).SerializeToString()
            return data

        return await self._calls.answer("Rerank", context, work)

    async def encode_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """One response per request, in completion order, flow-controlled (`Calls.stream`); a failed
        request answers with `error` set."""
        async def one(raw: bytes) -> bytes:
            request_id = ""

            async def work() -> bytes:
                nonlocal request_id
                request = parse(pb.EncodeRequest, raw)
                if len(request.request_id) <= MAX_REQUEST_ID:  # echoed in a refusal too: never a long one
                    request_id = request.request_id
                data: bytes = (await self._encode(request, remaining(context, self._config))).SerializeToString()
                return data

            return await self._calls.answer_in_stream(
                "EncodeStream", work, lambda error: _stream_error(request_id, error).SerializeToString())

        async with contextlib.aclosing(self._calls.stream(requests, one)) as responses:
            async for response in responses:
                yield response

    # -- the call ---------------------------------------------------------------------------------

    async def _encode(self, request: pb.EncodeRequest, seconds: float) -> pb.EncodeResponse:
        spec, _ = self._calls.serving.require_ready()
        try:
            plan = await plan_call(ask_of(request, spec, self._config), spec, self._config, NAMES, response_bytes)
        except NonFiniteInput:
            self._metrics.nonfinite_inputs.inc()
            raise
        done = await self._calls.compute(plan.jobs, seconds)
        outputs = plan.finish([d.output for d in done])
        check_representable(outputs, plan.output_dtype, plan.attention_dtype)
        return _response(plan, done, outputs, spec)

    async def _heads(self, ask: Ask, names: Names, seconds: float) -> tuple[Plan, list[Done], ModelSpec]:
        """A head task's call planned and computed (service/plan.py plan_head): the plan, every job's Done."""
        spec, _ = self._calls.serving.require_ready()
        plan = await plan_call(ask, spec, self._config, names, head_response_bytes)
        done = await self._calls.compute(plan.jobs, seconds)
        check_representable([d.output for d in done], plan.output_dtype, plan.attention_dtype)
        return plan, done, spec

    async def _classify(self, request: pb.ClassifyRequest, seconds: float) -> pb.ClassifyResponse:
        if request.texts and request.pairs:
            raise InvalidInput("pairs", "give texts or pairs, not both")
        field = "pairs" if request.pairs else "texts"
        check_count(len(request.pairs or request.texts), self._config, field)
        inputs: list[str | tuple[str, str]] = (
            [(p.first, p.second) for p in request.pairs] if request.pairs else list(request.texts))
        attention, heads, attention_dtype = _attention(request.attention)
        ask = Ask(inputs=inputs, request_id=request.request_id, return_hidden=False, task="classify",
                  truncate=request.truncate, attention=attention, heads=heads, attention_dtype=attention_dtype)
        names = Names(sequences=field, sequence=field + "[{i}]", texts=field, task="Classify")
        plan, done, spec = await self._heads(ask, names, seconds)
        response = pb.ClassifyResponse(request_id=plan.request_id)
        _metadata(response.metadata, done, spec)
        wire = _WIRE_DTYPE[plan.attention_dtype]
        for job, d, text in zip(plan.jobs, done, plan.texts, strict=True):
            assert d.output.scores is not None and text is not None
            scores = label_scores(d.output.scores, spec.problem_type, request.raw_scores)
            result = response.results.add(token_count=job.length, truncated=text.truncated)
            for label, score in zip(spec.labels, scores.tolist(), strict=True):
                result.scores.add(label=label, score=score)
            if d.output.attention is not None:
                fill_tensor(result.attention, d.output.attention, wire)
        return response

    async def _rerank(self, request: pb.RerankRequest, seconds: float) -> pb.RerankResponse:
        check_count(len(request.texts), self._config, "texts", "texts")
        attention, heads, attention_dtype = _attention(request.attention)
        ask = Ask(inputs=list(request.texts), request_id=request.request_id, return_hidden=False, task="rerank",
                  query=request.query, top_n=request.top_n if request.HasField("top_n") else None,
                  truncate=request.truncate, attention=attention, heads=heads, attention_dtype=attention_dtype)
        names = Names(sequences="texts", sequence="texts[{i}]", texts="texts", task="Rerank")
        plan, done, spec = await self._heads(ask, names, seconds)
        response = pb.RerankResponse(request_id=plan.request_id)
        _metadata(response.metadata, done, spec)
        logits = [d.output.scores for d in done]
        assert all(x is not None for x in logits), "a head's scores are missing. This is a bug."
        scores = rerank_scores([x for x in logits if x is not None], request.raw_scores)
        wire = _WIRE_DTYPE[plan.attention_dtype]
        for i in ranked(scores, plan.top_n):
            text = plan.texts[i]
            assert text is not None
            result = response.results.add(index=i, score=scores[i], token_count=plan.jobs[i].length,
                                          truncated=text.truncated)
            if request.return_text:
                result.text = request.texts[i]
            attention_out = done[i].output.attention
            if attention_out is not None:
                fill_tensor(result.attention, attention_out, wire)
        return response

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """Encode's own tokenization (service/validation.py `tokenize`: limits, prompt, truncation, errors)."""
        spec, _ = self._calls.serving.require_ready()
        n = len(request.texts)
        check_count(n, self._config, "texts", "texts")
        encoded = tokenize(request.texts, spec, self._config, fields=[f"texts[{i}]" for i in range(n)],
                           truncate=request.truncate, prompt_name=request.prompt_name, all_field="texts",
                           prompt_field="prompt_name")
        response = pb.TokenizeResponse()
        for enc in encoded:
            text = response.texts.add(token_count=len(enc.ids), truncated=enc.truncated, tokens=enc.tokens)
            text.ids.extend(enc.ids.tolist())
        return response

    def _model_info(self) -> pb.ModelInfo:
        spec, _ = self._calls.serving.require_ready()
        c = self._config
        info = pb.ModelInfo(
            name=spec.name, version=spec.version, checksum=spec.checksum, d_model=spec.d_model,
            n_heads=spec.n_heads, n_layers=spec.n_layers, vocab_size=spec.vocab_size, max_length=spec.max_length,
            positional=spec.positional, precision=spec.precision, device=spec.device,
            attention_scale=spec.attention_scale, standard_scale=spec.standard_scale, relative_bias=spec.relative_bias,
            precision_reason=spec.precision_reason, precision_forward_ms=spec.precision_forward_ms,
            batch_budget=pb.BatchBudget(max_batch_tokens=spec.max_batch_tokens, reason=spec.batch_reason,
                                        tokens_per_second=spec.batch_curve, model_workers=spec.model_workers,
                                        workers_reason=spec.workers_reason, compared_workers=spec.compared_workers,
                                        compared_tokens_per_second=spec.compared_curve),
            quantization_ranges=_ranges(spec.quantization_ranges),
            tasks=spec.tasks, labels=spec.labels, backend=spec.backend,
            limits=pb.Limits(
                max_sequences_per_call=c.max_sequences_per_call, max_tokens_per_call=c.max_tokens_per_call,
                max_message_bytes=c.max_message_bytes, max_attention_bytes=c.max_attention_bytes,
            ),
        )
        if spec.tokenizer is not None:
            t = spec.tokenizer.settings
            info.text.CopyFrom(pb.TextInfo(
                accepted=True, max_tokens=t.max_tokens, truncation_side=t.truncation_side,
                default_pooling=pb.POOLING_MEAN if t.pooling == "mean" else pb.POOLING_CLS,
                default_normalize=t.normalize, prompts=t.prompts, default_prompt_name=t.default_prompt_name,
                tokenizer_checksum=t.tokenizer_sha256, max_text_chars=c.max_text_chars,
            ))
        return info

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        serialize: Any = bytes
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Encode": grpc.unary_unary_rpc_method_handler(self.encode, response_serializer=serialize),
            "EncodeStream": grpc.stream_stream_rpc_method_handler(self.encode_stream, response_serializer=serialize),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self.get_model_info, response_serializer=serialize),
            "Tokenize": grpc.unary_unary_rpc_method_handler(self.tokenize, response_serializer=serialize),
            "Classify": grpc.unary_unary_rpc_method_handler(self.classify, response_serializer=serialize),
            "Rerank": grpc.unary_unary_rpc_method_handler(self.rerank, response_serializer=serialize),
        })


def _ranges(ranges: tuple[tuple[float, ...], tuple[float, ...]] | None) -> pb.QuantizationRanges | None:
    return None if ranges is None else pb.QuantizationRanges(min=ranges[0], max=ranges[1])


def _stream_error(request_id: str, error: ServiceError) -> pb.EncodeResponse:
    """A failed EncodeStream request's answer: the same code and message a unary call would get."""
    return pb.EncodeResponse(request_id=request_id, error=pb.StreamError(
        code=status_of(error), message=public(error.message), field=public(getattr(error, "field", ""))))


def _attention(att: pb.AttentionOptions) -> tuple[tuple[int, ...] | None, str, str]:
    """A head call's AttentionOptions as the plan's (layers or None, heads, dtype), checked as Encode's."""
    for value, table, field in ((att.dtype, _DTYPE, "attention.dtype"), (att.heads, _HEADS, "attention.heads")):
        if value not in table:
            raise InvalidInput(field, f"must be FLOAT32, FLOAT16 or BFLOAT16; got {dtype_name(value)}"
                               if table is _DTYPE else f"unknown value {value}")
    if att.layers and not att.return_attention:
        raise InvalidInput("attention.layers", "given, but return_attention is false")
    return (tuple(att.layers) if att.return_attention else None), _HEADS[att.heads], _DTYPE[att.dtype]


def _metadata(m: pb.ResponseMetadata, done: Sequence[Done], spec: ModelSpec) -> None:
    """A head call's ResponseMetadata: the widest batch that carried one of its sequences, as Encode's."""
    widest = max(done, key=lambda d: d.batch_size)
    m.queue_us, m.compute_us = int(max(d.queue_s for d in done) * 1e6), int(max(d.compute_s for d in done) * 1e6)
    m.batch_size, m.padded_length = widest.batch_size, widest.padded_length
    m.fp32_retry = any(d.output.fp32_rerun for d in done)
    m.precision, m.device, m.model_name, m.model_version = spec.precision, spec.device, spec.name, spec.version


def _response(plan: Plan, done: Sequence[Done], outputs: Sequence[Output], spec: ModelSpec) -> pb.EncodeResponse:
    """`done`: every job's (a chunked sequence's windows each); `outputs`: one per sequence of the call."""
    if len(done) == 1:  # the common call: no scans over the results
        widest = done[0]
        queue_s, compute_s, fp32_retry = widest.queue_s, widest.compute_s, widest.output.fp32_rerun
    else:
        widest = max(done, key=lambda d: d.batch_size)
        queue_s, compute_s = max(d.queue_s for d in done), max(d.compute_s for d in done)
        fp32_retry = any(d.output.fp32_rerun for d in done)
    response = pb.EncodeResponse(request_id=plan.request_id)
    # Set in place: building a ResponseMetadata and then the response from it copies it once more.
    m = response.metadata
    m.queue_us, m.compute_us = int(queue_s * 1e6), int(compute_s * 1e6)
    m.batch_size, m.padded_length, m.fp32_retry = widest.batch_size, widest.padded_length, fp32_retry
    m.precision, m.device, m.model_name, m.model_version = spec.precision, spec.device, spec.name, spec.version
    sequences = plan.sequences
    output_dtype, attention_dtype = _WIRE_DTYPE[plan.output_dtype], _WIRE_DTYPE[plan.attention_dtype]
    quantized = plan.vectors.dtype if plan.vectors is not None else None
    pooled_dtype = output_dtype if quantized is None else _QUANTIZED_DTYPE[quantized]
    for i, out in enumerate(outputs):
        # Filled in place: building submessages and then the response from them copies every tensor twice.
        text = plan.texts[i] if plan.texts else None
        chunk = plan.chunks[i] if plan.chunks else None
        seq = response.outputs.add(nonfinite=out.fp32_rerun, token_count=sequences[i].length, truncated=plan.cut(i),
                                   windows=len(chunk.starts) if chunk is not None else 0)
        if text is not None and plan.return_tokens:
            fill_tensor(seq.token_ids, text.ids, pb.DTYPE_INT64)
            seq.tokens.extend(text.tokens)
        if out.hidden is not None:
            fill_tensor(seq.hidden, out.hidden, output_dtype)
        if out.pooled is not None:
            fill_tensor(seq.pooled, out.pooled, pooled_dtype)
        if out.attention is not None:
            fill_tensor(seq.attention, out.attention, attention_dtype)
        if plan.sparse is not None and out.scores is not None:
            indices, values = sparse_entries(out.scores, *plan.sparse)
            seq.sparse.indices.extend(indices.tolist())
            seq.sparse.values.extend(values.tolist())
    return response


def ask_of(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig) -> Ask:
    """An EncodeRequest as the plan's `Ask`: each sequence's tensor decoded (dtype, shape and bytes
    checked here, the rest by the plan), the options as the plan names them."""
    check_count(len(request.sequences), config, "sequences")  # before decoding any of them
    out, att = request.output, request.attention
    for value, table, field in ((out.dtype, _DTYPE, "output.dtype"), (att.dtype, _DTYPE, "attention.dtype"),
                                (out.pooling, _POOLING, "output.pooling"), (att.heads, _HEADS, "attention.heads"),
                                (request.long_inputs, _LONG, "long_inputs"),
                                (out.quantization, _QUANTIZATION, "output.quantization")):
        if value not in table:
            name = dtype_name(value) if table is _DTYPE else str(value)
            raise InvalidInput(field, f"unknown value {name}" if table is not _DTYPE else
                               f"must be FLOAT32, FLOAT16 or BFLOAT16; got {name}")
    if att.layers and not att.return_attention:
        raise InvalidInput("attention.layers", "given, but return_attention is false")
    return Ask(
        inputs=[_input(i, sequence, spec) for i, sequence in enumerate(request.sequences)],
        request_id=request.request_id,
        return_hidden=out.return_hidden if out.HasField("return_hidden") else True,
        pooling=_POOLING[out.pooling], normalize=out.normalize if out.HasField("normalize") else None,
        dtype=_DTYPE[out.dtype], attention=tuple(att.layers) if att.return_attention else None,
        heads=_HEADS[att.heads], attention_dtype=_DTYPE[att.dtype], causal=request.causal,
        long_inputs=_LONG[request.long_inputs], truncate=request.truncate, chunk_stride=request.chunk_stride,
        prompt_name=out.prompt_name, return_tokens=out.return_tokens,
        dimensions=out.dimensions or None, quantization=_QUANTIZATION[out.quantization],
        quantization_ranges=(tuple(out.quantization_ranges.min), tuple(out.quantization_ranges.max))
        if out.HasField("quantization_ranges") else None,
        sparse=(out.sparse.top_k, out.sparse.threshold) if out.HasField("sparse") else None,
    )


def _input(i: int, sequence: pb.Sequence, spec: ModelSpec) -> np.ndarray | str:
    kind = sequence.WhichOneof("input")
    if kind is None:
        raise InvalidInput(f"sequences[{i}]", "one of token_ids, embeddings or text is required")
    if kind == "text":
        return sequence.text
    field = f"sequences[{i}].{kind}"
    tensor = getattr(sequence, kind)
    allowed = INT_DTYPES if kind == "token_ids" else FLOAT_DTYPES
    if tensor.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise InvalidInput(field, f"dtype must be {names}; got {dtype_name(tensor.dtype)}")
    shape = tensor.shape  # one container: each attribute read builds another
    want_rank = 1 if kind == "token_ids" else 2
    if len(shape) != want_rank:
        want = "[T]" if want_rank == 1 else f"[T, {spec.d_model}]"
        raise InvalidInput(field, f"shape must be {want}; got {list(shape)}")
    try:
        return from_tensor(tensor)
    except TensorError as exc:
        raise InvalidInput(field, str(exc)) from None


def plan_request(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig) -> Plan:
    """An EncodeRequest's plan, on the calling thread (what `encode` plans; for tests and benchmarks)."""
    return plan(ask_of(request, spec, config), spec, config, NAMES, response_bytes)
