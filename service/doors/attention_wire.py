"""attention.v1's wire, transport-free: its request messages -> the plan's `Ask` (with this door's field
names), a `Ran` -> its response messages, and the size of a response before it is computed (the protobuf
arithmetic of proto/attention/v1/sizes.py). The gRPC servicer (service/doors/attention_v1.py) and the
HTTP door's attention.v1-as-JSON route (service/doors/http/encode.py) both speak it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import FLOAT_DTYPES, INT_DTYPES, TensorError, dtype_name, fill_tensor, from_tensor
from proto.attention.v1.sizes import field, metadata_field, tensor_field, varint
from service.config import ServiceConfig
from service.doors.calls import Ran
from service.errors import InvalidInput
from service.jobs import ModelSpec
from service.plan import ITEMSIZE, Ask, Names, Plan, Sizes, attention_bytes, check_count
from service.tasks import sparse_entries

NAMES = Names()  # the plan's default names are this door's
CLASSIFY_TEXTS = Names(sequences="texts", sequence="texts[{i}]", texts="texts", task="Classify")
CLASSIFY_PAIRS = Names(sequences="pairs", sequence="pairs[{i}]", texts="pairs", task="Classify")
RERANK = Names(sequences="texts", sequence="texts[{i}]", texts="texts", task="Rerank")
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
_VECTORS = {pb.MULTI_VECTOR_NONE: None, pb.MULTI_VECTOR_QUERY: "query", pb.MULTI_VECTOR_DOCUMENT: "document"}


# -- requests -> Ask -----------------------------------------------------------------------------

def encode_ask(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig) -> Ask:
    """An EncodeRequest as the plan's `Ask`: each sequence's tensor decoded (dtype, shape and bytes
    checked here, the rest by the plan), the options as the plan names them."""
    check_count(len(request.sequences), config, "sequences")  # before decoding any of them
    out, att = request.output, request.attention
    for value, table, name in ((out.dtype, _DTYPE, "output.dtype"), (att.dtype, _DTYPE, "attention.dtype"),
                               (out.pooling, _POOLING, "output.pooling"), (att.heads, _HEADS, "attention.heads"),
                               (request.long_inputs, _LONG, "long_inputs"),
                               (out.quantization, _QUANTIZATION, "output.quantization"),
                               (out.vectors, _VECTORS, "output.vectors")):
        if value not in table:
            shown = dtype_name(value) if table is _DTYPE else str(value)
            raise InvalidInput(name, f"unknown value {shown}" if table is not _DTYPE else
                               f"must be FLOAT32, FLOAT16 or BFLOAT16; got {shown}")
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
        vectors=_VECTORS[out.vectors],
    )


def _input(i: int, sequence: pb.Sequence, spec: ModelSpec) -> np.ndarray | str:
    kind = sequence.WhichOneof("input")
    if kind is None:
        raise InvalidInput(f"sequences[{i}]", "one of token_ids, embeddings or text is required")
    if kind == "text":
        return sequence.text
    name = f"sequences[{i}].{kind}"
    tensor = getattr(sequence, kind)
    allowed = INT_DTYPES if kind == "token_ids" else FLOAT_DTYPES
    if tensor.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise InvalidInput(name, f"dtype must be {names}; got {dtype_name(tensor.dtype)}")
    shape = tensor.shape  # one container: each attribute read builds another
    want_rank = 1 if kind == "token_ids" else 2
    if len(shape) != want_rank:
        want = "[T]" if want_rank == 1 else f"[T, {spec.d_model}]"
        raise InvalidInput(name, f"shape must be {want}; got {list(shape)}")
    try:
        return from_tensor(tensor)
    except TensorError as exc:
        raise InvalidInput(name, str(exc)) from None


def _attention(att: pb.AttentionOptions) -> tuple[tuple[int, ...] | None, str, str]:
    """A head call's AttentionOptions as the plan's (layers or None, heads, dtype), checked as Encode's."""
    for value, table, name in ((att.dtype, _DTYPE, "attention.dtype"), (att.heads, _HEADS, "attention.heads")):
        if value not in table:
            raise InvalidInput(name, f"must be FLOAT32, FLOAT16 or BFLOAT16; got {dtype_name(value)}"
                               if table is _DTYPE else f"unknown value {value}")
    if att.layers and not att.return_attention:
        raise InvalidInput("attention.layers", "given, but return_attention is false")
    return (tuple(att.layers) if att.return_attention else None), _HEADS[att.heads], _DTYPE[att.dtype]


