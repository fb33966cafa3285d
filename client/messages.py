"""Python values <-> `attention.v1` messages: request options, results and model info as dataclasses.

Outputs are writable numpy arrays, one per sequence, in the dtype asked for: float32, float16, or for
bfloat16 float32 arrays holding the bfloat16 values exactly (numpy has no bfloat16 dtype).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import numpy.typing as npt

from client.errors import InvalidArgument
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor, to_tensor

Pooling = Literal["none", "mean", "cls", "model"]
Heads = Literal["all", "mean"]
LongInputs = Literal["error", "truncate", "chunk"]
DTypeName = Literal["float32", "float16", "bfloat16"]
Quantization = Literal["none", "int8", "uint8", "binary", "ubinary"]
FloatArray = npt.NDArray[np.floating[Any]]  # float32, or float16 for output_dtype="float16"
Sequences = Sequence[npt.ArrayLike | str] | npt.NDArray[np.generic]
"""Token ids (1-D integer, [T]), embeddings (2-D float, [T, d_model]) or text (str, for models served with
a tokenizer), one item per sequence. A 2-D integer array is taken as rows of ids, a 3-D float array as a
batch of embedding sequences."""

E = TypeVar("E", pb.Pooling, pb.HeadReduction, pb.DType, pb.LongInputs, pb.Quantization)

POOLING: dict[str, pb.Pooling] = {"none": pb.POOLING_NONE, "mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS,
                                  "model": pb.POOLING_MODEL}
HEADS: dict[str, pb.HeadReduction] = {"all": pb.HEADS_ALL, "mean": pb.HEADS_MEAN}
LONG_INPUTS: dict[str, pb.LongInputs] = {"error": pb.LONG_INPUTS_ERROR, "truncate": pb.LONG_INPUTS_TRUNCATE,
                                         "chunk": pb.LONG_INPUTS_CHUNK}
DTYPE_NAMES: tuple[str, ...] = get_args(DTypeName)  # the only names: the library's and the CLI's --dtype
DTYPES: dict[str, pb.DType] = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16,
                               "bfloat16": pb.DTYPE_BFLOAT16}
assert tuple(DTYPES) == DTYPE_NAMES
QUANTIZATION: dict[str, pb.Quantization] = {"none": pb.QUANTIZATION_NONE, "int8": pb.QUANTIZATION_INT8,
                                            "uint8": pb.QUANTIZATION_UINT8, "binary": pb.QUANTIZATION_BINARY,
                                            "ubinary": pb.QUANTIZATION_UBINARY}


def _choice(name: str, value: str, table: dict[str, E]) -> E:
    if value not in table:
        raise InvalidArgument("INVALID_ARGUMENT", f"{name} must be one of {sorted(table)}; got {value!r}", field=name)
    return table[value]


@dataclass(frozen=True)
class SparseOptions:
    """Which entries of each sequence's SPLADE sparse vector come back (`encode(..., sparse=...)`): those
    above `threshold` (>= 0; 0: every non-zero one), the `top_k` largest of them when top_k > 0 (0: all).
    Values out of range are refused by the server (InvalidArgument naming output.sparse.top_k or .threshold);
    wrong types here, before anything is sent (TypeError)."""

    top_k: int = 0
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer):
            raise TypeError(f"sparse top_k must be an int; got {type(self.top_k).__name__}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, Real):
            raise TypeError(f"sparse threshold must be a number; got {type(self.threshold).__name__}")

    def to_proto(self) -> pb.SparseOptions:
        return pb.SparseOptions(top_k=int(self.top_k), threshold=float(self.threshold))


def sparse_options(sparse: SparseOptions | bool | None) -> SparseOptions | None:
    """`encode`'s `sparse` argument: True is SparseOptions() (every non-zero entry), False/None none."""
    if sparse is None or sparse is False:
        return None
    if sparse is True:
        return SparseOptions()
    if not isinstance(sparse, SparseOptions):
        raise TypeError(f"sparse must be True, False or SparseOptions(top_k=..., threshold=...); got "
                        f"{type(sparse).__name__}")
    return sparse


