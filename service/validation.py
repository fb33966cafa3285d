"""EncodeRequest -> validated `Job`s, before anything is queued.

Every check names the field (and index) it refers to; one bad sequence fails its own call with
INVALID_ARGUMENT and never reaches a batch. Sizes of the response (hidden states and attention
weights) are computed here, up front, so that nothing is computed only to be refused at send time.
Text is tokenized here (the batcher only ever sees token ids), with the model's tokenizer: the call's
characters are counted before tokenizing, its tokens after. The servicer runs `validate` in a worker
thread when a call carries much text (`TOKENIZE_INLINE_CHARS`), off the event loop. A sequence
longer than the model is refused, cut or planned in windows here, as the call asks (service/chunking.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import FLOAT_DTYPES, INT_DTYPES, ITEMSIZE, TensorError, dtype_name, from_tensor
from service.chunking import CHUNK, ERROR, REFUSE, TRUNCATE, Chunked, LongInputs, choose, sequences, truncated
from service.config import ServiceConfig
from service.errors import FailedPrecondition, InvalidInput, NonFiniteInput
from service.jobs import POOL_CLS, POOL_MEAN, POOL_NONE, Job, ModelSpec

if TYPE_CHECKING:
    from model.text import Encoded

OUTPUT_DTYPES = (pb.DTYPE_UNSPECIFIED, *FLOAT_DTYPES)
MAX_REQUEST_ID = 128
MAX_EMBEDDING_ABS = 1e6  # far above any trained embedding; far below where float32 LayerNorm overflows
_POOLINGS = frozenset(pb.Pooling.values())  # .values() builds a list on every call
_HEAD_REDUCTIONS = frozenset(pb.HeadReduction.values())
# Calls with more text than this are validated (tokenized) in a worker thread: below it, the hop costs
# more than the tokenizer (about 1 us per character here).
TOKENIZE_INLINE_CHARS = 4096
_MODEL_POOLING = {"mean": POOL_MEAN, "cls": POOL_CLS}
_UNSIGNED = {np.dtype(f"{order}i{size}"): np.dtype(f"{order}u{size}") for order in "<>=" for size in (4, 8)}
_LONG_INPUTS = {pb.LONG_INPUTS_ERROR: ERROR, pb.LONG_INPUTS_TRUNCATE: TRUNCATE, pb.LONG_INPUTS_CHUNK: CHUNK}
ATTENTION_FIELD = "attention.return_attention"
_WINDOWED = " (the windows of chunked sequences counted)"


@dataclass(frozen=True)
class Plan:
    """A validated call: its jobs (one per sequence, in order; a chunked sequence's windows in its
    place) and how to encode the outputs."""

    request_id: str
    jobs: list[Job]
    output_dtype: int  # a float DType
    attention_dtype: int
    texts: tuple[Encoded | None, ...] = ()  # per sequence: how its text was tokenized (None: not text)
    return_tokens: bool = False
    chunks: tuple[Chunked | None, ...] = ()  # per sequence, when the call chunks one: its windows (None: whole)
    truncated: tuple[bool, ...] = ()  # per sequence, when the call cut ids or embeddings: whether it did

    @property
    def tokens(self) -> int:
        """Tokens computed: after chunking, the windows' lengths summed."""
        return sum(job.length for job in self.jobs)

    @property
    def sequences(self) -> list[Job]:
        """One job per sequence of the call, as asked (a chunked sequence whole, not its windows)."""
        return sequences(self.jobs, self.chunks) if self.chunks else self.jobs


