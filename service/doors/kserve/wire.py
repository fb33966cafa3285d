"""KServe v2 (the Open Inference Protocol)'s wire, transport-free: a `ModelInferRequest` -> the plan's
`Ask` (inputs decoded, outputs and parameters checked, with this door's field names), a `Ran` -> the
`ModelInferResponse`, and the size of a response before it is computed. The messages are the ones
`tritonclient` ships (`tritonclient.grpc.service_pb2`, `model_config_pb2`), so the wire is upstream's and
shares its descriptors with any tritonclient in the process. service/doors/kserve/core.py runs a call;
docs/kserve.md has the tables of inputs, outputs and parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as v2

from proto.attention.v1.codec import float32_to_bfloat16_bits
from service.chunking import ERROR, MODES, TRUNCATE
from service.config import ServiceConfig
from service.doors.calls import Ran
from service.errors import FailedPrecondition, InvalidInput, shown
from service.jobs import ModelSpec, Output
from service.output_range import check_arrays
from service.plan import (
    HEADS,
    ITEMSIZE,
    Ask,
    Names,
    Plan,
    Sizes,
    attention_bytes,
    check_count,
    check_task,
    takes_text,
)
from service.vectors import QUANTIZATIONS

PLATFORM = "pytorch_libtorch"  # Triton's name for a TorchScript model
JSON_NUMBER = 26  # bytes of a value as REST JSON: the longest float64 repr, and a comma

IDS, MASK, TYPES, TEXT = "input_ids", "attention_mask", "token_type_ids", "text"
HIDDEN, POOLED, EMBEDDINGS, ATTENTION = "last_hidden_state", "pooled", "embeddings", "attention"
SPARSE, LOGITS = "sparse", "logits"  # task heads (docs/tasks.md): SPLADE weights [vocab]; classifier logits [labels]
SCORES = "scores"  # rerank (parameter `query`): one score per `text` row, [batch], in the rows' order
# A late-interaction model's token vectors (parameter `vectors_mode`: query | document, default document):
# [batch, n, vector_dim], zero-padded past each row's count, which `token_vectors_count` ([batch] INT64) gives.
VECTORS, VECTOR_COUNTS = "token_vectors", "token_vectors_count"
DEFAULT_OUTPUTS = (HIDDEN, POOLED)
_INT_TYPES: dict[str, np.dtype[Any]] = {"INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}
_FLOAT_TYPES = _DTYPE = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
_ITEMSIZE = {"FP32": 4, "FP16": 2, "BF16": 2}
_POOLINGS = ("mean", "cls", "model")  # model: a text bundle's own
# Request parameters tritonclient or Triton itself may send, accepted and not acted on.
_IGNORED = frozenset({"priority", "triton_enable_empty_final_response"})
_PARAMETERS = frozenset({"pooling", "datatype", "attention_layers", "attention_heads", "attention_datatype",
                         "timeout", "normalize", "truncate", "prompt_name", "long_inputs",
                         "chunk_stride", "dimensions", "quantization", "quantization_min",
                         "quantization_max", "query", "raw_scores", "vectors_mode", "scoring",
                         "weights"}) | _IGNORED
_QUANTIZED = {"int8": "INT8", "binary": "INT8", "uint8": "UINT8", "ubinary": "UINT8"}  # the pooled output's datatype


@dataclass(frozen=True)
class InputTensor:
    """One input the door takes, as ModelMetadata and ModelConfig describe it."""

    name: str
    datatype: str  # v2's (INT32 is taken too for the id tensors)
    config_type: int  # model_config's
    dims: tuple[int, ...]  # after the batch dim
    optional: bool


def model_inputs(text_model: bool) -> list[InputTensor]:
    """Every input the door takes (`_inputs` decodes them): for a text model `text` too, and then either
    `text` or `input_ids` is given, so neither is required. `text` is one string per row, [batch, 1] as
    Triton writes it (what perf_analyzer sends for a data file's one-string lists; [batch] is taken too).
    The embeddings input of attention.v1 has no KServe tensor. One list for ModelMetadata, ModelConfig
    and the unknown-input error (`input_names`)."""
    ids = [InputTensor(name, "INT64", mc.TYPE_INT64, (-1,), optional=name != IDS or text_model)
           for name in (IDS, MASK, TYPES)]
    return ids + ([InputTensor(TEXT, "BYTES", mc.TYPE_STRING, (1,), optional=True)] if text_model else [])


def config_output(name: str, dims: list[int]) -> Any:
    """A ModelConfig output; a [batch] one (`scores`) is dims [1] reshaped to [], as Triton writes it."""
    data_type = mc.TYPE_INT64 if name == VECTOR_COUNTS else mc.TYPE_FP32
    if not dims:
        return mc.ModelOutput(name=name, data_type=data_type, dims=[1], reshape=mc.ModelTensorReshape(shape=[]))
    return mc.ModelOutput(name=name, data_type=data_type, dims=dims)



IDS_NAMES = Names(
    sequences=IDS, sequence="{kind}[{i}]", element="{kind}[{i}, {j}]",
    kinds=(("ids", IDS), ("embeddings", EMBEDDINGS), ("text", TEXT)), request_id="id", output="outputs",
    pooling="parameters.pooling", normalize="parameters.normalize", dtype="parameters.datatype",
    prompt_name="parameters.prompt_name", return_attention=ATTENTION, attention=ATTENTION,
    attention_layers="attention_layers", heads="parameters.attention_heads",
    attention_dtype="parameters.attention_datatype", long_inputs="parameters.long_inputs",
    chunk_stride="parameters.chunk_stride", texts=TEXT, dimensions="parameters.dimensions",
    quantization="parameters.quantization", ranges="parameters.quantization_min",
    ranges_min="parameters.quantization_min", ranges_max="parameters.quantization_max", task=LOGITS, sparse=SPARSE)
TEXT_NAMES = dataclasses.replace(IDS_NAMES, sequences=TEXT)
RERANK_NAMES = dataclasses.replace(  # a rerank's pair (query, text[i]) is named as its row, text[i]
    TEXT_NAMES, task="parameters.query", query="parameters.query", kinds=(*TEXT_NAMES.kinds, ("pair", TEXT)))


def _truncating(ask: Ask) -> bool:
    return ask.long_inputs == TRUNCATE or (ask.long_inputs is None and ask.truncate)


def _sizes(plan: Plan, spec: ModelSpec, padded_to: int, text: Callable[[str], bool]) -> Sizes:
    """A KServe v2 response: every row padded to `padded_to`, each output's values as raw tensor bytes, or as
    JSON text (`text(name)`: KServe REST's `binary_data: false`, JSON_NUMBER bytes a value), in a small
    envelope."""
    per_value = ITEMSIZE[plan.output_dtype]
    rows = plan.sequences
    hidden = sum(padded_to for job in rows if job.return_hidden) * spec.d_model
    pooled_values, pooled_size = plan.pooled_size(spec.d_model)
    attention = attention_bytes(plan, spec, padded_to)
    heads = sum(spec.vocab_size if job.head == "sparse" else len(spec.labels) + (job.head == "rerank")
                for job in rows if job.head)  # a rerank row: its logits and its score
    head_size = 4 if plan.task != "embed" else per_value
    # token vectors padded to the longest row's count (and the counts); packed bits a byte a value
    counts = [len(job.vector_rows) if job.vector_rows is not None else job.length for job in rows if job.vectors]
    packed = plan.vectors is not None and plan.vectors.quantization in ("binary", "ubinary")
    width = (spec.vector_dim + 7) // 8 if packed else spec.vector_dim
    vectors = len(counts) * max(counts, default=0) * width
    parts = ((HIDDEN, hidden, per_value), (POOLED, sum(1 for job in rows if job.pooling) * pooled_values, pooled_size),
             (LOGITS, heads, head_size), (ATTENTION, attention // ITEMSIZE[plan.attention_dtype],
                                          ITEMSIZE[plan.attention_dtype]),
             (VECTORS, vectors, 1 if packed else per_value), (VECTOR_COUNTS, len(counts), 8))
    total = sum(values * (JSON_NUMBER if text(name) else size) for name, values, size in parts)
    return Sizes(attention, total + 1024 + len(plan.request_id))  # + names, shapes


def final_flag(request: Any) -> bool:
    """Triton's `triton_enable_empty_final_response`: mark each (single) response as the request's last."""
    flag = request.parameters.get("triton_enable_empty_final_response")
    return flag is not None and flag.bool_param


def parameters(parameters: Any) -> dict[str, Any]:
    """Request parameters by name, as Python values; unknown names refused."""
    values = {}
    for name, value in parameters.items():
        if name not in _PARAMETERS:
            raise InvalidInput(f"parameters.{shown(name, quote=False)}",
                               f"unknown parameter; known: {', '.join(sorted(_PARAMETERS))}")
        kind = value.WhichOneof("parameter_choice")
        values[name] = None if kind is None else getattr(value, kind)
    return values


def _str_param(params: dict[str, Any], name: str, allowed: Sequence[str], default: str) -> str:
    value = params.get(name, default)
    if not isinstance(value, str) or value.lower() not in allowed:
        raise InvalidInput(f"parameters.{name}", f"must be one of {', '.join(allowed)}; got {shown(value)}")
    return value.lower()


def int_param(params: dict[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"parameters.{name}", f"must be a non-negative integer; got {shown(value)}")
    return value


def _floats_param(params: dict[str, Any], name: str) -> tuple[float, ...] | None:
    """`quantization_min` / `_max`: a number (one for every dimension), or a string of comma-separated
    numbers, one per dimension; absent = None. The plan checks the count, finiteness and order."""
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),)
    try:
        if isinstance(value, str) and len(value) <= 1 << 18:
            return tuple(float(part) for part in value.split(","))
    except ValueError:
        pass
    raise InvalidInput(f"parameters.{name}", "must be a number or comma-separated numbers (one per dimension); "
                       f"got {shown(value)}")


def _ranges(params: dict[str, Any]) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    low, high = _floats_param(params, "quantization_min"), _floats_param(params, "quantization_max")
    if (low is None) != (high is None):
        missing = "quantization_max" if high is None else "quantization_min"
        raise InvalidInput(f"parameters.{missing}", "required with the other bound of the calibration ranges")
    return None if low is None or high is None else (low, high)


def _dimensions(params: dict[str, Any]) -> int | None:
    value = params.get("dimensions")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidInput("parameters.dimensions", f"must be an integer; got {shown(value)}")
    return value


def _layers(params: dict[str, Any]) -> tuple[int, ...]:
    """`attention_layers`: an int64, or a string of comma-separated ints ("0,-1"); absent = all."""
    value = params.get("attention_layers")
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    try:
        if isinstance(value, str) and len(value) <= 1024:  # the plan checks each against the model's layers
            return tuple(int(part) for part in value.split(","))
    except ValueError:
        pass
    raise InvalidInput("parameters.attention_layers", f"must be an int or comma-separated ints; got {shown(value)}")


def _ask(request: Any, params: dict[str, Any], outputs: dict[str, str], spec: ModelSpec) -> Ask:
    """The v2 request's outputs and parameters as the plan's `Ask` (inputs filled in by the caller). A
    text model pools and normalises as the bundle says unless the parameters say otherwise."""
    pooled = POOLED in outputs or EMBEDDINGS in outputs
    for name in ("pooling", "normalize"):
        if name in params and not pooled:
            raise InvalidInput(f"parameters.{name}", "given, but no pooled (or embeddings) output requested")
    default = "model" if spec.tokenizer is not None else "mean"
    pooling = _str_param(params, "pooling", _POOLINGS, default) if pooled else "none"
    floats = [outputs_dtype for name, outputs_dtype in outputs.items() if name not in (ATTENTION, VECTOR_COUNTS)]
    # Sized by the widest of the hidden and pooled outputs (each is converted on its own when sent).
    dtype = max(floats, key=_ITEMSIZE.__getitem__) if floats else "FP32"
    wants_attention = ATTENTION in outputs
    for name in ("attention_layers", "attention_heads", "attention_datatype"):
        if name in params and not wants_attention:
            raise InvalidInput(f"parameters.{name}", "given, but the attention output is not requested")
    normalize = params.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise InvalidInput("parameters.normalize", f"must be a bool; got {shown(normalize)}")
    prompt = params.get("prompt_name", "")
    if not isinstance(prompt, str):
        raise InvalidInput("parameters.prompt_name", f"must be a string; got a {type(prompt).__name__}")
    truncate = params.get("truncate", False)
    if not isinstance(truncate, bool):
        raise InvalidInput("parameters.truncate", f"must be a bool; got {shown(truncate)}")
    query = _rerank_query(params, outputs)
    if "vectors_mode" in params and VECTORS not in outputs:
        raise InvalidInput("parameters.vectors_mode", f"given, but the {VECTORS} output is not requested")
    vectors = _str_param(params, "vectors_mode", ("query", "document"), "document") if VECTORS in outputs else None
    scoring = params.get("scoring", "")
    if not isinstance(scoring, str):
        raise InvalidInput("parameters.scoring", f"must be a string; got a {type(scoring).__name__}")
    weights = _floats_param(params, "weights")
    if query is None and (scoring or weights is not None):
        raise InvalidInput("parameters.scoring" if scoring else "parameters.weights", "applies to a rerank "
                           "(parameters.query) on a late-interaction model")
    if query is not None or LOGITS in outputs:  # a head's own call (texts in; attention may be asked beside)
        if query is None and set(outputs) - {LOGITS, ATTENTION}:
            raise InvalidInput("outputs", f"{LOGITS} comes alone (attention may be asked beside it)")
        task = "classify" if query is None else "rerank"
        for name in ("prompt_name", "dimensions", "quantization", "quantization_min", "quantization_max"):
            if name in params:
                raise InvalidInput(f"parameters.{name}", f"applies to embeddings, not to {task}")
        return Ask(inputs=(), request_id=request.id, return_hidden=False, task=task, query=query, truncate=truncate,
                   raw_scores=params.get("raw_scores") is True, scoring=scoring, weights=weights,
                   long_inputs=_str_param(params, "long_inputs", MODES, ERROR) if "long_inputs" in params else None,
                   chunk_stride=int_param(params, "chunk_stride", 0),
                   attention=_layers(params) if wants_attention else None,
                   heads=_str_param(params, "attention_heads", HEADS, "all"),
                   attention_dtype=_DTYPE[outputs.get(ATTENTION, "FP32")])
    return Ask(
        inputs=(), request_id=request.id, return_hidden=HIDDEN in outputs, pooling=pooling, normalize=normalize,
        dtype=_DTYPE[dtype], attention=_layers(params) if wants_attention else None,
        heads=_str_param(params, "attention_heads", HEADS, "all"),
        attention_dtype=_DTYPE[outputs.get(ATTENTION, "FP32")],
        long_inputs=_str_param(params, "long_inputs", MODES, ERROR) if "long_inputs" in params else None,
        truncate=truncate, chunk_stride=int_param(params, "chunk_stride", 0), prompt_name=prompt,
        dimensions=_dimensions(params), quantization=_str_param(params, "quantization", QUANTIZATIONS, "none"),
        quantization_ranges=_ranges(params),
        sparse=(0, 0.0) if SPARSE in outputs else None, vectors=vectors,
    )


def _rerank_query(params: dict[str, Any], outputs: dict[str, str]) -> str | None:
    """The parameter `query` (a rerank: its outputs `scores` and `logits`, attention beside), checked with the
    outputs asked; None: not a rerank (then `scores` and `raw_scores` are refused)."""
    query = params.get("query")
    if query is not None and not isinstance(query, str):
        raise InvalidInput("parameters.query", f"must be a string; got {shown(query)}")
    raw = params.get("raw_scores")
    if "raw_scores" in params and not isinstance(raw, bool):
        raise InvalidInput("parameters.raw_scores", f"must be a bool; got {shown(raw)}")
    if "raw_scores" in params and SCORES not in outputs:
        raise InvalidInput("parameters.raw_scores", f"given, but the {SCORES} output is not requested")
    if query is None:
        if SCORES in outputs:
            raise InvalidInput("parameters.query", f"required with the {SCORES} output: the query each text row "
                               "is scored against (a rerank)")
        return None
    for i, name in enumerate(outputs):
        if name not in (SCORES, LOGITS, ATTENTION):
            raise InvalidInput(f"outputs[{i}]", f"{shown(name)} is not a rerank output (parameters.query is given): "
                               f"ask {SCORES} or {LOGITS} (attention may be asked beside)")
    return query


def _requested(request: Any, allow_attention: bool, spec: ModelSpec) -> dict[str, str]:
    """Requested output name -> datatype, in the order asked (`embeddings` is `pooled` by another name;
    `sparse`, `logits` and `scores` only for a model with that head). None asked: `scores` for a rerank
    (parameter `query`), else last_hidden_state and pooled."""
    default = _float_param(request.parameters, "datatype", "parameters.datatype")
    if not request.outputs:
        return dict.fromkeys((SCORES,) if "query" in request.parameters else DEFAULT_OUTPUTS, default)
    known = (HIDDEN, POOLED, EMBEDDINGS, ATTENTION) + ((SPARSE,) if "sparse" in spec.tasks else ()) + (
        (LOGITS,) if "classify" in spec.tasks else ()) + (
        (SCORES,) if "rerank" in spec.tasks or spec.vector_dim else ()) + (
        (VECTORS, VECTOR_COUNTS) if spec.vector_dim else ())
    outputs: dict[str, str] = {}
    for i, output in enumerate(request.outputs):
        if output.name not in known:
            raise InvalidInput(f"outputs[{i}]",
                               f"unknown output {shown(output.name)}; this model has {', '.join(known)}")
        if output.name in outputs:
            raise InvalidInput(output.name, "requested twice")
        for name in output.parameters:
            if name != "datatype":
                raise InvalidInput(f"{output.name}.parameters.{shown(name, quote=False)}",
                                   "not supported (only datatype)")
        if output.name == ATTENTION and not allow_attention:
            raise FailedPrecondition("attention output is disabled on this deployment")
        fallback = _float_param(request.parameters, "attention_datatype", "parameters.attention_datatype") \
            if output.name == ATTENTION else default
        outputs[output.name] = "INT64" if output.name == VECTOR_COUNTS else _float_param(
            output.parameters, "datatype", f"{output.name}.parameters.datatype", fallback)
    if VECTORS in outputs:
        outputs.setdefault(VECTOR_COUNTS, "INT64")  # the rows of a padded tensor are nothing without their counts
    elif VECTOR_COUNTS in outputs:
        raise InvalidInput(VECTOR_COUNTS, f"comes with the {VECTORS} output")
    return outputs


def _float_param(parameters: Any, name: str, field: str, default: str = "FP32") -> str:
    if name not in parameters:
        return default
    value: str = parameters[name].string_param.upper()
    if value not in _FLOAT_TYPES:
        raise InvalidInput(field, f"must be FP32, FP16 or BF16; got {shown(parameters[name].string_param)}")
    return value


def _inputs(request: Any, spec: ModelSpec, config: ServiceConfig) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """Input name -> array ([batch, T] ints), from raw_input_contents or the typed contents; and the
    `text` rows, when given (then no other input may be). Counts and byte sizes are checked before any
    tensor is decoded."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput("raw_input_contents", f"holds {len(raw)} tensors for {len(request.inputs)} inputs")
    arrays: dict[str, np.ndarray] = {}
    texts: list[str] | None = None
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name not in (IDS, MASK, TYPES, TEXT):
            raise InvalidInput(f"inputs[{i}]", f"unknown input {shown(name)}; this model takes {input_names(spec)}")
        if name in arrays or (name == TEXT and texts is not None):
            raise InvalidInput(name, "given twice")
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise InvalidInput(name, "shared-memory inputs are not supported; send the data in the request")
        if name == TEXT:
            texts = _decode_text(tensor, raw, i, spec, config)
            continue
        arrays[name] = _decode(tensor, raw[i] if raw else None, config)
    if texts is not None and arrays:
        raise InvalidInput(TEXT, f"send {TEXT} or {IDS} (with {MASK}), not both")
    shape = arrays[IDS].shape if IDS in arrays else None
    for name in (MASK, TYPES):
        if name in arrays and arrays[name].shape != shape:
            raise InvalidInput(name, f"shape must equal {IDS}'s {list(shape or ())}; got {list(arrays[name].shape)}")
    return arrays, texts


def input_names(spec: ModelSpec) -> str:
    """The inputs this door takes for `spec`, as its messages list them (the metadata's list)."""
    return ", ".join(i.name for i in model_inputs(spec.tokenizer is not None))


def _decode_text(tensor: Any, contents: Any, index: int, spec: ModelSpec, config: ServiceConfig) -> list[str]:
    """A BYTES tensor of [batch] (or [batch, 1]) UTF-8 strings: raw (`contents[index]`, each a 4-byte
    little-endian length, then the bytes, as tritonclient serializes them) or typed (bytes_contents). The
    batch, the model's taking text and the bytes against the call's character limit are checked before
    anything is decoded."""
    shape = [int(d) for d in tensor.shape]
    if tensor.datatype != "BYTES":
        raise InvalidInput(TEXT, f"datatype must be BYTES; got {shown(tensor.datatype)}")
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise InvalidInput(TEXT, f"shape must be [batch] or [batch, 1], batch at least 1; got {shape}")
    count = shape[0]
    check_count(count, config, TEXT)
    takes_text(spec, f"{TEXT}[0]")
    # Only now the raw bytes (`raw_input_contents[i]` copies them out of the message).
    raw: bytes | None = contents[index] if contents else None
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(TEXT, "data given both in raw_input_contents and in contents")
        size = len(raw) - 4 * count
    else:
        size = sum(len(item) for item in tensor.contents.bytes_contents)
    if size > 4 * config.max_text_chars:  # UTF-8: at most 4 bytes a character
        raise InvalidInput(TEXT, f"{size} bytes of text in all; at most {config.max_text_chars} characters per call")
    if raw is not None:
        view = memoryview(raw)
        items: list[bytes | memoryview] = []
        at = 0
        while at < len(view) and len(items) <= count:
            if at + 4 > len(view):
                raise InvalidInput(TEXT, "raw contents end inside a length prefix")
            length = int.from_bytes(view[at: at + 4], "little")
            if at + 4 + length > len(view):
                raise InvalidInput(TEXT, f"raw contents end inside element {len(items)}")
            items.append(view[at + 4: at + 4 + length])
            at += 4 + length
    else:
        items = list(tensor.contents.bytes_contents)
    if len(items) != count:
        raise InvalidInput(TEXT, f"holds {len(items)} strings; shape {shape} needs {count}")
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(bytes(item).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(f"{TEXT}[{i}]", "is not valid UTF-8") from None
    return texts


def _decode(tensor: Any, raw: bytes | None, config: ServiceConfig) -> np.ndarray:
    name, datatype, shape = tensor.name, tensor.datatype, [int(d) for d in tensor.shape]
    if datatype not in _INT_TYPES:
        raise InvalidInput(name, f"datatype must be INT32 or INT64; got {shown(datatype)}")
    if len(shape) != 2 or min(shape) < 1:
        raise InvalidInput(name, f"shape must be [batch, T], both at least 1; got {shape}")
    check_count(shape[0], config, name)
    dtype = _INT_TYPES[datatype]
    count = shape[0] * shape[1]
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(name, "data given both in raw_input_contents and in contents")
        if len(raw) != count * dtype.itemsize:
            raise InvalidInput(name, f"byte size mismatch: shape {shape} of {datatype} needs "
                                     f"{count * dtype.itemsize} bytes, got {len(raw)}")
        ids: np.ndarray = np.frombuffer(raw, dtype).reshape(shape)
        return ids
    values = tensor.contents.int64_contents if datatype == "INT64" else tensor.contents.int_contents
    if len(values) != count:
        raise InvalidInput(name, f"contents hold {len(values)} values; shape {shape} needs {count}")
    typed: np.ndarray = np.array(values, dtype).reshape(shape)
    return typed


def _lengths(inputs: dict[str, np.ndarray], batch: int, T: int) -> list[int]:
    """Each row's real length: from attention_mask (ones, then zeros), else T. Checks token_type_ids."""
    types = inputs.get(TYPES)
    if types is not None and types.any():
        i, j = (int(k) for k in np.argwhere(types != 0)[0])
        raise InvalidInput(f"{TYPES}[{i}, {j}]", "must be 0: this model has no token-type embeddings")
    mask = inputs.get(MASK)
    if mask is None:
        return [T] * batch
    if ((mask != 0) & (mask != 1)).any():
        i, j = (int(k) for k in np.argwhere((mask != 0) & (mask != 1))[0])
        raise InvalidInput(f"{MASK}[{i}, {j}]", f"must be 0 or 1; got {int(mask[i, j])}")
    lengths = mask.sum(axis=1)
    right_padded = mask == (np.arange(T)[None, :] < lengths[:, None])
    for i in range(batch):
        if lengths[i] == 0:
            raise InvalidInput(f"{MASK}[{i}]", "no real token (all zeros)")
        if not right_padded[i].all():
            raise InvalidInput(f"{MASK}[{i}]", "padding must be on the right: ones, then zeros")
    return [int(n) for n in lengths]


def _array_of(output: Output, name: str) -> np.ndarray | None:
    if name in (SPARSE, LOGITS, SCORES):  # scores: checked as the logits they come from
        return output.scores
    if name in (VECTORS, VECTOR_COUNTS):
        return output.vectors if name == VECTORS else None
    return output.hidden if name == HIDDEN else output.attention if name == ATTENTION else output.pooled


@dataclass(frozen=True)
class InferCall:
    """A decoded ModelInferRequest: the plan's `Ask` and this door's field names for it, the outputs asked
    (name -> datatype, in the order asked), and the length the response pads rows to (0: the longest row
    that ran)."""

    request: Any
    ask: Ask
    names: Names
    outputs: dict[str, str]
    padded_to: int
    text: Callable[[str], bool] = lambda name: False  # whether an output is sent as JSON numbers (REST)

    def size(self, plan: Plan, spec: ModelSpec) -> Sizes:
        """The response's size (the plan's response-size function)."""
        padded_to = self.padded_to or max(job.length for job in plan.sequences)

        def text(name: str) -> bool:  # each part of the size by any output name that carries it
            names = {POOLED: (POOLED, EMBEDDINGS), LOGITS: (LOGITS, SPARSE, SCORES)}.get(name, (name,))
            return any(n in self.outputs and self.text(n) for n in names)

        return _sizes(plan, spec, padded_to, text)

    def datatypes(self, plan: Plan) -> dict[str, str]:
        """Each output's datatype as sent: a quantized pooled vector is INT8 or UINT8, not a float (and token
        vectors packed in bits likewise)."""
        if plan.vectors is None or plan.vectors.dtype is None:
            return self.outputs
        quantized = _QUANTIZED[plan.vectors.quantization]
        return {name: quantized if name in (POOLED, EMBEDDINGS, VECTORS) else datatype
                for name, datatype in self.outputs.items()}

    def check(self, plan: Plan, results: Sequence[Output]) -> None:
        """A result FP16 (or BF16) cannot hold is refused, never sent as Inf (the run's output check)."""
        for name, datatype in self.datatypes(plan).items():
            arrays = [a for r in results if (a := _array_of(r, name)) is not None]
            check_arrays(name, arrays, _FLOAT_TYPES.get(datatype, "float32"))


def decode_infer(request: Any, params: dict[str, Any], spec: ModelSpec, config: ServiceConfig,
                 text: Callable[[str], bool]) -> InferCall:
    """A ModelInferRequest (its parameters already read, `parameters`) as the call the plan runs: outputs,
    then inputs (counts and sizes checked before any tensor is decoded), then the options. `text(name)`:
    whether an output goes back as JSON numbers (its size is then the text's)."""
    outputs = _requested(request, config.allow_attention, spec)
    inputs, texts = _inputs(request, spec, config)
    ask = _ask(request, params, outputs, spec)
    if ask.task == "rerank" and not spec.vector_dim:  # a late-interaction model reranks with its token vectors
        check_task("rerank", spec, "parameters.query")  # the model's lack named before the inputs' kind
    if ask.task == "rerank" and texts is None:
        raise InvalidInput(TEXT, "required with parameters.query: the texts to rerank, one a row (BYTES)")
    if texts is not None:
        ask = dataclasses.replace(ask, inputs=texts)
        return InferCall(request, ask, RERANK_NAMES if ask.task == "rerank" else TEXT_NAMES, outputs, 0, text)
    ids = inputs.get(IDS)
    if ids is None:
        raise InvalidInput(IDS, f"required (INT32 or INT64, [batch, T]), or {TEXT} (BYTES, [batch])")
    batch, T = ids.shape
    lengths = _lengths(inputs, batch, T)
    ask = dataclasses.replace(ask, inputs=[ids[i, : lengths[i]] for i in range(batch)])
    return InferCall(request, ask, IDS_NAMES, outputs, min(T, spec.max_length) if _truncating(ask) else T, text)


def infer_response(call: InferCall, ran: Ran) -> Any:
    """The ModelInferResponse of a call that ran: every output asked, rows padded to the call's length."""
    plan, spec, results = ran.plan, ran.spec, ran.outputs
    T = call.padded_to or max(job.length for job in plan.sequences)
    response = v2.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=call.request.id)
    p = response.parameters
    # attention.v1's ResponseMetadata, as parameters.
    facts = ran.batch
    p["queue_us"].int64_param = int(facts.queue_s * 1e6)
    p["compute_us"].int64_param = int(facts.compute_s * 1e6)
    p["batch_size"].int64_param = facts.batch_size
    p["padded_length"].int64_param = facts.padded_length
    p["precision"].string_param = spec.precision
    p["device"].string_param = spec.device
    p["fp32_retry"].bool_param = facts.fp32_retry
    batch, d_model = len(results), spec.d_model
    for name, datatype in call.datatypes(plan).items():
        if name == HIDDEN:
            array = np.zeros((batch, T, d_model), np.float32)  # (B, T, D), zeros past each row's length
            for i, r in enumerate(results):
                hidden = r.hidden
                assert hidden is not None, "hidden states asked for, none returned. This is a bug."
                array[i, : hidden.shape[0]] = hidden
        elif name in (POOLED, EMBEDDINGS):
            pooled = [r.pooled for r in results if r.pooled is not None]
            assert len(pooled) == batch, "pooled vectors asked for, not all returned. This is a bug."
            array = np.stack(pooled)  # (B, D)
        elif name in (SPARSE, LOGITS):
            array = np.stack(ran.logits)  # (B, vocab) SPLADE weights, or (B, labels) logits
        elif name == SCORES:
            assert ran.scores is not None, "rerank scores asked for, none computed. This is a bug."
            array = np.asarray(ran.scores, np.float32)  # (B,), in the rows' order
        elif name in (VECTORS, VECTOR_COUNTS):
            vectors = [r.vectors for r in results if r.vectors is not None]
            assert len(vectors) == batch, "token vectors asked for, not all returned. This is a bug."
            if name == VECTOR_COUNTS:
                array = np.asarray([len(v) for v in vectors], np.int64)  # (B,)
            else:
                array = np.zeros((batch, max(len(v) for v in vectors), vectors[0].shape[1]), vectors[0].dtype)
                for i, v in enumerate(vectors):  # (B, n, dim), zeros past each row's count
                    array[i, : len(v)] = v
        else:
            attention = [r.attention for r in results if r.attention is not None]
            assert len(attention) == batch, "attention asked for, not all returned. This is a bug."
            L, H = attention[0].shape[:2]
            array = np.zeros((batch, L, H, T, T), np.float32)  # (B, L, H|1, T, T)
            for i, a in enumerate(attention):
                t = a.shape[-1]
                array[i, :, :, :t, :t] = a
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(_encode(array, datatype))
    if any(plan.cut(i) for i in range(len(results))):
        response.parameters["truncated"].bool_param = True
    if plan.chunks:
        response.parameters["windows"].int64_param = sum(len(c.starts) for c in plan.chunks if c is not None)
    return response


def _encode(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "INT64":
        return np.ascontiguousarray(array, "<i8").tobytes()
    if datatype in ("INT8", "UINT8"):
        return np.ascontiguousarray(array, "i1" if datatype == "INT8" else "u1").tobytes()
    if datatype == "BF16":
        return bytes(float32_to_bfloat16_bits(array).tobytes())
    return np.ascontiguousarray(array, "<f2" if datatype == "FP16" else "<f4").tobytes()