@dataclass(frozen=True)
class EncodeOptions:
    """What to compute and return for every sequence of one call (see `EncoderClient.encode`).
    pooling None: the client's default (`EncoderClient.encode`: the model's own on a text model, else
    "none"; built without a client, "model" when the call sends text). long_inputs None: what `truncate` says."""

    pooling: Pooling | None = None
    return_hidden: bool = True
    output_dtype: DTypeName = "float32"
    attention: bool = False
    layers: tuple[int, ...] | None = None
    heads: Heads = "all"
    attention_dtype: DTypeName = "float32"
    causal: bool = False
    normalize: bool | None = None  # None: the model's default
    prompt_name: str = ""
    truncate: bool = False
    return_tokens: bool = False
    long_inputs: LongInputs | None = None
    stride: int = 0  # long_inputs="chunk": tokens between window starts; 0 = the server's default
    dimensions: int = 0  # keep the pooled vector's first n values (renormalised when normalised); 0 = all
    quantization: Quantization = "none"
    quantization_ranges: tuple[npt.ArrayLike, npt.ArrayLike] | None = None  # int8/uint8: (min, max); None: the model's
    sparse: SparseOptions | bool | None = None  # a SPLADE sparse vector per sequence (models with the "sparse" task)

    def to_proto(self, text: bool = False) -> tuple[pb.OutputOptions, pb.AttentionOptions]:
        pooling = self.pooling if self.pooling is not None else "model" if text else "none"
        output = pb.OutputOptions(return_hidden=self.return_hidden, pooling=_choice("pooling", pooling, POOLING),
                                  dtype=_choice("output_dtype", self.output_dtype, DTYPES),
                                  prompt_name=self.prompt_name, return_tokens=self.return_tokens,
                                  dimensions=self.dimensions,
                                  quantization=_choice("quantization", self.quantization, QUANTIZATION))
        if self.quantization_ranges is not None:
            low, high = (np.asarray(r, np.float64).reshape(-1).tolist() for r in self.quantization_ranges)
            output.quantization_ranges.CopyFrom(pb.QuantizationRanges(min=low, max=high))
        if self.normalize is not None:
            output.normalize = self.normalize
        sparse = sparse_options(self.sparse)
        if sparse is not None:
            output.sparse.CopyFrom(sparse.to_proto())
        # Naming layers is asking for attention.
        want = self.attention or self.layers is not None
        attention = pb.AttentionOptions(
            return_attention=want, layers=list(self.layers or ()) if want else [],
            heads=_choice("heads", self.heads, HEADS), dtype=_choice("attention_dtype", self.attention_dtype, DTYPES),
        )
        return output, attention


def to_sequence(index: int, value: npt.ArrayLike | str) -> pb.Sequence:
    """One sequence: str -> text; integer [T] -> token_ids (int32 kept, else int64); float [T, D] ->
    embeddings (float16 kept, else float32)."""
    if isinstance(value, str):
        return pb.Sequence(text=value)
    array = np.asarray(value)
    if array.ndim == 1 and array.size == 0:
        array = array.astype(np.int64)  # let the server name the empty sequence
    kind = array.dtype.kind
    if kind in "iu":
        if array.ndim != 1:
            raise InvalidArgument("INVALID_ARGUMENT", f"token ids must be 1-D; got shape {list(array.shape)}",
                                  field=f"sequences[{index}].token_ids")
        if array.dtype.newbyteorder("=") not in (np.dtype(np.int32), np.dtype(np.int64)):
            array = array.astype(np.int64)
        return pb.Sequence(token_ids=to_tensor(array))
    if kind == "f":
        if array.ndim == 1:
            raise InvalidArgument("INVALID_ARGUMENT", f"a 1-D float array (shape {list(array.shape)}) is neither "
                                  "token ids nor embeddings: token ids must be integers (e.g. "
                                  "np.asarray(ids, dtype=np.int64)); embeddings are 2-D [T, d_model]",
                                  field=f"sequences[{index}]")
        if array.ndim != 2:
            raise InvalidArgument("INVALID_ARGUMENT", f"embeddings must be 2-D [T, d_model]; got shape "
                                  f"{list(array.shape)}", field=f"sequences[{index}].embeddings")
        if array.dtype.newbyteorder("=") != np.dtype(np.float16):
            array = array.astype(np.float32)
        return pb.Sequence(embeddings=to_tensor(array))
    raise InvalidArgument("INVALID_ARGUMENT", f"expected integer token ids or float embeddings; got dtype "
                          f"{array.dtype}", field=f"sequences[{index}]")