class _Layout:
    """A call's jobs once one of its sequences is longer than the model (the call truncates or chunks):
    each sequence fitted to the model's length as the call asks. Until then validation only appends
    jobs, so a call without long sequences pays nothing for this."""

    def __init__(self, long: LongInputs, attention_field: str, field: Callable[[int], str], jobs: list[Job]) -> None:
        self.long, self.attention_field, self.field = long, attention_field, field  # field: sequence i's name
        self.jobs = jobs  # those so far: all within the limit
        self.chunks: list[Chunked | None] = [None] * len(jobs)
        self.cut = [False] * len(jobs)

    def add(self, job: Job, window: int) -> None:
        """`job`, or its cut or windows."""
        chunk, cut = None, False
        if job.length <= window:
            self.jobs.append(job)
        elif self.long.mode == TRUNCATE:
            self.jobs.append(truncated(job, window))
            cut = True
        else:
            assert self.long.mode == CHUNK, "a long sequence left for the layout. This is a bug."
            if job.attn_layers:
                raise InvalidInput(self.attention_field, "attention weights are not available for a chunked "
                                   f"sequence: {self.field(len(self.chunks))} has {job.length} tokens, over "
                                   f"{window}, so it is encoded in windows; ask without attention, or send it "
                                   "within the limit")
            chunk = Chunked.plan(job, window, self.long.step(window))
            self.jobs.extend(chunk.jobs())
        self.chunks.append(chunk)
        self.cut.append(cut)

    def fields(self) -> dict[str, Any]:
        """Plan's chunks and truncated: empty unless some sequence was chunked (cut)."""
        return {"chunks": tuple(self.chunks) if any(c is not None for c in self.chunks) else (),
                "truncated": tuple(self.cut) if any(self.cut) else ()}


def _fit(layout: _Layout | None, jobs: list[Job], job: Job, window: int, long: LongInputs, attention_field: str,
         field: Callable[[int], str]) -> _Layout | None:
    """Add `job` to the call: appended while every sequence fits, else through a `_Layout` (returned)."""
    if layout is None:
        if job.length <= window:
            jobs.append(job)
            return None
        layout = _Layout(long, attention_field, field, jobs)
    layout.add(job, window)
    return layout


def validate(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig) -> Plan:
    if len(request.request_id) > MAX_REQUEST_ID:
        raise InvalidInput("request_id", f"at most {MAX_REQUEST_ID} characters; got {len(request.request_id)}")
    n = len(request.sequences)
    if not 1 <= n <= config.max_sequences_per_call:
        raise InvalidInput("sequences", f"must hold 1..{config.max_sequences_per_call} sequences; got {n}")
    out, att = request.output, request.attention
    output_dtype = _float_dtype("output.dtype", out.dtype)
    attention_dtype = _float_dtype("attention.dtype", att.dtype)
    if out.pooling not in _POOLINGS:
        raise InvalidInput("output.pooling", f"unknown value {out.pooling}")
    long = _long_inputs(request, spec)
    texts = _tokenize(request, spec, config, long)
    pooling, normalize = _pooling(out, spec)
    if att.heads not in _HEAD_REDUCTIONS:
        raise InvalidInput("attention.heads", f"unknown value {att.heads}")
    layers = _attention_layers(att, spec, config)
    return_hidden = out.return_hidden if out.HasField("return_hidden") else True
    if not return_hidden and out.pooling == pb.POOLING_NONE and not layers:
        raise InvalidInput("output", "nothing to return: hidden states off, no pooling, no attention")

    jobs: list[Job] = []
    layout = None
    text_window = spec.tokenizer.settings.max_tokens if texts and spec.tokenizer is not None else 0
    for i, sequence in enumerate(request.sequences):
        encoded = texts[i] if texts else None
        token_ids: np.ndarray | None
        if encoded is not None:
            token_ids, embeddings, window = encoded.ids, None, text_window
        else:
            (token_ids, embeddings), window = _decode_input(i, sequence, spec, long.mode), spec.max_length
        job = Job(
            token_ids=token_ids, embeddings=embeddings, causal=request.causal, attn_layers=layers,
            heads_mean=att.heads == pb.HEADS_MEAN, pooling=pooling, return_hidden=return_hidden,
            normalize=normalize,
        )
        if layout is None and job.length <= window:  # the common case, inline
            jobs.append(job)
        else:
            layout = _fit(layout, jobs, job, window, long, ATTENTION_FIELD,
                          lambda i: f"sequences[{i}].{request.sequences[i].WhichOneof('input')}")
    plan = Plan(request.request_id, jobs, output_dtype, attention_dtype, texts, out.return_tokens,
                **(layout.fields() if layout is not None else {}))
    if plan.tokens > config.max_tokens_per_call:
        raise InvalidInput("sequences", f"{plan.tokens} tokens in all{_WINDOWED * bool(plan.chunks)}; at most "
                           f"{config.max_tokens_per_call} per call")
    _check_sizes(plan, spec, config)
    return plan