def classify_ask(request: pb.ClassifyRequest) -> tuple[Ask, Names]:
    if request.texts and request.pairs:
        raise InvalidInput("pairs", "give texts or pairs, not both")
    names = CLASSIFY_PAIRS if request.pairs else CLASSIFY_TEXTS  # the count is the plan's to check, once
    inputs: list[str | tuple[str, str]] = (
        [(p.first, p.second) for p in request.pairs] if request.pairs else list(request.texts))
    attention, heads, attention_dtype = _attention(request.attention)
    return Ask(inputs=inputs, request_id=request.request_id, return_hidden=False, task="classify",
               truncate=request.truncate, attention=attention, heads=heads, attention_dtype=attention_dtype,
               raw_scores=request.raw_scores), names


def rerank_ask(request: pb.RerankRequest) -> Ask:
    attention, heads, attention_dtype = _attention(request.attention)
    return Ask(inputs=list(request.texts), request_id=request.request_id, return_hidden=False, task="rerank",
               query=request.query, top_n=request.top_n if request.HasField("top_n") else None,
               truncate=request.truncate, attention=attention, heads=heads, attention_dtype=attention_dtype,
               raw_scores=request.raw_scores, scoring=request.scoring,
               weights=tuple(request.weights) if request.weights else None)


# -- Ran -> responses ----------------------------------------------------------------------------

def _metadata(m: pb.ResponseMetadata, ran: Ran) -> None:
    """ResponseMetadata, set in place: building one and then the response from it copies it once more."""
    batch, spec = ran.batch, ran.spec
    m.queue_us, m.compute_us = int(batch.queue_s * 1e6), int(batch.compute_s * 1e6)
    m.batch_size, m.padded_length, m.fp32_retry = batch.batch_size, batch.padded_length, batch.fp32_retry
    m.precision, m.device, m.model_name, m.model_version = spec.precision, spec.device, spec.name, spec.version


def encode_response(ran: Ran) -> pb.EncodeResponse:
    plan = ran.plan
    response = pb.EncodeResponse(request_id=plan.request_id)
    _metadata(response.metadata, ran)
    sequences = plan.sequences
    output_dtype, attention_dtype = _WIRE_DTYPE[plan.output_dtype], _WIRE_DTYPE[plan.attention_dtype]
    quantized = plan.vectors.dtype if plan.vectors is not None else None
    pooled_dtype = output_dtype if quantized is None else _QUANTIZED_DTYPE[quantized]
    for i, out in enumerate(ran.outputs):
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
        if out.vectors is not None:
            fill_tensor(seq.vectors, out.vectors, output_dtype if out.vectors.dtype.kind == "f"
                        else pooled_dtype)  # packed bits: the pooled vector's quantized dtype
        if plan.sparse is not None and out.scores is not None:
            indices, values = sparse_entries(out.scores, *plan.sparse)
            seq.sparse.indices.extend(indices.tolist())
            seq.sparse.values.extend(values.tolist())
    return response


def classify_response(ran: Ran) -> pb.ClassifyResponse:
    plan = ran.plan
    assert ran.labels is not None, "a classify call without label scores. This is a bug."
    response = pb.ClassifyResponse(request_id=plan.request_id)
    _metadata(response.metadata, ran)
    wire = _WIRE_DTYPE[plan.attention_dtype]
    for job, out, scores, text in zip(plan.jobs, ran.outputs, ran.labels, plan.texts, strict=True):
        assert text is not None
        result = response.results.add(token_count=job.length, truncated=text.truncated)
        for label, score in zip(ran.spec.labels, scores.tolist(), strict=True):
            result.scores.add(label=label, score=score)
        if out.attention is not None:
            fill_tensor(result.attention, out.attention, wire)
    return response