def split_sequences(sequences: Sequences) -> list[npt.ArrayLike | str]:
    if isinstance(sequences, np.ndarray):
        if (sequences.dtype.kind in "iu" and sequences.ndim == 2) or (sequences.dtype.kind == "f"
                                                                       and sequences.ndim == 3):
            return list(sequences)
        raise InvalidArgument("INVALID_ARGUMENT", "pass a list of sequences (e.g. [ids]), a 2-D array of ids or a "
                              f"3-D array of embeddings; got an array of shape {list(sequences.shape)}",
                              field="sequences")
    if isinstance(sequences, str | bytes) or not isinstance(sequences, Iterable):
        raise InvalidArgument("INVALID_ARGUMENT", f"sequences must be a list of arrays or strings; got "
                              f"{type(sequences).__name__} (one text: pass [text])", field="sequences")
    items = list(sequences)
    if items and all(np.ndim(item) == 0 and not isinstance(item, str) for item in items):
        raise InvalidArgument("INVALID_ARGUMENT", "got a flat list of numbers: pass a list of sequences, e.g. [ids]",
                              field="sequences")
    return items


def build_request(sequences: Sequences, options: EncodeOptions, request_id: str = "") -> pb.EncodeRequest:
    items = split_sequences(sequences)
    output, attention = options.to_proto(text=any(isinstance(s, str) for s in items))
    return pb.EncodeRequest(
        request_id=request_id, sequences=[to_sequence(i, s) for i, s in enumerate(items)],
        output=output, attention=attention, causal=options.causal, truncate=options.truncate,
        long_inputs=_choice("long_inputs", options.long_inputs, LONG_INPUTS) if options.long_inputs is not None
        else pb.LONG_INPUTS_UNSPECIFIED, chunk_stride=options.stride,
    )


def _floats(tensor: pb.Tensor) -> FloatArray:
    """A writable copy in the wire's dtype (float16 stays float16; bfloat16 is widened to float32 by
    from_tensor, exactly): from_tensor views the message's bytes read-only."""
    array: FloatArray = np.array(from_tensor(tensor), copy=True)
    return array


@dataclass(frozen=True)
class ResponseMetadata:
    """How the server ran the call (`attention.v1.ResponseMetadata`)."""

    queue_us: int  # longest wait of one of the call's sequences for a batch
    compute_us: int  # longest forward (plus any fp32 re-run) one of them rode in
    batch_size: int  # sequences in the largest batch that carried one of them
    padded_length: int  # padded length of that batch
    precision: str  # fp32 | fp16 | bf16
    fp32_retry: bool  # some sequence was re-run in fp32 after a non-finite reduced-precision output
    device: str
    model_name: str
    model_version: str

    @classmethod
    def from_proto(cls, m: pb.ResponseMetadata) -> ResponseMetadata:
        return cls(int(m.queue_us), int(m.compute_us), int(m.batch_size), int(m.padded_length), m.precision,
                   bool(m.fp32_retry), m.device, m.model_name, m.model_version)