def text_chars(request: pb.EncodeRequest) -> int:
    """Characters of text the call carries (to decide where to tokenize it)."""
    return sum(len(s.text) for s in request.sequences if s.WhichOneof("input") == "text")


def _pooling(out: pb.OutputOptions, spec: ModelSpec) -> tuple[int, bool]:
    """(pooling, normalize) of the call: POOLING_MODEL and an unset normalize take the model's defaults."""
    settings = spec.tokenizer.settings if spec.tokenizer is not None else None
    pooling = int(out.pooling)
    if pooling == pb.POOLING_MODEL:
        if settings is None:
            raise InvalidInput("output.pooling", "POOLING_MODEL needs a model served with a tokenizer "
                               "(ModelInfo.text); use POOLING_MEAN or POOLING_CLS")
        pooling = _MODEL_POOLING[settings.pooling]
    if out.HasField("normalize"):
        if out.normalize and pooling == POOL_NONE:
            raise InvalidInput("output.normalize", "normalizes the pooled vector: set output.pooling")
        return pooling, out.normalize
    return pooling, settings is not None and settings.normalize and pooling != POOL_NONE


def _long_inputs(request: pb.EncodeRequest, spec: ModelSpec) -> LongInputs:
    """The call's choice for sequences longer than the model (EncodeRequest.long_inputs, truncate, chunk_stride)."""
    if not (request.long_inputs or request.truncate or request.chunk_stride):
        return REFUSE  # the common call: nothing to look at
    if request.long_inputs and request.long_inputs not in _LONG_INPUTS:
        raise InvalidInput("long_inputs", f"unknown value {request.long_inputs}")
    kinds = {s.WhichOneof("input") for s in request.sequences}
    windows = [spec.max_length] if kinds - {"text"} else []
    if "text" in kinds and spec.tokenizer is not None:
        windows.append(spec.tokenizer.settings.max_tokens)
    return choose(_LONG_INPUTS.get(request.long_inputs), request.truncate, request.chunk_stride,
                  mode_field="long_inputs", stride_field="chunk_stride", windows=windows)


def _tokenize(request: pb.EncodeRequest, spec: ModelSpec, config: ServiceConfig,
              long: LongInputs) -> tuple[Encoded | None, ...]:
    """The call's texts tokenized, per sequence (None where a sequence is not text); () without text."""
    kinds = [s.WhichOneof("input") for s in request.sequences]
    if "text" not in kinds:
        if request.output.prompt_name:
            raise InvalidInput("output.prompt_name", "applies to text; the call sends none")
        return ()
    where = [i for i, kind in enumerate(kinds) if kind == "text"]
    encoded = tokenize([request.sequences[i].text for i in where], spec, config, fields=[
        f"sequences[{i}].text" for i in where], truncate=long.mode == TRUNCATE, keep_long=long.mode == CHUNK,
        prompt_name=request.output.prompt_name)
    out: list[Encoded | None] = [None] * len(kinds)
    for i, enc in zip(where, encoded, strict=True):
        out[i] = enc
    return tuple(out)