def rerank_response(ran: Ran, texts: Sequence[str], return_text: bool) -> pb.RerankResponse:
    plan = ran.plan
    assert ran.scores is not None and ran.ranking is not None, "a rerank without scores. This is a bug."
    response = pb.RerankResponse(request_id=plan.request_id)
    _metadata(response.metadata, ran)
    wire = _WIRE_DTYPE[plan.attention_dtype]
    for i in ran.ranking:
        text = plan.texts[i]
        assert text is not None
        result = response.results.add(index=i, score=ran.scores[i], token_count=plan.jobs[i].length,
                                      truncated=text.truncated)
        if return_text:
            result.text = texts[i]
        attention = ran.outputs[i].attention
        if attention is not None:
            fill_tensor(result.attention, attention, wire)
    return response


def model_info(spec: ModelSpec, c: ServiceConfig, aliases: Sequence[str] = ()) -> pb.ModelInfo:
    info = pb.ModelInfo(
        name=spec.name, version=spec.version, checksum=spec.checksum, d_model=spec.d_model,
        n_heads=spec.n_heads, n_layers=spec.n_layers, vocab_size=spec.vocab_size, max_length=spec.max_length,
        positional=spec.positional, precision=spec.precision, device=spec.device,
        attention_scale=spec.attention_scale, standard_scale=spec.standard_scale, relative_bias=spec.relative_bias,
        precision_reason=spec.precision_reason, precision_forward_ms=spec.precision_forward_ms,
        precision_fidelity=spec.precision_fidelity,
        batch_budget=pb.BatchBudget(max_batch_tokens=spec.max_batch_tokens, reason=spec.batch_reason,
                                    tokens_per_second=spec.batch_curve, model_workers=spec.model_workers,
                                    workers_reason=spec.workers_reason, compared_workers=spec.compared_workers,
                                    compared_tokens_per_second=spec.compared_curve),
        quantization_ranges=None if spec.quantization_ranges is None else pb.QuantizationRanges(
            min=spec.quantization_ranges[0], max=spec.quantization_ranges[1]),
        tasks=spec.tasks, labels=spec.labels, backend=spec.backend, vector_dim=spec.vector_dim,
        sparse_kind=spec.sparse_kind if "sparse" in spec.tasks else "", aliases=aliases,
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


# -- sizes ---------------------------------------------------------------------------------------

def response_bytes(plan: Plan, spec: ModelSpec) -> Sizes:
    """The attention bytes, and an upper bound on the serialized EncodeResponse: the tensor bytes plus every
    tag, length prefix, shape and metadata field (what grpcio's send limit counts). Within a few bytes per
    sequence of the real size: only the varints of the timings and batch facts are taken at their widest."""
    out_size, att_size = ITEMSIZE[plan.output_dtype], ITEMSIZE[plan.attention_dtype]
    D = spec.d_model
    pooled_values, pooled_size = plan.pooled_size(D)
    total = field(len(plan.request_id.encode()))
    for i, job in enumerate(plan.sequences):
        T = job.length
        body = 2 + 1 + varint(T) + 2  # nonfinite = true, token_count, truncated = true
        text = plan.texts[i] if plan.texts else None
        if text is not None and plan.return_tokens:  # token_ids [T] int64, and each token's string
            body += tensor_field((T,), 8) + sum(field(len(token.encode())) for token in text.tokens)
        if job.return_hidden:
            body += tensor_field((T, D), out_size)
        if job.pooling:
            body += tensor_field((pooled_values,), pooled_size)
        if job.attn_layers:
            heads = 1 if job.heads_mean else spec.n_heads
            body += tensor_field((len(job.attn_layers), heads, T, T), att_size)
        if job.vectors:  # [rows, vector_dim], or its packed bits
            rows = len(job.vector_rows) if job.vector_rows is not None else T
            packed = plan.vectors is not None and plan.vectors.quantization in ("binary", "ubinary")
            body += tensor_field((rows, (spec.vector_dim + 7) // 8 if packed else spec.vector_dim),
                                 1 if packed else out_size)
        if plan.sparse is not None:  # packed int32 indices (at most 5 bytes each) and float values
            entries = min(plan.sparse[0] or spec.vocab_size, spec.vocab_size)
            body += field(field(5 * entries) + field(4 * entries))
        total += field(body)
    if plan.chunks:  # SequenceOutput.windows, and a byte of slack for its output's length prefix
        total += sum(2 + varint(len(c.starts)) for c in plan.chunks if c is not None)
    total += metadata_field(spec.precision, spec.device, spec.name, spec.version)
    return Sizes(attention_bytes(plan, spec), total)
