"""KServe v2 (the Open Inference Protocol), transport-free: readiness, the model's metadata, config,
statistics and the repository index, and one inference (`infer`: decode -> the shared call layer's run ->
encode, service/doors/kserve/wire.py). Two thin transports stand on it: gRPC `inference.GRPCInferenceService`
(service/doors/kserve/grpc_door.py) and REST (service/doors/kserve/rest.py, routes of the HTTP door).

Choices a Triton user would look for (docs/kserve.md has the tables):

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
- ModelStatistics is model-wide (every front door), from the service's own counts (service/metrics.py
  `ModelCounts`); ServerReady/ModelReady from its readiness (service/doors/calls.py `Serving.ready`);
- rerank is a `text` call with the string parameter `query`: output `scores` (FP32 [batch], one per row in
  the rows' order, no sorting: sigmoid unless `raw_scores`, as attention.v1's Rerank) and/or `logits`
  (the raw [batch, 1]); the plan's checks and errors as Rerank's, named as this door's fields;
- ModelStreamInfer rides EncodeStream's loop; a failed request answers `error_message`
  "[StatusCode.X] message" and the stream goes on;
- RepositoryModelLoad / RepositoryModelUnload (the repository extension) load and unload models while
  serving, with `--model-control explicit` (as Triton's `--model-control-mode=explicit`); off, they answer
  FAILED_PRECONDITION. Shared-memory, trace and log RPCs are UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as v2

from service.doors.calls import Calls, Model, Repository
from service.doors.kserve.wire import (
    ATTENTION,
    HIDDEN,
    LOGITS,
    PLATFORM,
    POOLED,
    SCORES,
    SPARSE,
    VECTOR_COUNTS,
    VECTORS,
    config_output,
    decode_infer,
    infer_response,
    int_param,
    model_inputs,
    parameters,
)
from service.errors import FailedPrecondition, InvalidInput, NotFound, NotReady, shown
from service.jobs import ModelSpec
from service.metrics import Timing

SERVER_NAME = "attention-service"
SERVER_VERSION = "0.1.0"  # pyproject.toml's
EXTENSIONS = ("model_configuration", "statistics", "parameters")


class KServe:
    """The KServe v2 protocol over the shared call layer (module docstring), for either transport."""

    def __init__(self, calls: Calls, workers: int = 1) -> None:
        self.calls = calls
        self._config = calls.config
        self._workers = workers

    def ready(self) -> bool:
        # The readiness grpc.health.v1 reports: true once warm, false from the moment a shutdown starts
        # (through the drain delay, while calls are still served). An edge process's own.
        return self.calls.serving.ready

    def _find(self, name: str, version: str) -> Model | None:
        model = self.calls.serving.find(name) if name else None
        return model if model is not None and version in ("", model.spec.version) else None

    def model_ready(self, request: Any) -> Any:
        known = self._find(request.name, request.version) is not None
        return v2.ModelReadyResponse(ready=known and self.ready())

    def served(self, name: str, version: str) -> Model:
        """The model a request names (by its served name or an alias), ready; NOT_FOUND in Triton's words
        for another name or version."""
        self.calls.model()  # UNAVAILABLE while loading or draining
        model = self._find(name, version)
        if model is None:
            version_text = f" version {shown(version, quote=False)}" if version else ""
            raise NotFound(f"Request for unknown model: {shown(name)}{version_text} is not found")
        return model

    def _spec(self, name: str, version: str) -> ModelSpec:
        return self.served(name, version).spec

    def repository_index(self, request: Any) -> Any:
        """Every served model, READY or UNAVAILABLE (a shutdown has begun); `ready` asks for ready ones only.
        While loading there is no name to give yet: UNAVAILABLE, as for the other description calls."""
        if request.repository_name:
            raise NotFound(f"unknown repository {shown(request.repository_name)}; this server has one, "
                           "named \"\" (leave repository_name empty)")
        serving = self.calls.serving
        ready = self.ready()
        if request.ready and not ready:
            return v2.RepositoryIndexResponse()
        if not serving.models:
            raise NotReady("model loading or warming up; retry shortly")
        index = v2.RepositoryIndexResponse.ModelIndex
        return v2.RepositoryIndexResponse(models=[
            index(name=m.spec.name, version=m.spec.version, state="READY") if ready else
            index(name=m.spec.name, version=m.spec.version, state="UNAVAILABLE", reason="server shutting down")
            for m in serving.models.values()])

    def model_metadata(self, request: Any) -> Any:
        spec = self._spec(request.name, request.version)
        meta = v2.ModelMetadataResponse.TensorMetadata
        inputs = model_inputs(spec.tokenizer is not None)
        return v2.ModelMetadataResponse(
            name=spec.name, versions=[spec.version], platform=PLATFORM,
            inputs=[meta(name=i.name, datatype=i.datatype, shape=[-1, *i.dims]) for i in inputs],
            outputs=[meta(name=name, datatype="INT64" if name == VECTOR_COUNTS else "FP32", shape=[-1, *dims])
                     for name, dims in self._outputs(spec)],
        )

    def _outputs(self, spec: ModelSpec) -> list[tuple[str, list[int]]]:
        """Each output and its dims after the batch dim (-1: variable)."""
        outputs = [(HIDDEN, [-1, spec.d_model]), (POOLED, [spec.d_model])]
        if "sparse" in spec.tasks:
            outputs.append((SPARSE, [spec.vocab_size]))
        if "classify" in spec.tasks:
            outputs.append((LOGITS, [len(spec.labels)]))
        if "rerank" in spec.tasks or spec.vector_dim:
            outputs.append((SCORES, []))  # [batch]: one score a row
        if spec.vector_dim:
            outputs += [(VECTORS, [-1, spec.vector_dim]), (VECTOR_COUNTS, [])]
        if self._config.allow_attention:
            outputs.append((ATTENTION, [-1, -1, -1, -1]))  # layers asked, heads (or 1), T, T
        return outputs

    def model_config(self, request: Any) -> Any:
        spec = self._spec(request.name, request.version)
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
            output=[config_output(name, dims) for name, dims in self._outputs(spec)],
            dynamic_batching=mc.ModelDynamicBatching(
                max_queue_delay_microseconds=int(c.max_wait_ms * 1e3),
                default_queue_policy=mc.ModelQueuePolicy(
                    max_queue_size=c.max_queue_requests, default_timeout_microseconds=int(c.default_timeout_s * 1e6),
                    allow_timeout_override=True)),
            instance_group=[mc.ModelInstanceGroup(kind=kind, count=spec.model_workers or self._workers)],
            parameters={key: mc.ModelParameter(string_value=str(value)) for key, value in described.items()},
        )
        return v2.ModelConfigResponse(config=config)

    def model_statistics(self, request: Any) -> Any:
        """Triton's shape, per model (every door's calls to it), from the service's own counts
        (service/metrics.py `ModelCounts`): success/fail per call, queue per sequence, compute_infer per
        forward (warm-up's included). The host-side input and output handling around a forward are not
        timed apart: compute_input and compute_output carry compute_infer's count with 0 ns (perf_analyzer
        requires the three counts equal). batch_stats is left empty. No name: every model's."""
        if request.name:
            specs = [self._spec(request.name, request.version)]
        else:
            self.calls.model()  # UNAVAILABLE while loading or draining
            specs = [m.spec for m in self.calls.serving.models.values()]
        return v2.ModelStatisticsResponse(model_stats=[self._statistics(spec) for spec in specs])

    def _statistics(self, spec: ModelSpec) -> Any:
        counts = self.calls.metrics.counts(spec.name)
        stats = v2.ModelStatistics(name=spec.name, version=spec.version, last_inference=counts.last_inference_ms,
                                   inference_count=counts.sequences, execution_count=counts.batches)
        calls = stats.inference_stats
        for into, timing in ((calls.success, counts.success), (calls.fail, counts.fail), (calls.queue, counts.queue),
                             (calls.compute_infer, counts.compute), (calls.compute_input, Timing(counts.compute.count)),
                             (calls.compute_output, Timing(counts.compute.count))):
            into.count, into.ns = timing.count, int(timing.seconds * 1e9)
        return stats

    def extensions(self) -> tuple[str, ...]:
        """The protocol extensions this server speaks: the repository's only with model control on."""
        return EXTENSIONS + (("model_repository",) if self._config.model_control == "explicit" else ())

    # -- the repository extension: load and unload while serving -----------------------------------------

    def _repository(self, repository_name: str) -> Repository:
        if repository_name:
            raise NotFound(f"unknown repository {shown(repository_name)}; this server has one, named \"\" (leave "
                           "repository_name empty)")
        repository = self.calls.serving.repository
        if repository is None:
            raise FailedPrecondition("model control is off here: start the service with --model-control explicit to "
                                     "load and unload models while serving (not available with edge processes)")
        return repository

    async def load(self, request: Any) -> Any:
        """RepositoryModelLoad: serve `model_name` (its parameters: `path`, a bundle or a Hugging Face folder,
        unless the name was configured at start-up; `precision`, `max_batch_tokens`, `aliases` (comma-separated)
        and the other per-model settings of a models file). Answers once the model is warm and serving."""
        repository = self._repository(request.repository_name)
        if not request.model_name:
            raise InvalidInput("model_name", "required")
        values = {name: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
                  for name, value in request.parameters.items()}
        path = values.pop("path", "")
        if not isinstance(path, str):
            raise InvalidInput("parameters.path", "must be a string")
        if isinstance(values.get("aliases"), str):
            values["aliases"] = [a for a in str(values["aliases"]).split(",") if a]
        await repository.load(request.model_name, path, values)
        return v2.RepositoryModelLoadResponse()

    async def unload(self, request: Any) -> Any:
        """RepositoryModelUnload: stop serving `model_name` (new calls to it NOT_FOUND, the accepted ones answered
        within the drain grace, then its memory freed). Answers once it is gone."""
        repository = self._repository(request.repository_name)
        if not request.model_name:
            raise InvalidInput("model_name", "required")
        await repository.unload(request.model_name, self._config.drain_grace_s)
        return v2.RepositoryModelUnloadResponse()

    async def infer(self, request: Any, seconds: float, text: Callable[[str], bool] = lambda name: False) -> Any:
        """One ModelInferRequest: decode (service/doors/kserve/wire.py) -> run -> encode. `text(name)`: whether
        the transport sends an output as JSON numbers (REST's `binary_data: false`), for its size."""
        params = parameters(request.parameters)
        if timeout_us := int_param(params, "timeout", 0):  # Triton's request timeout (0: none): only shortens
            seconds = min(seconds, timeout_us / 1e6)
        model = self.served(request.model_name, request.model_version)
        call = decode_infer(request, params, model.spec, model.config or self._config, text)
        ran = await self.calls.run(model, call.ask, call.names, call.size, seconds, check=call.check)
        return infer_response(call, ran)