@dataclass(frozen=True)
class SparseVector:
    """One sequence's SPLADE vector over the model's vocabulary: `indices` (token ids, ascending, int32)
    and `values` (float32, max over its tokens of log(1 + relu(MLM logit))), of the same length."""

    indices: npt.NDArray[np.int32]
    values: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return int(self.indices.size)

    def dense(self, size: int) -> npt.NDArray[np.float32]:
        """The vector as a dense [size] float32 array (size: the model's vocab_size)."""
        out = np.zeros(size, np.float32)
        out[self.indices] = self.values
        return out

    @classmethod
    def from_proto(cls, m: pb.SparseVector) -> SparseVector:
        return cls(np.array(m.indices, dtype=np.int32), np.array(m.values, dtype=np.float32))


@dataclass(frozen=True)
class EncodeResult:
    """One call's outputs, per sequence and in request order. A list is empty when that output was
    not asked for: `hidden` ([T, d_model] each) unless return_hidden=False, `pooled` ([d_model], or
    [dimensions]; int8/uint8 when quantized: [dimensions / 8] packed bits for binary/ubinary) each when
    pooling != "none", `attention` ([L, H or 1, T, T] each) when attention was asked."""

    hidden: list[FloatArray]
    pooled: list[npt.NDArray[Any]]  # float, or int8/uint8 (quantization)
    attention: list[FloatArray]
    nonfinite: list[bool]  # the reduced-precision output was NaN/Inf; the values are its fp32 re-run
    metadata: ResponseMetadata
    request_id: str = ""
    token_counts: list[int] = field(default_factory=list)  # tokens each sequence ran with
    truncated: list[bool] = field(default_factory=list)  # cut to the model's limit (long_inputs="truncate")
    windows: list[int] = field(default_factory=list)  # long_inputs="chunk": windows encoded; 0 = in one piece
    token_ids: list[npt.NDArray[np.int64]] = field(default_factory=list)  # text, with return_tokens
    tokens: list[list[str]] = field(default_factory=list)  # text, with return_tokens
    sparse: list[SparseVector] = field(default_factory=list)  # with sparse=...

    def __len__(self) -> int:
        return len(self.nonfinite)

    @classmethod
    def from_proto(cls, response: pb.EncodeResponse) -> EncodeResult:
        outs = response.outputs
        return cls(
            hidden=[_floats(o.hidden) for o in outs if o.HasField("hidden")],
            pooled=[_floats(o.pooled) for o in outs if o.HasField("pooled")],
            attention=[_floats(o.attention) for o in outs if o.HasField("attention")],
            nonfinite=[bool(o.nonfinite) for o in outs],
            metadata=ResponseMetadata.from_proto(response.metadata),
            request_id=response.request_id,
            token_counts=[int(o.token_count) for o in outs],
            truncated=[bool(o.truncated) for o in outs],
            windows=[int(o.windows) for o in outs],
            token_ids=[np.array(from_tensor(o.token_ids), dtype=np.int64) for o in outs if o.HasField("token_ids")],
            tokens=[list(o.tokens) for o in outs if o.HasField("token_ids")],
            sparse=[SparseVector.from_proto(o.sparse) for o in outs if o.HasField("sparse")],
        )


@dataclass(frozen=True)
class StreamRequest:
    """One request of `EncoderClient.encode_stream`. An empty `request_id` is replaced by the
    request's index in the stream (responses arrive in completion order, matched by id)."""

    sequences: Sequences
    request_id: str = ""
    options: EncodeOptions = field(default_factory=EncodeOptions)


@dataclass(frozen=True)
class Limits:
    max_sequences_per_call: int
    max_tokens_per_call: int
    max_message_bytes: int
    max_attention_bytes: int


@dataclass(frozen=True)
class BatchBudget:
    """The server's token budget of one batch and where it came from (`attention.v1.BatchBudget`)."""

    max_batch_tokens: int
    reason: str  # "configured", a device default, or the curve measured at warm-up and the choice
    tokens_per_second: dict[int, float] = field(default_factory=dict)  # the warm-up curve; empty: not measured
    model_workers: int = 0  # CPU batches run side by side; 0: a server that does not say
    workers_reason: str = ""  # "configured", a device default, or the splits measured at warm-up

    @classmethod
    def from_proto(cls, m: pb.BatchBudget) -> BatchBudget:
        return cls(int(m.max_batch_tokens), m.reason, {int(k): float(v) for k, v in m.tokens_per_second.items()},
                   int(m.model_workers), m.workers_reason)


