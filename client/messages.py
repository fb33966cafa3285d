"""Python values <-> `attention.v1` messages: request options, results and model info as dataclasses.

Outputs are float32 numpy arrays (fp16/bf16 on the wire are widened), writable, one per sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from client.errors import InvalidArgument
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.wire import from_tensor, to_tensor

Pooling = Literal["none", "mean", "cls"]
Heads = Literal["all", "mean"]
DTypeName = Literal["float32", "float16", "bfloat16"]
FloatArray = npt.NDArray[np.float32]
Sequences = Sequence[npt.ArrayLike] | npt.NDArray[np.generic]
"""Token ids (1-D integer, [T]) or embeddings (2-D float, [T, d_model]), one item per sequence. A
2-D integer array is taken as rows of ids, a 3-D float array as a batch of embedding sequences."""

E = TypeVar("E", pb.Pooling, pb.HeadReduction, pb.DType)

POOLING: dict[str, pb.Pooling] = {"none": pb.POOLING_NONE, "mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS}
HEADS: dict[str, pb.HeadReduction] = {"all": pb.HEADS_ALL, "mean": pb.HEADS_MEAN}
DTYPES: dict[str, pb.DType] = {
    "float32": pb.DTYPE_FLOAT32, "fp32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16, "fp16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16, "bf16": pb.DTYPE_BFLOAT16,
}


def _choice(name: str, value: str, table: dict[str, E]) -> E:
    if value not in table:
        raise InvalidArgument("INVALID_ARGUMENT", f"{name} must be one of {sorted(table)}; got {value!r}", field=name)
    return table[value]


@dataclass(frozen=True)
class EncodeOptions:
    """What to compute and return for every sequence of one call (see `EncoderClient.encode`)."""

    pooling: Pooling = "none"
    return_hidden: bool = True
    output_dtype: DTypeName = "float32"
    attention: bool = False
    layers: tuple[int, ...] | None = None
    heads: Heads = "all"
    attention_dtype: DTypeName = "float32"
    causal: bool = False

    def to_proto(self) -> tuple[pb.OutputOptions, pb.AttentionOptions]:
        output = pb.OutputOptions(return_hidden=self.return_hidden, pooling=_choice("pooling", self.pooling, POOLING),
                                  dtype=_choice("output_dtype", self.output_dtype, DTYPES))
        # Naming layers is asking for attention.
        want = self.attention or self.layers is not None
        attention = pb.AttentionOptions(
            return_attention=want, layers=list(self.layers or ()) if want else [],
            heads=_choice("heads", self.heads, HEADS), dtype=_choice("attention_dtype", self.attention_dtype, DTYPES),
        )
        return output, attention


def to_sequence(index: int, value: npt.ArrayLike) -> pb.Sequence:
    """One sequence: integer [T] -> token_ids (int32 kept, else int64); float [T, D] -> embeddings
    (float16 kept, else float32)."""
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
        if array.ndim != 2:
            raise InvalidArgument("INVALID_ARGUMENT", f"embeddings must be 2-D [T, d_model]; got shape "
                                  f"{list(array.shape)}", field=f"sequences[{index}].embeddings")
        if array.dtype.newbyteorder("=") != np.dtype(np.float16):
            array = array.astype(np.float32)
        return pb.Sequence(embeddings=to_tensor(array))
    raise InvalidArgument("INVALID_ARGUMENT", f"expected integer token ids or float embeddings; got dtype "
                          f"{array.dtype}", field=f"sequences[{index}]")


def split_sequences(sequences: Sequences) -> list[npt.ArrayLike]:
    if isinstance(sequences, np.ndarray):
        if (sequences.dtype.kind in "iu" and sequences.ndim == 2) or (sequences.dtype.kind == "f"
                                                                       and sequences.ndim == 3):
            return list(sequences)
        raise InvalidArgument("INVALID_ARGUMENT", "pass a list of sequences (e.g. [ids]), a 2-D array of ids or a "
                              f"3-D array of embeddings; got an array of shape {list(sequences.shape)}",
                              field="sequences")
    if isinstance(sequences, str | bytes) or not isinstance(sequences, Iterable):
        raise InvalidArgument("INVALID_ARGUMENT", f"sequences must be a list of arrays; got {type(sequences).__name__}",
                              field="sequences")
    items = list(sequences)
    if items and all(np.ndim(item) == 0 for item in items):
        raise InvalidArgument("INVALID_ARGUMENT", "got a flat list of numbers: pass a list of sequences, e.g. [ids]",
                              field="sequences")
    return items


def build_request(sequences: Sequences, options: EncodeOptions, request_id: str = "") -> pb.EncodeRequest:
    output, attention = options.to_proto()
    return pb.EncodeRequest(
        request_id=request_id, sequences=[to_sequence(i, s) for i, s in enumerate(split_sequences(sequences))],
        output=output, attention=attention, causal=options.causal,
    )


def _float32(tensor: pb.Tensor) -> FloatArray:
    # A writable float32 copy: from_tensor views the message's bytes read-only, and widens bf16 only.
    return np.array(from_tensor(tensor), dtype=np.float32, copy=True)


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
class EncodeResult:
    """One call's outputs, per sequence and in request order. A list is empty when that output was
    not asked for: `hidden` ([T, d_model] each) unless return_hidden=False, `pooled` ([d_model]
    each) when pooling != "none", `attention` ([L, H or 1, T, T] each) when attention was asked."""

    hidden: list[FloatArray]
    pooled: list[FloatArray]
    attention: list[FloatArray]
    nonfinite: list[bool]  # the reduced-precision output was NaN/Inf; the values are its fp32 re-run
    metadata: ResponseMetadata
    request_id: str = ""

    def __len__(self) -> int:
        return len(self.nonfinite)

    @classmethod
    def from_proto(cls, response: pb.EncodeResponse) -> EncodeResult:
        outs = response.outputs
        return cls(
            hidden=[_float32(o.hidden) for o in outs if o.HasField("hidden")],
            pooled=[_float32(o.pooled) for o in outs if o.HasField("pooled")],
            attention=[_float32(o.attention) for o in outs if o.HasField("attention")],
            nonfinite=[bool(o.nonfinite) for o in outs],
            metadata=ResponseMetadata.from_proto(response.metadata),
            request_id=response.request_id,
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

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> ModelInfo:
        limits = Limits(int(m.limits.max_sequences_per_call), int(m.limits.max_tokens_per_call),
                        int(m.limits.max_message_bytes), int(m.limits.max_attention_bytes))
        return cls(m.name, m.version, m.checksum, int(m.d_model), int(m.n_heads), int(m.n_layers),
                   int(m.vocab_size), int(m.max_length), m.positional, m.precision, m.device, limits)