def tokenize(texts: Sequence[str], spec: ModelSpec, config: ServiceConfig, *, fields: Sequence[str], truncate: bool,
             prompt_name: str = "", all_field: str = "sequences",
             prompt_field: str = "output.prompt_name", keep_long: bool = False) -> list[Encoded]:
    """`texts` -> token ids with the model's tokenizer, every limit checked: the characters of the call
    before tokenizing, each text's tokens (over the limit: refused, cut with `truncate`, or kept whole
    with `keep_long`, to be chunked) and the ids against the vocabulary after. `fields` name each text
    in errors; the front doors share this."""
    tokenizer = spec.tokenizer
    if tokenizer is None:
        raise InvalidInput(fields[0], f"model {spec.name} takes no text (it has no tokenizer); send token ids")
    chars = sum(len(text) for text in texts)
    if chars > config.max_text_chars:
        raise InvalidInput(all_field, f"{chars} characters of text in all; at most {config.max_text_chars} per call")
    try:
        prompt = tokenizer.prompt(prompt_name)
    except KeyError:
        raise InvalidInput(prompt_field, f"unknown prompt {prompt_name!r}; the model has "
                           f"{sorted(tokenizer.settings.prompts)}") from None
    encoded = tokenizer.encode(texts, truncate=truncate, prompt=prompt)
    limit = tokenizer.settings.max_tokens
    for field, enc in zip(fields, encoded, strict=True):
        if len(enc.ids) > limit and not keep_long:
            raise InvalidInput(field, f"{enc.full_length} tokens (special tokens included), over the model's "
                               f"limit of {limit}; shorten it, or set truncate to cut it (or chunk it)")
        if len(enc.ids) and int(enc.ids.max()) >= spec.vocab_size:
            raise InvalidInput(field, f"the tokenizer gave id {int(enc.ids.max())}, outside the model's "
                               f"vocabulary of {spec.vocab_size}")
    return encoded


def validate_rows(rows: Sequence[np.ndarray], field: str, out: pb.OutputOptions, att: pb.AttentionOptions,
                  spec: ModelSpec, config: ServiceConfig, *, request_id: str = "", padded_to: int = 0,
                  layers_field: str = "attention.layers", long: LongInputs = REFUSE, window: int = 0,
                  attention_field: str = ATTENTION_FIELD) -> Plan:
    """Token-id rows (int32/int64 [T_i] each, already cut to their real length) -> a `Plan`, with the
    checks `validate` makes. For callers that decode their own wire format (service/doors/kserve_v2.py):
    `field` names the tensor in errors (`field[i, j]`), and `padded_to` sizes a response that pads
    every row back to the request's length. Rows longer than `window` (0: max_length) are refused,
    cut or chunked as `long` says."""
    n = len(rows)
    if not 1 <= n <= config.max_sequences_per_call:
        raise InvalidInput(field, f"must hold 1..{config.max_sequences_per_call} sequences; got {n}")
    if out.pooling not in _POOLINGS:
        raise InvalidInput("pooling", f"unknown value {out.pooling}")
    pooling, normalize = _pooling(out, spec)
    layers = _attention_layers(att, spec, config, layers_field)
    return_hidden = out.return_hidden if out.HasField("return_hidden") else True
    window = window or spec.max_length
    jobs: list[Job] = []
    layout = None
    for i, row in enumerate(rows):
        if len(row) < 1 or (len(row) > window and long.mode == ERROR):
            raise InvalidInput(f"{field}[{i}]",
                               f"length must be 1..{window}; got {len(row)}" + _HINT * (len(row) > window))
        if (j := _first_out_of_vocab(row, spec.vocab_size)) is not None:
            raise InvalidInput(f"{field}[{i}, {j}]", f"id {int(row[j])} not in [0, {spec.vocab_size})")
        layout = _fit(layout, jobs, Job(
            token_ids=row.astype(np.int64, copy=False), embeddings=None, attn_layers=layers,
            heads_mean=att.heads == pb.HEADS_MEAN, pooling=pooling, return_hidden=return_hidden, normalize=normalize,
        ), window, long, attention_field, lambda i: f"{field}[{i}]")
    plan = Plan(request_id, jobs, _float_dtype("datatype", out.dtype), _float_dtype("datatype", att.dtype),
                **(layout.fields() if layout is not None else {}))
    if plan.tokens > config.max_tokens_per_call:
        raise InvalidInput(field, f"{plan.tokens} tokens in all{_WINDOWED * bool(plan.chunks)}; at most "
                           f"{config.max_tokens_per_call} per call")
    _check_sizes(plan, spec, config, padded_to or None)
    return plan