@dataclass(frozen=True)
class TextInfo:
    """How a model served with a tokenizer takes text (`attention.v1.TextInfo`)."""

    max_tokens: int  # per text, special tokens included
    truncation_side: str
    default_pooling: str  # "mean" | "cls": what pooling="model" means
    default_normalize: bool
    prompts: dict[str, str]
    default_prompt_name: str
    tokenizer_checksum: str
    max_text_chars: int


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the limits a caller must respect (`attention.v1.ModelInfo`)."""

    name: str
    version: str
    checksum: str
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    max_length: int
    positional: str
    precision: str
    device: str
    limits: Limits
    text: TextInfo | None = None  # None: the model takes token ids and embeddings only
    attention_scale: float = 0.0  # the scale the model's attention scores use
    standard_scale: bool = True  # ... 1/sqrt(d_head); False: the model was trained with another
    relative_bias: str = "none"  # none | shared | per_layer
    # The bundle's int8/uint8 calibration (min, max): d_model values each, or one pair; None: calls send their own.
    quantization_ranges: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    tasks: tuple[str, ...] = ()  # what the model serves: embed, classify, rerank, sparse (docs/tasks.md)
    labels: tuple[str, ...] = ()  # the classification head's labels, in id order (classify's scores)
    precision_reason: str = ""  # "configured", or what was measured at warm-up and why this precision
    batch_budget: BatchBudget | None = None  # None: a server that does not say

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> ModelInfo:
        limits = Limits(int(m.limits.max_sequences_per_call), int(m.limits.max_tokens_per_call),
                        int(m.limits.max_message_bytes), int(m.limits.max_attention_bytes))
        t = m.text
        text = TextInfo(int(t.max_tokens), t.truncation_side, "cls" if t.default_pooling == pb.POOLING_CLS else "mean",
                        bool(t.default_normalize), dict(t.prompts), t.default_prompt_name, t.tokenizer_checksum,
                        int(t.max_text_chars)) if t.accepted else None
        return cls(m.name, m.version, m.checksum, int(m.d_model), int(m.n_heads), int(m.n_layers),
                   int(m.vocab_size), int(m.max_length), m.positional, m.precision, m.device, limits, text,
                   float(m.attention_scale), bool(m.standard_scale), m.relative_bias or "none",
                   (tuple(m.quantization_ranges.min), tuple(m.quantization_ranges.max))
                   if m.HasField("quantization_ranges") else None, tuple(m.tasks), tuple(m.labels),
                   m.precision_reason, BatchBudget.from_proto(m.batch_budget) if m.HasField("batch_budget") else None)


@dataclass(frozen=True)
class Tokenized:
    """One text as the served model's tokenizer cuts it (`attention.v1.TokenizedText`)."""

    ids: list[int]  # [CLS] ... [SEP] included: the ids Encode runs
    tokens: list[str]
    truncated: bool  # cut to the model's token limit (tokenize(..., truncate=True))

    @property
    def token_count(self) -> int:
        return len(self.ids)

    @classmethod
    def many_from_proto(cls, m: pb.TokenizeResponse) -> list[Tokenized]:
        return [cls(list(t.ids), list(t.tokens), bool(t.truncated)) for t in m.texts]


# -- Classify and Rerank ----------------------------------------------------------------------------

ClassifyInput = str | tuple[str, str]
"""One input of `classify`: a text, or a (text, text) pair encoded as one sequence as the model's tokenizer
pairs them."""


def _is_pair(item: object) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2


