from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_NONE: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_CLS: _ClassVar[Pooling]
    POOLING_MODEL: _ClassVar[Pooling]

class MultiVector(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MULTI_VECTOR_NONE: _ClassVar[MultiVector]
    MULTI_VECTOR_QUERY: _ClassVar[MultiVector]
    MULTI_VECTOR_DOCUMENT: _ClassVar[MultiVector]

class Quantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUANTIZATION_NONE: _ClassVar[Quantization]
    QUANTIZATION_INT8: _ClassVar[Quantization]
    QUANTIZATION_UINT8: _ClassVar[Quantization]
    QUANTIZATION_BINARY: _ClassVar[Quantization]
    QUANTIZATION_UBINARY: _ClassVar[Quantization]

class HeadReduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEADS_ALL: _ClassVar[HeadReduction]
    HEADS_MEAN: _ClassVar[HeadReduction]

class LongInputs(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LONG_INPUTS_UNSPECIFIED: _ClassVar[LongInputs]
    LONG_INPUTS_ERROR: _ClassVar[LongInputs]
    LONG_INPUTS_TRUNCATE: _ClassVar[LongInputs]
    LONG_INPUTS_CHUNK: _ClassVar[LongInputs]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
POOLING_NONE: Pooling
POOLING_MEAN: Pooling
POOLING_CLS: Pooling
POOLING_MODEL: Pooling
MULTI_VECTOR_NONE: MultiVector
MULTI_VECTOR_QUERY: MultiVector
MULTI_VECTOR_DOCUMENT: MultiVector
QUANTIZATION_NONE: Quantization
QUANTIZATION_INT8: Quantization
QUANTIZATION_UINT8: Quantization
QUANTIZATION_BINARY: Quantization
QUANTIZATION_UBINARY: Quantization
HEADS_ALL: HeadReduction
HEADS_MEAN: HeadReduction
LONG_INPUTS_UNSPECIFIED: LongInputs
LONG_INPUTS_ERROR: LongInputs
LONG_INPUTS_TRUNCATE: LongInputs
LONG_INPUTS_CHUNK: LongInputs

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("token_ids", "embeddings", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: Tensor
    embeddings: Tensor
    text: str
    def __init__(self, token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("return_hidden", "pooling", "dtype", "normalize", "prompt_name", "return_tokens", "dimensions", "quantization", "quantization_ranges", "sparse", "vectors")
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_RANGES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    return_hidden: bool
    pooling: Pooling
    dtype: DType
    normalize: bool
    prompt_name: str
    return_tokens: bool
    dimensions: int
    quantization: Quantization
    quantization_ranges: QuantizationRanges
    sparse: SparseOptions
    vectors: MultiVector
    def __init__(self, return_hidden: _Optional[bool] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., normalize: _Optional[bool] = ..., prompt_name: _Optional[str] = ..., return_tokens: _Optional[bool] = ..., dimensions: _Optional[int] = ..., quantization: _Optional[_Union[Quantization, str]] = ..., quantization_ranges: _Optional[_Union[QuantizationRanges, _Mapping]] = ..., sparse: _Optional[_Union[SparseOptions, _Mapping]] = ..., vectors: _Optional[_Union[MultiVector, str]] = ...) -> None: ...

class QuantizationRanges(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: _containers.RepeatedScalarFieldContainer[float]
    max: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, min: _Optional[_Iterable[float]] = ..., max: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseOptions(_message.Message):
    __slots__ = ("top_k", "threshold")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    threshold: float
    def __init__(self, top_k: _Optional[int] = ..., threshold: _Optional[float] = ...) -> None: ...

class SparseVector(_message.Message):
    __slots__ = ("indices", "values")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class AttentionOptions(_message.Message):
    __slots__ = ("return_attention", "layers", "heads", "dtype")
    RETURN_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    return_attention: bool
    layers: _containers.RepeatedScalarFieldContainer[int]
    heads: HeadReduction
    dtype: DType
    def __init__(self, return_attention: _Optional[bool] = ..., layers: _Optional[_Iterable[int]] = ..., heads: _Optional[_Union[HeadReduction, str]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "sequences", "output", "attention", "causal", "truncate", "long_inputs", "chunk_stride", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    LONG_INPUTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    output: OutputOptions
    attention: AttentionOptions
    causal: bool
    truncate: bool
    long_inputs: LongInputs
    chunk_stride: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., attention: _Optional[_Union[AttentionOptions, _Mapping]] = ..., causal: _Optional[bool] = ..., truncate: _Optional[bool] = ..., long_inputs: _Optional[_Union[LongInputs, str]] = ..., chunk_stride: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ResponseMetadata(_message.Message):
    __slots__ = ("queue_us", "compute_us", "batch_size", "padded_length", "precision", "fp32_retry", "device", "model_name", "model_version")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PADDED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    FP32_RETRY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    batch_size: int
    padded_length: int
    precision: str
    fp32_retry: bool
    device: str
    model_name: str
    model_version: str
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., padded_length: _Optional[int] = ..., precision: _Optional[str] = ..., fp32_retry: _Optional[bool] = ..., device: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("hidden", "pooled", "attention", "nonfinite", "token_count", "truncated", "token_ids", "tokens", "windows", "sparse", "vectors")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    pooled: Tensor
    attention: Tensor
    nonfinite: bool
    token_count: int
    truncated: bool
    token_ids: Tensor
    tokens: _containers.RepeatedScalarFieldContainer[str]
    windows: int
    sparse: SparseVector
    vectors: Tensor
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., pooled: _Optional[_Union[Tensor, _Mapping]] = ..., attention: _Optional[_Union[Tensor, _Mapping]] = ..., nonfinite: _Optional[bool] = ..., token_count: _Optional[int] = ..., truncated: _Optional[bool] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[_Iterable[str]] = ..., windows: _Optional[int] = ..., sparse: _Optional[_Union[SparseVector, _Mapping]] = ..., vectors: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    field: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("request_id", "outputs", "metadata", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    metadata: ResponseMetadata
    error: StreamError
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., metadata: _Optional[_Union[ResponseMetadata, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sequences_per_call", "max_tokens_per_call", "max_message_bytes", "max_attention_bytes")
    MAX_SEQUENCES_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_sequences_per_call: int
    max_tokens_per_call: int
    max_message_bytes: int
    max_attention_bytes: int
    def __init__(self, max_sequences_per_call: _Optional[int] = ..., max_tokens_per_call: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_attention_bytes: _Optional[int] = ...) -> None: ...

class TextInfo(_message.Message):
    __slots__ = ("accepted", "max_tokens", "truncation_side", "default_pooling", "default_normalize", "prompts", "default_prompt_name", "tokenizer_checksum", "max_text_chars")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POOLING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    max_tokens: int
    truncation_side: str
    default_pooling: Pooling
    default_normalize: bool
    prompts: _containers.ScalarMap[str, str]
    default_prompt_name: str
    tokenizer_checksum: str
    max_text_chars: int
    def __init__(self, accepted: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., truncation_side: _Optional[str] = ..., default_pooling: _Optional[_Union[Pooling, str]] = ..., default_normalize: _Optional[bool] = ..., prompts: _Optional[_Mapping[str, str]] = ..., default_prompt_name: _Optional[str] = ..., tokenizer_checksum: _Optional[str] = ..., max_text_chars: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "checksum", "d_model", "n_heads", "n_layers", "vocab_size", "max_length", "positional", "precision", "device", "limits", "text", "attention_scale", "standard_scale", "relative_bias", "precision_reason", "precision_forward_ms", "batch_budget", "quantization_ranges", "tasks", "labels", "backend", "vector_dim", "sparse_kind", "aliases", "precision_fidelity")
    class PrecisionForwardMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PrecisionFidelityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    POSITIONAL_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SCALE_FIELD_NUMBER: _ClassVar[int]
    STANDARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_REASON_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BUDGET_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_RANGES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VECTOR_DIM_FIELD_NUMBER: _ClassVar[int]
    SPARSE_KIND_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIDELITY_FIELD_NUMBER: _ClassVar[int]
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
    text: TextInfo
    attention_scale: float
    standard_scale: bool
    relative_bias: str
    precision_reason: str
    precision_forward_ms: _containers.ScalarMap[str, float]
    batch_budget: BatchBudget
    quantization_ranges: QuantizationRanges
    tasks: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    vector_dim: int
    sparse_kind: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    precision_fidelity: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., checksum: _Optional[str] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., n_layers: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_length: _Optional[int] = ..., positional: _Optional[str] = ..., precision: _Optional[str] = ..., device: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., text: _Optional[_Union[TextInfo, _Mapping]] = ..., attention_scale: _Optional[float] = ..., standard_scale: _Optional[bool] = ..., relative_bias: _Optional[str] = ..., precision_reason: _Optional[str] = ..., precision_forward_ms: _Optional[_Mapping[str, float]] = ..., batch_budget: _Optional[_Union[BatchBudget, _Mapping]] = ..., quantization_ranges: _Optional[_Union[QuantizationRanges, _Mapping]] = ..., tasks: _Optional[_Iterable[str]] = ..., labels: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., vector_dim: _Optional[int] = ..., sparse_kind: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., precision_fidelity: _Optional[_Mapping[str, float]] = ...) -> None: ...

class BatchBudget(_message.Message):
    __slots__ = ("max_batch_tokens", "reason", "tokens_per_second", "model_workers", "workers_reason", "compared_workers", "compared_tokens_per_second")
    class TokensPerSecondEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class ComparedTokensPerSecondEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MODEL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPARED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    COMPARED_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    max_batch_tokens: int
    reason: str
    tokens_per_second: _containers.ScalarMap[int, float]
    model_workers: int
    workers_reason: str
    compared_workers: int
    compared_tokens_per_second: _containers.ScalarMap[int, float]
    def __init__(self, max_batch_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., tokens_per_second: _Optional[_Mapping[int, float]] = ..., model_workers: _Optional[int] = ..., workers_reason: _Optional[str] = ..., compared_workers: _Optional[int] = ..., compared_tokens_per_second: _Optional[_Mapping[int, float]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "prompt_name", "truncate", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    prompt_name: str
    truncate: bool
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., prompt_name: _Optional[str] = ..., truncate: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("ids", "tokens", "token_count", "truncated")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    token_count: int
    truncated: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., token_count: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    def __init__(self, texts: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ...) -> None: ...

class TextPair(_message.Message):
    __slots__ = ("first", "second")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SECOND_FIELD_NUMBER: _ClassVar[int]
    first: str
    second: str
    def __init__(self, first: _Optional[str] = ..., second: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "texts", "pairs", "raw_scores", "truncate", "attention", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    pairs: _containers.RepeatedCompositeFieldContainer[TextPair]
    raw_scores: bool
    truncate: bool
    attention: AttentionOptions
    model: str
    def __init__(self, request_id: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., pairs: _Optional[_Iterable[_Union[TextPair, _Mapping]]] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., attention: _Optional[_Union[AttentionOptions, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("scores", "token_count", "truncated", "attention")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[LabelScore]
    token_count: int
    truncated: bool
    attention: Tensor
    def __init__(self, scores: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ..., token_count: _Optional[int] = ..., truncated: _Optional[bool] = ..., attention: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "results", "metadata")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    metadata: ResponseMetadata
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., metadata: _Optional[_Union[ResponseMetadata, _Mapping]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "query", "texts", "top_n", "return_text", "raw_scores", "truncate", "attention", "model", "scoring", "weights")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    query: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_text: bool
    raw_scores: bool
    truncate: bool
    attention: AttentionOptions
    model: str
    scoring: str
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., query: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_text: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., attention: _Optional[_Union[AttentionOptions, _Mapping]] = ..., model: _Optional[str] = ..., scoring: _Optional[str] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class RankedText(_message.Message):
    __slots__ = ("index", "score", "text", "token_count", "truncated", "attention")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    text: str
    token_count: int
    truncated: bool
    attention: Tensor
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., text: _Optional[str] = ..., token_count: _Optional[int] = ..., truncated: _Optional[bool] = ..., attention: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "results", "metadata")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[RankedText]
    metadata: ResponseMetadata
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RankedText, _Mapping]]] = ..., metadata: _Optional[_Union[ResponseMetadata, _Mapping]] = ...) -> None: ...