def _float_dtype(field: str, dtype: int) -> int:
    if dtype not in OUTPUT_DTYPES:
        raise InvalidInput(field, f"must be FLOAT32, FLOAT16 or BFLOAT16; got {dtype_name(dtype)}")
    return dtype if dtype != pb.DTYPE_UNSPECIFIED else pb.DTYPE_FLOAT32


def _attention_layers(att: pb.AttentionOptions, spec: ModelSpec, config: ServiceConfig,
                      field: str = "attention.layers") -> tuple[int, ...]:
    if not att.return_attention:
        if att.layers:
            raise InvalidInput(field, "given, but return_attention is false")
        return ()
    if not config.allow_attention:
        raise FailedPrecondition("return_attention is disabled on this deployment")
    L = spec.n_layers
    if not att.layers:
        return tuple(range(L))
    layers = []
    for j, layer in enumerate(att.layers):
        if not -L <= layer < L:
            raise InvalidInput(f"{field}[{j}]", f"layer {layer} not in [-{L}, {L})")
        layer %= L
        if layer in layers:
            raise InvalidInput(f"{field}[{j}]", f"layer {layer} asked for twice")
        layers.append(layer)
    return tuple(layers)


def _decode_input(i: int, sequence: pb.Sequence, spec: ModelSpec,
                  long_mode: str = ERROR) -> tuple[np.ndarray | None, np.ndarray | None]:
    kind = sequence.WhichOneof("input")
    if kind is None:
        raise InvalidInput(f"sequences[{i}]", "one of token_ids or embeddings is required")
    field = f"sequences[{i}].{kind}"
    tensor = getattr(sequence, kind)
    allowed = INT_DTYPES if kind == "token_ids" else FLOAT_DTYPES
    if tensor.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise InvalidInput(field, f"dtype must be {names}; got {dtype_name(tensor.dtype)}")
    want_rank = 1 if kind == "token_ids" else 2
    shape = tensor.shape  # one container: each attribute read builds another
    if len(shape) != want_rank:
        want = "[T]" if want_rank == 1 else f"[T, {spec.d_model}]"
        raise InvalidInput(field, f"shape must be {want}; got {list(shape)}")
    length = shape[0]
    if length < 1 or (length > spec.max_length and long_mode == ERROR):
        raise InvalidInput(field, f"length must be 1..{spec.max_length}; got {length}"
                           + _HINT * (length > spec.max_length))
    if kind == "embeddings" and shape[1] != spec.d_model:
        raise InvalidInput(field, f"shape must be [T, {spec.d_model}]; got {list(shape)}")
    try:
        array = from_tensor(tensor)
    except TensorError as exc:
        raise InvalidInput(field, str(exc)) from None
    if kind == "token_ids":
        if (j := _first_out_of_vocab(array, spec.vocab_size)) is not None:
            raise InvalidInput(f"{field}[{j}]", f"id {int(array[j])} not in [0, {spec.vocab_size})")
        return array.astype(np.int64, copy=False), None  # int64 ids stay a view of the request's bytes
    embeddings = array.astype(np.float32)
    if not np.isfinite(embeddings).all():
        raise NonFiniteInput(field, "holds NaN or Inf")
    largest = float(np.abs(embeddings).max())
    if largest > MAX_EMBEDDING_ABS:
        # Finite, but LayerNorm's variance would overflow (x^2 past float32 max near 1e19): refuse it
        # as bad input rather than compute a non-finite output.
        raise InvalidInput(field, f"|value| must be <= {MAX_EMBEDDING_ABS:g}; got {largest:.3g}")
    return None, embeddings


_HINT = " (or set long_inputs to truncate or chunk it)"


def _first_out_of_vocab(ids: np.ndarray, vocab_size: int) -> int | None:
    """The index of the first id outside [0, vocab_size), or None."""
    # One reduction checks both bounds: read as unsigned, a negative id is at least 2**31.
    if int(ids.view(_UNSIGNED.get(ids.dtype) or ids.dtype.str.replace("i", "u")).max()) < vocab_size:
        return None
    return int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])