def _texts(name: str, texts: object) -> list[str]:
    """A list of str, checked before anything is sent: a lone str (or anything not a sequence of str)
    is a TypeError naming the argument."""
    if isinstance(texts, str | bytes) or not isinstance(texts, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a list of str; got {type(texts).__name__}"
                        + (" (one text: pass [text])" if isinstance(texts, str) else ""))
    items = list(texts)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{i}] must be a str; got {type(item).__name__}")
    return items


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def build_classify_request(inputs: Sequence[ClassifyInput], raw_scores: bool, truncate: bool,
                           request_id: str = "") -> pb.ClassifyRequest:
    """texts (all str) or pairs (all (str, str)); a mix is InvalidArgument naming inputs[i]."""
    if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence):
        raise TypeError(f"inputs must be a list of texts or (text, text) pairs; got {type(inputs).__name__}"
                        + (" (one text: pass [text])" if isinstance(inputs, str) else ""))
    items = list(inputs)
    request = pb.ClassifyRequest(request_id=request_id, raw_scores=_flag("raw_scores", raw_scores),
                                 truncate=_flag("truncate", truncate))
    pairs = bool(items) and _is_pair(items[0])
    for i, item in enumerate(items):
        if _is_pair(item) != pairs:
            raise InvalidArgument("INVALID_ARGUMENT", f"inputs[{i}] is a {'text' if pairs else 'pair'} but inputs[0] "
                                  f"is a {'pair' if pairs else 'text'}: one call classifies texts or pairs, not "
                                  "both", field=f"inputs[{i}]")
        if pairs:
            first, second = item[0], item[1]  # a 2-item tuple or list (_is_pair)
            if not (isinstance(first, str) and isinstance(second, str)):
                raise TypeError(f"inputs[{i}] must be a (str, str) pair; got ({type(first).__name__}, "
                                f"{type(second).__name__})")
            request.pairs.append(pb.TextPair(first=first, second=second))
        elif isinstance(item, str):
            request.texts.append(item)
        else:
            raise TypeError(f"inputs[{i}] must be a str or a (str, str) pair; got {type(item).__name__}")
    return request


def build_rerank_request(query: str, texts: Sequence[str], top_n: int | None, raw_scores: bool, return_text: bool,
                         truncate: bool, request_id: str = "") -> pb.RerankRequest:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str; got {type(query).__name__}")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int | np.integer)):
        raise TypeError(f"top_n must be an int or None; got {type(top_n).__name__}")
    request = pb.RerankRequest(request_id=request_id, query=query, texts=_texts("texts", texts),
                               raw_scores=_flag("raw_scores", raw_scores),
                               return_text=_flag("return_text", return_text), truncate=_flag("truncate", truncate))
    if top_n is not None:
        request.top_n = int(top_n)
    return request


@dataclass(frozen=True)
class Classification:
    """One input's label scores (`attention.v1.Classification`): `scores` maps each label to its score, in the
    model's label (id) order (`model_info().labels`); probabilities (softmax, or sigmoid for multi-label and
    one-label heads) unless raw_scores, then the logits."""

    scores: dict[str, float]
    token_count: int  # of the text (pair), special tokens included
    truncated: bool  # cut to the model's token limit (truncate=True)

    @property
    def label(self) -> str:
        """The label with the highest score (the first of equals)."""
        return max(self.scores, key=lambda k: self.scores[k])

    @classmethod
    def many_from_proto(cls, m: pb.ClassifyResponse) -> list[Classification]:
        return [cls({s.label: float(s.score) for s in r.scores}, int(r.token_count), bool(r.truncated))
                for r in m.results]


@dataclass(frozen=True)
class RankedText:
    """One text of a rerank (`attention.v1.RankedText`): its `index` in the call's texts, its `score`
    (sigmoid of the logit unless raw_scores), and the `text` itself with return_text, else None."""

    index: int
    score: float
    text: str | None
    token_count: int  # of the (query, text) pair, special tokens included
    truncated: bool

    @classmethod
    def many_from_proto(cls, m: pb.RerankResponse, return_text: bool) -> list[RankedText]:
        return [cls(int(r.index), float(r.score), r.text if return_text else None, int(r.token_count),
                    bool(r.truncated)) for r in m.results]
