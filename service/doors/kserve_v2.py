"""inference.GRPCInferenceService (KServe v2 / Open Inference Protocol): v2 messages <-> our Jobs. Nothing else.

The messages are the ones `tritonclient` ships (`tritonclient.grpc.service_pb2`, `model_config_pb2`),
so the wire is upstream's and shares its descriptors with any tritonclient in the process. Calls
take the same path as attention.v1 (service/doors/calls.py: admission, the batcher, the outcome, the stream
loop; the same error table and metrics): each row of `input_ids` is one sequence in the same batches
as Encode's. Choices a Triton user would look for (docs/kserve.md has the
tables):

- unknown model or version: NOT_FOUND "Request for unknown model: ..." (Triton's text); ModelReady
  answers ready=false for it, as Triton does;
- no outputs requested: `last_hidden_state` and `pooled` (attention only when requested);
- rows of one request may differ in length: `attention_mask` marks each row's real tokens, ones
  then zeros (right padding); outputs are padded back to the request's T with zeros;
- options are request parameters (`pooling`, `datatype`, `attention_layers`, ...); an unknown
  parameter is INVALID_ARGUMENT, so a misspelt one is never silently ignored;
- rows longer than the model: parameters `long_inputs` ("error", "truncate", "chunk"; unset: what the
  bool `truncate` says) and `chunk_stride`, as attention.v1's fields (service/chunking.py). Outputs
  are padded to the longest row that ran (a truncated call's T is at most max_length); the response
  parameters `truncated` (some row was cut) and `windows` (windows of the chunked rows, summed) say so;
- ModelMetadata and ModelConfig list every input the door takes for the model (`text` for a text
  model), and the config's parameters both limits (ids: max_length; text: text_max_tokens);
- RepositoryIndex answers the one served model, READY or UNAVAILABLE (shutting down);
- ModelStatistics is model-wide (both front doors), from the service's own counts (service/metrics.py
  `ModelCounts`); ServerReady/ModelReady from its readiness (service/doors/calls.py `Serving.ready`);
- rerank is a `text` call with the string parameter `query`: output `scores` (FP32 [batch], one per row in
  the rows' order, no sorting: sigmoid unless `raw_scores`, as attention.v1's Rerank) and/or `logits`
  (the raw [batch, 1]); the plan's checks and errors as Rerank's, named as this door's fields;
- ModelStreamInfer rides EncodeStream's loop; a failed request answers `error_message`
  "[StatusCode.X] message" and the stream goes on. Load/unload, shared-memory, trace and log RPCs
  are UNIMPLEMENTED.

docs/kserve.md says what each described field means and how perf_analyzer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as v2

from proto.attention.v1.codec import float32_to_bfloat16_bits
from service.batching import Done
from service.chunking import ERROR, MODES, TRUNCATE
from service.config import ServiceConfig
from service.doors.calls import Calls, parse, public, remaining
from service.errors import FailedPrecondition, InvalidInput, NotFound, NotReady, ServiceError, shown, status_of
from service.jobs import ModelSpec, Output
from service.metrics import Metrics, Timing
from service.output_range import check_arrays
from service.plan import (
    HEADS,
    ITEMSIZE,
    MAX_REQUEST_ID,
    Ask,
    Names,
    Plan,
    Sizes,
    attention_bytes,
    check_count,
    check_task,
    plan_call,
    takes_text,
)
from service.tasks import rerank_scores
from service.vectors import QUANTIZATIONS

if TYPE_CHECKING:
    pass

SERVICE_NAME = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVER_NAME = "attention-service"
SERVER_VERSION = "0.1.0"  # pyproject.toml's
EXTENSIONS = ("model_configuration", "statistics", "parameters")
PLATFORM = "pytorch_libtorch"  # Triton's name for a TorchScript model

IDS, MASK, TYPES, TEXT = "input_ids", "attention_mask", "token_type_ids", "text"
HIDDEN, POOLED, EMBEDDINGS, ATTENTION = "last_hidden_state", "pooled", "embeddings", "attention"
SPARSE, LOGITS = "sparse", "logits"  # task heads (docs/tasks.md): SPLADE weights [vocab]; classifier logits [labels]
SCORES = "scores"  # rerank (parameter `query`): one score per `text` row, [batch], in the rows' order
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
                         "quantization_max", "query", "raw_scores"}) | _IGNORED
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


def _config_output(name: str, dims: list[int]) -> Any:
    """A ModelConfig output; a [batch] one (`scores`) is dims [1] reshaped to [], as Triton writes it."""
    if not dims:
        return mc.ModelOutput(name=name, data_type=mc.TYPE_FP32, dims=[1], reshape=mc.ModelTensorReshape(shape=[]))
    return mc.ModelOutput(name=name, data_type=mc.TYPE_FP32, dims=dims)


class KServeServicer:
    def __init__(self, calls: Calls, metrics: Metrics, workers: int = 1) -> None:
        self._calls = calls
        self._config = calls.config
        self._metrics = metrics
        self._workers = workers

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        handlers: dict[str, tuple[Any, Callable[..., Any]]] = {
            "ServerLive": (v2.ServerLiveRequest, lambda _: v2.ServerLiveResponse(live=True)),
            "ServerReady": (v2.ServerReadyRequest, lambda _: v2.ServerReadyResponse(ready=self._ready())),
            "ModelReady": (v2.ModelReadyRequest, self._model_ready),
            "ServerMetadata": (v2.ServerMetadataRequest, lambda _: v2.ServerMetadataResponse(
                name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)),
            "ModelMetadata": (v2.ModelMetadataRequest, self._model_metadata),
            "ModelConfig": (v2.ModelConfigRequest, self._model_config),
            "ModelStatistics": (v2.ModelStatisticsRequest, self._model_statistics),
            "RepositoryIndex": (v2.RepositoryIndexRequest, self._repository_index),
        }
        methods = {name: grpc.unary_unary_rpc_method_handler(self._unary(name, *h), response_serializer=bytes)
                   for name, h in handlers.items()}
        methods["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer, response_serializer=bytes)
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer, response_serializer=bytes)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    def _unary(self, method: str, request_type: Any, handle: Callable[[Any], Any]) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            async def work() -> bytes:
                data: bytes = handle(parse(request_type, raw)).SerializeToString()
                return data

            return await self._calls.answer(method, context, work)

        return call

    async def model_infer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            request = parse(v2.ModelInferRequest, raw)
            data: bytes = (await self._infer(request, remaining(context, self._config))).SerializeToString()
            return data

        return await self._calls.answer("ModelInfer", context, work)

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """One response per request, in completion order (`id` echoed). A failed request answers with
        `error_message` "[StatusCode.X] message" (the text tritonclient shows for a unary error; the
        stream has no code field) and the stream goes on."""
        async def one(raw: bytes) -> bytes:
            request_id, final = "", False

            async def work() -> bytes:
                nonlocal request_id, final
                request = parse(v2.ModelInferRequest, raw)
                if len(request.id) <= MAX_REQUEST_ID:  # echoed in a refusal too: never a long one
                    request_id = request.id
                final = _final_flag(request)
                response = v2.ModelStreamInferResponse(
                    infer_response=await self._infer(request, remaining(context, self._config)))
                if final:
                    response.infer_response.parameters["triton_final_response"].bool_param = True
                data: bytes = response.SerializeToString()
                return data

            def failed(error: ServiceError) -> bytes:
                response = v2.ModelStreamInferResponse(
                    error_message=public(f"[StatusCode.{status_of(error)}] {error.message}"),
                    infer_response=v2.ModelInferResponse(id=request_id))
                if final:
                    response.infer_response.parameters["triton_final_response"].bool_param = True
                data: bytes = response.SerializeToString()
                return data

            return await self._calls.answer_in_stream("ModelStreamInfer", work, failed)

        async with contextlib.aclosing(self._calls.stream(requests, one)) as responses:
            async for response in responses:
                yield response

    # -- health and description -------------------------------------------------------------------

    def _ready(self) -> bool:
        # The readiness grpc.health.v1 reports: true once warm, false from the moment a shutdown starts
        # (through the drain delay, while calls are still served). An edge process's own.
        return self._calls.serving.ready

    def _model_ready(self, request: Any) -> Any:
        spec = self._calls.serving.spec
        known = spec is not None and _names(spec, request.name, request.version)
        return v2.ModelReadyResponse(ready=known and self._ready())

    def _served(self, name: str, version: str) -> ModelSpec:
        spec, _ = self._calls.serving.require_ready()
        if not _names(spec, name, version):
            version_text = f" version {shown(version, quote=False)}" if version else ""
            raise NotFound(f"Request for unknown model: {shown(name)}{version_text} is not found")
        return spec

    def _repository_index(self, request: Any) -> Any:
        """The one served model, READY or UNAVAILABLE (a shutdown has begun); `ready` asks for ready ones
        only. While loading there is no name to give yet: UNAVAILABLE, as for the other description calls."""
        if request.repository_name:
            raise NotFound(f"unknown repository {shown(request.repository_name)}; this server has one, "
                           "named \"\" (leave repository_name empty)")
        serving = self._calls.serving
        ready = self._ready()
        if request.ready and not ready:
            return v2.RepositoryIndexResponse()
        spec = serving.spec
        if spec is None:
            raise NotReady("model loading or warming up; retry shortly")
        index = v2.RepositoryIndexResponse.ModelIndex
        return v2.RepositoryIndexResponse(models=[
            index(name=spec.name, version=spec.version, state="READY") if ready else
            index(name=spec.name, version=spec.version, state="UNAVAILABLE", reason="server shutting down")])

    def _model_metadata(self, request: Any) -> Any:
        spec = self._served(request.name, request.version)
        meta = v2.ModelMetadataResponse.TensorMetadata
        inputs = model_inputs(spec.tokenizer is not None)
        return v2.ModelMetadataResponse(
            name=spec.name, versions=[spec.version], platform=PLATFORM,
            inputs=[meta(name=i.name, datatype=i.datatype, shape=[-1, *i.dims]) for i in inputs],
            outputs=[meta(name=name, datatype="FP32", shape=[-1, *dims]) for name, dims in self._outputs(spec)],
        )

    def _outputs(self, spec: ModelSpec) -> list[tuple[str, list[int]]]:
        """Each output and its dims after the batch dim (-1: variable)."""
        outputs = [(HIDDEN, [-1, spec.d_model]), (POOLED, [spec.d_model])]
        if "sparse" in spec.tasks:
            outputs.append((SPARSE, [spec.vocab_size]))
        if "classify" in spec.tasks:
            outputs.append((LOGITS, [len(spec.labels)]))
        if "rerank" in spec.tasks:
            outputs.append((SCORES, []))  # [batch]: one score a row
        if self._config.allow_attention:
            outputs.append((ATTENTION, [-1, -1, -1, -1]))  # layers asked, heads (or 1), T, T
        return outputs

    def _model_config(self, request: Any) -> Any:
        spec = self._served(request.name, request.version)
        c = self._config
        inputs = [mc.ModelInput(name=i.name, data_type=i.config_type, dims=i.dims, optional=i.optional)
                  for i in model_inputs(spec.tokenizer is not None)]
        group = mc.ModelInstanceGroup
        kind = group.KIND_GPU if spec.device.startswith("cuda") else group.KIND_CPU
        described: dict[str, object] = {
            "d_model": spec.d_model, "n_heads": spec.n_heads, "n_layers": spec.n_layers,
            "vocab_size": spec.vocab_size, "max_length": spec.max_length, "precision": spec.precision,
            "device": spec.device, "checksum": spec.checksum, "max_tokens_per_call": c.max_tokens_per_call,
            "max_attention_bytes": c.max_attention_bytes, "attention_scale": spec.attention_scale,
            "standard_scale": spec.standard_scale, "relative_bias": spec.relative_bias, "backend": spec.backend}
        if spec.tokenizer is not None:  # `text` is cut (or refused) at the tokenizer's limit, not at max_length
            t = spec.tokenizer.settings
            described.update({
                "text_max_tokens": t.max_tokens, "text_truncation_side": t.truncation_side,
                "text_pooling": t.pooling, "text_normalize": t.normalize, "text_prompts": ",".join(sorted(t.prompts)),
                "text_default_prompt_name": t.default_prompt_name, "max_text_chars": c.max_text_chars,
                "tokenizer_checksum": t.tokenizer_sha256})
        config = mc.ModelConfig(
            name=spec.name, platform=PLATFORM, max_batch_size=c.max_sequences_per_call, input=inputs,
            output=[_config_output(name, dims) for name, dims in self._outputs(spec)],
            dynamic_batching=mc.ModelDynamicBatching(
                max_queue_delay_microseconds=int(c.max_wait_ms * 1e3),
                default_queue_policy=mc.ModelQueuePolicy(
                    max_queue_size=c.max_queue_requests, default_timeout_microseconds=int(c.default_timeout_s * 1e6),
                    allow_timeout_override=True)),
            instance_group=[mc.ModelInstanceGroup(kind=kind, count=spec.model_workers or self._workers)],
            parameters={key: mc.ModelParameter(string_value=str(value)) for key, value in described.items()},
        )
        return v2.ModelConfigResponse(config=config)

    def _model_statistics(self, request: Any) -> Any:
        """Triton's shape, model-wide (attention.v1 calls included), from the service's own counts
        (service/metrics.py `ModelCounts`): success/fail per call, queue per sequence, compute_infer per
        forward (warm-up's included). The host-side input and output handling around a forward are not
        timed apart: compute_input and compute_output carry compute_infer's count with 0 ns (perf_analyzer
        requires the three counts equal). batch_stats is left empty."""
        if request.name:
            spec = self._served(request.name, request.version)
        else:
            spec, _ = self._calls.serving.require_ready()
        counts = self._metrics.counts()
        stats = v2.ModelStatistics(name=spec.name, version=spec.version, last_inference=counts.last_inference_ms,
                                   inference_count=counts.sequences, execution_count=counts.batches)
        calls = stats.inference_stats
        for into, timing in ((calls.success, counts.success), (calls.fail, counts.fail), (calls.queue, counts.queue),
                             (calls.compute_infer, counts.compute), (calls.compute_input, Timing(counts.compute.count)),
                             (calls.compute_output, Timing(counts.compute.count))):
            into.count, into.ns = timing.count, int(timing.seconds * 1e9)
        return v2.ModelStatisticsResponse(model_stats=[stats])

    # -- inference --------------------------------------------------------------------------------

    async def _infer(self, request: Any, seconds: float) -> Any:
        params = _parameters(request.parameters)
        if timeout_us := _int_param(params, "timeout", 0):  # Triton's request timeout (0: none): only shortens
            seconds = min(seconds, timeout_us / 1e6)
        spec = self._served(request.model_name, request.model_version)
        outputs = _requested(request, self._config.allow_attention, spec)
        inputs, texts = _inputs(request, spec, self._config)
        ask = _ask(request, params, outputs, spec)
        if ask.task == "rerank":
            check_task("rerank", spec, "parameters.query")  # the model's lack named before the inputs' kind
        if ask.task == "rerank" and texts is None:
            raise InvalidInput(TEXT, "required with parameters.query: the texts to rerank, one a row (BYTES)")
        if texts is not None:
            ask = dataclasses.replace(ask, inputs=texts)
            names, padded_to = RERANK_NAMES if ask.task == "rerank" else TEXT_NAMES, 0  # padded to the longest text
        else:
            ids = inputs.get(IDS)
            if ids is None:
                raise InvalidInput(IDS, f"required (INT32 or INT64, [batch, T]), or {TEXT} (BYTES, [batch])")
            batch, T = ids.shape
            lengths = _lengths(inputs, batch, T)
            ask = dataclasses.replace(ask, inputs=[ids[i, : lengths[i]] for i in range(batch)])
            names, padded_to = IDS_NAMES, T
            if _truncating(ask):
                padded_to = min(T, spec.max_length)

        def sizes(plan: Plan, spec: ModelSpec) -> Sizes:
            return _sizes(plan, spec, padded_to or max(job.length for job in plan.sequences))

        plan = await plan_call(ask, spec, self._config, names, sizes)
        T = padded_to or max(job.length for job in plan.sequences)
        if plan.vectors is not None and plan.vectors.dtype is not None:  # quantized: INT8 or UINT8, not a float
            outputs = {name: _QUANTIZED[plan.vectors.quantization] if name in (POOLED, EMBEDDINGS) else datatype
                       for name, datatype in outputs.items()}
        done = await self._calls.compute(plan.jobs, seconds)
        results = plan.finish([d.output for d in done])
        for name, datatype in outputs.items():  # a result FP16 (or BF16) cannot hold is refused, never sent as Inf
            arrays = [a for r in results if (a := _array_of(r, name)) is not None]
            check_arrays(name, arrays, _FLOAT_TYPES.get(datatype, "float32"))
        response = _response(request, spec, done, results, outputs, T, raw_scores=params.get("raw_scores") is True)
        if any(plan.cut(i) for i in range(len(results))):
            response.parameters["truncated"].bool_param = True
        if plan.chunks:
            response.parameters["windows"].int64_param = sum(len(c.starts) for c in plan.chunks if c is not None)
        return response


# The plan's field names, as this door's wire has them (service/plan.py `Names`).
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


def _sizes(plan: Plan, spec: ModelSpec, padded_to: int) -> Sizes:
    """A KServe v2 response: every row padded to `padded_to`, raw tensor bytes in a small envelope."""
    per_value = ITEMSIZE[plan.output_dtype]
    hidden = sum(padded_to for job in plan.sequences if job.return_hidden) * spec.d_model * per_value
    pooled = sum(1 for job in plan.sequences if job.pooling) * math.prod(plan.pooled_size(spec.d_model))
    attention = attention_bytes(plan, spec, padded_to)
    heads = sum(spec.vocab_size if job.head == "sparse" else len(spec.labels) + (job.head == "rerank")
                for job in plan.sequences if job.head)  # a rerank row: its logits and its score
    heads *= 4 if plan.task != "embed" else per_value
    return Sizes(attention, hidden + pooled + heads + attention + 1024 + len(plan.request_id))  # + names, shapes


def _final_flag(request: Any) -> bool:
    """Triton's `triton_enable_empty_final_response`: mark each (single) response as the request's last."""
    flag = request.parameters.get("triton_enable_empty_final_response")
    return flag is not None and flag.bool_param


def _names(spec: ModelSpec, name: str, version: str) -> bool:
    return name == spec.name and version in ("", spec.version)


def _parameters(parameters: Any) -> dict[str, Any]:
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


def _int_param(params: dict[str, Any], name: str, default: int) -> int:
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
    floats = [outputs_dtype for name, outputs_dtype in outputs.items() if name != ATTENTION]
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
        raise InvalidInput("parameters.prompt_name", f"must be a string; got {shown(prompt)}")
    truncate = params.get("truncate", False)
    if not isinstance(truncate, bool):
        raise InvalidInput("parameters.truncate", f"must be a bool; got {shown(truncate)}")
    query = _rerank_query(params, outputs)
    if query is not None or LOGITS in outputs:  # a head's own call (texts in; attention may be asked beside)
        if query is None and set(outputs) - {LOGITS, ATTENTION}:
            raise InvalidInput("outputs", f"{LOGITS} comes alone (attention may be asked beside it)")
        task = "classify" if query is None else "rerank"
        for name in ("prompt_name", "dimensions", "quantization", "quantization_min", "quantization_max"):
            if name in params:
                raise InvalidInput(f"parameters.{name}", f"applies to embeddings, not to {task}")
        return Ask(inputs=(), request_id=request.id, return_hidden=False, task=task, query=query, truncate=truncate,
                   long_inputs=_str_param(params, "long_inputs", MODES, ERROR) if "long_inputs" in params else None,
                   chunk_stride=_int_param(params, "chunk_stride", 0),
                   attention=_layers(params) if wants_attention else None,
                   heads=_str_param(params, "attention_heads", HEADS, "all"),
                   attention_dtype=_DTYPE[outputs.get(ATTENTION, "FP32")])
    return Ask(
        inputs=(), request_id=request.id, return_hidden=HIDDEN in outputs, pooling=pooling, normalize=normalize,
        dtype=_DTYPE[dtype], attention=_layers(params) if wants_attention else None,
        heads=_str_param(params, "attention_heads", HEADS, "all"),
        attention_dtype=_DTYPE[outputs.get(ATTENTION, "FP32")],
        long_inputs=_str_param(params, "long_inputs", MODES, ERROR) if "long_inputs" in params else None,
        truncate=truncate, chunk_stride=_int_param(params, "chunk_stride", 0), prompt_name=prompt,
        dimensions=_dimensions(params), quantization=_str_param(params, "quantization", QUANTIZATIONS, "none"),
        quantization_ranges=_ranges(params),
        sparse=(0, 0.0) if SPARSE in outputs else None,
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
        (LOGITS,) if "classify" in spec.tasks else ()) + ((SCORES,) if "rerank" in spec.tasks else ())
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
        outputs[output.name] = _float_param(output.parameters, "datatype", f"{output.name}.parameters.datatype",
                                            fallback)
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
    return output.hidden if name == HIDDEN else output.attention if name == ATTENTION else output.pooled


def _response(request: Any, spec: ModelSpec, done: Sequence[Done], results: Sequence[Output],
              outputs: dict[str, str], T: int, raw_scores: bool = False) -> Any:
    """`done`: every job's (windows each); `results`: one output per row (chunked rows stitched)."""
    widest = max(done, key=lambda d: d.batch_size)
    response = v2.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
    p = response.parameters
    # attention.v1's ResponseMetadata, as parameters.
    p["queue_us"].int64_param = int(max(d.queue_s for d in done) * 1e6)
    p["compute_us"].int64_param = int(max(d.compute_s for d in done) * 1e6)
    p["batch_size"].int64_param = widest.batch_size
    p["padded_length"].int64_param = widest.padded_length
    p["precision"].string_param = spec.precision
    p["device"].string_param = spec.device
    p["fp32_retry"].bool_param = any(d.output.fp32_rerun for d in done)
    batch, d_model = len(results), spec.d_model
    for name, datatype in outputs.items():
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
            scores = [r.scores for r in results if r.scores is not None]
            assert len(scores) == batch, "a head's output asked for, not all returned. This is a bug."
            array = np.stack(scores)  # (B, vocab) SPLADE weights, or (B, labels) logits
        elif name == SCORES:
            logits = [r.scores for r in results if r.scores is not None]
            assert len(logits) == batch, "rerank logits asked for, not all returned. This is a bug."
            array = np.asarray(rerank_scores(logits, raw_scores), np.float32)  # (B,), in the rows' order
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
    return response


def _encode(array: np.ndarray, datatype: str) -> bytes:
    if datatype in ("INT8", "UINT8"):
        return np.ascontiguousarray(array, "i1" if datatype == "INT8" else "u1").tobytes()
    if datatype == "BF16":
        return bytes(float32_to_bfloat16_bits(array).tobytes())
    return np.ascontiguousarray(array, "<f2" if datatype == "FP16" else "<f4").tobytes()