def _check_sizes(plan: Plan, spec: ModelSpec, config: ServiceConfig, padded_to: int | None = None) -> None:
    """Refuse, before any compute, a call whose attention or whole response would be over budget.
    `padded_to`: the response pads every sequence to this length (the KServe v2 front door)."""
    first = plan.jobs[0]
    heads = 1 if first.heads_mean else spec.n_heads
    attention = 0
    if any(job.attn_layers for job in plan.sequences):
        attention = sum(len(job.attn_layers) * heads * (padded_to or job.length)**2 for job in plan.sequences)
        attention *= ITEMSIZE[plan.attention_dtype]
    if attention > config.max_attention_bytes:
        raise InvalidInput(
            "attention",
            f"attention weights would be {attention} bytes, over the budget of {config.max_attention_bytes} bytes; "
            "ask for fewer layers, heads=HEADS_MEAN, FLOAT16, or shorter sequences",
        )
    if padded_to is None:
        total = response_bytes(plan, spec)
    else:  # a KServe v2 response: every row padded to `padded_to`, raw tensor bytes in a small envelope
        per_value = ITEMSIZE[plan.output_dtype]
        hidden = sum(padded_to for job in plan.sequences if job.return_hidden) * spec.d_model * per_value
        pooled = sum(1 for job in plan.sequences if job.pooling) * spec.d_model * per_value
        total = hidden + pooled + attention + 1024 + len(plan.request_id)  # + names, shapes, parameters
    if total > config.max_message_bytes:
        raise InvalidInput(
            "sequences", f"the response would be {total} bytes, over max_message_bytes {config.max_message_bytes}"
        )


def response_bytes(plan: Plan, spec: ModelSpec) -> int:
    """An upper bound on the serialized EncodeResponse of `plan`: the tensor bytes plus every tag,
    length prefix, shape and metadata field (what grpcio's send limit counts). Within a few bytes per
    sequence of the real size: only the varints of the timings and batch facts are taken at their widest."""
    out_size, att_size = ITEMSIZE[plan.output_dtype], ITEMSIZE[plan.attention_dtype]
    D = spec.d_model
    total = _field(len(plan.request_id.encode()))
    for job in plan.sequences:
        T = job.length
        body = 2  # nonfinite = true
        if job.return_hidden:
            body += _tensor_field((T, D), out_size)
        if job.pooling:
            body += _tensor_field((D,), out_size)
        if job.attn_layers:
            heads = 1 if job.heads_mean else spec.n_heads
            body += _tensor_field((len(job.attn_layers), heads, T, T), att_size)
        total += _field(body)
    if plan.chunks:  # SequenceOutput.windows, and a byte of slack for its output's length prefix
        total += sum(2 + _varint(len(c.starts)) for c in plan.chunks if c is not None)
    return total + _metadata_field(spec.precision, spec.device, spec.name, spec.version)


@functools.lru_cache(maxsize=16)
def _metadata_field(*texts: str) -> int:
    """The ResponseMetadata field: queue_us, compute_us (int64), batch_size, padded_length (int32 >= 0),
    fp32_retry, then the strings (the model's: the same on every call, hence the cache)."""
    return _field(2 * 11 + 2 * 6 + 2 + sum(_field(len(text.encode())) for text in texts))


def _varint(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field(length: int) -> int:
    """A length-delimited field of `length` bytes: tag, length prefix, payload."""
    return 1 + _varint(length) + length


# Shapes repeat (a few lengths, one d_model), and the size is computed for every sequence of every call.
@functools.lru_cache(maxsize=4096)
def _tensor_field(shape: tuple[int, ...], itemsize: int) -> int:
    """`_tensor` as a field of its parent."""
    return _field(_tensor(shape, itemsize))


def _tensor(shape: tuple[int, ...], itemsize: int) -> int:
    """An attention.v1.Tensor's body: dtype (never 0 here), packed shape, data."""
    count = 1
    for d in shape:
        count *= d
    return 2 + _field(sum(_varint(d) for d in shape)) + _field(count * itemsize)
