"""Prometheus metrics, all on one injected `CollectorRegistry` (never module globals).

Histograms rather than summaries, so that p99 aggregates across replicas. Names and label sets are
pinned by tests/service/test_metrics.py: a rename is a conscious change (dashboards and alerts use them).

Several models (service/engine.py): every family the batcher and the runner observe, and the request
families, carry a `model` label, the served name. `Metrics.for_model(name)` is one model's observer
(`ModelMetrics`: the label bound, its series made once, its alert-watched counters at 0 from its load);
a model unloaded takes its gauges with it (`forget_model`), its counters and histograms stay. The
request families take the name from the doors (`observe_request(..., model=...)`; "" until they pass it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from service.errors import REASON_OF
from service.process_metrics import FAMILIES as PROCESS_FAMILIES

# 1 ms .. 10 s, roughly x2 per step (resolves p99 at both ends).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
# |pre-softmax score|: x2 steps to the fp16 range, then fine steps below its largest finite value (65504).
SCORE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 32768, 49152, 65504)
# Normalised entropy, 0 (one-hot) .. 1 (uniform): 0.05 steps, finer near 1 where a collapse to uniform lands.
ENTROPY_BUCKETS = (*(round(0.05 * i, 2) for i in range(1, 20)), 0.99, 1.0)
# Label values that alert rules watch, created at 0 on start-up: a series born at its first increase
# has no earlier sample, so rate()/increase() never see that jump and a one-off burst never fires.
PRECISIONS = ("fp32", "fp16", "bf16")
# Every `reason` of attention_failures_total (the error table's, and an unexpected exception's) and of
# attention_dropped_total (service/batching/batcher.py): each series exists at 0 from start-up, so a
# dashboard panel reads 0, not "No data", on a healthy service, and rate() sees the first failure.
FAILURE_REASONS = (*dict.fromkeys(REASON_OF.values()), "internal")
DROP_REASONS = ("cancelled", "deadline", "shutting_down")
METHODS = ("Encode", "EncodeStream")
# The front doors' inference methods: the calls KServe's ModelStatistics counts (both doors, model-wide).
# Calls counted in ModelStatistics: both gRPC doors' and the HTTP door's (service/doors/http/server.py names them).
INFER_METHODS = ("Encode", "EncodeStream", "ModelInfer", "ModelStreamInfer", "POST /v1/embeddings", "POST /embed",
                 "POST /embed_all", "POST /v1/encode", "POST /v2/models/{model}/infer",
                 "POST /v2/models/{model}/versions/{version}/infer")


# With edge processes (service/multiproc/) every process writes its own values and /metrics sums them
# (prometheus_client's multiprocess mode): a gauge says how. The queue, limit and model gauges are
# the model process's (the edges' stay 0): max. attention_ready is 1 only while every live process is
# ready: livemin. One process: no effect.


@dataclass(frozen=True)
class Timing:
    """A count of events and their summed duration."""

    count: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class ModelCounts:
    """The service's own numbers behind KServe's ModelStatistics (service/doors/kserve/core.py), model-wide:
    both front doors' inference calls (`INFER_METHODS`), every batch and every forward."""

    sequences: int = 0  # encoded successfully (a chunked row: one per window)
    batches: int = 0  # run by the batcher
    success: Timing = Timing()  # calls (a stream: each request) that ended OK, and their durations
    fail: Timing = Timing()  # ... that ended with any other code
    queue: Timing = Timing()  # per sequence: its wait before its batch ran
    compute: Timing = Timing()  # per forward (warm-up's included): the model's time
    last_inference_ms: int = 0  # wall clock, ms since the epoch, of the last successful computation; 0: none


class ModelStats:
    """`ModelCounts`, kept up to date by the same events that update the Prometheus metrics (`Metrics`
    forwards them here), so that the service reads its own numbers rather than its samples back.
    Events come from the event loop and from the model threads: one lock, plain ints and floats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sequences = self._batches = self._last_ms = 0
        # [count, seconds] each
        self._success: list[float] = [0, 0.0]
        self._fail: list[float] = [0, 0.0]
        self._queue: list[float] = [0, 0.0]
        self._compute: list[float] = [0, 0.0]

    def on_call(self, ok: bool, seconds: float) -> None:
        into = self._success if ok else self._fail
        with self._lock:
            into[0] += 1
            into[1] += seconds

    def on_sequences(self, count: int) -> None:
        now_ms = int(time.time() * 1e3)
        with self._lock:
            self._sequences += count
            self._last_ms = now_ms

    def on_batch(self, queue_s: Sequence[float]) -> None:
        waited = sum(queue_s)
        with self._lock:
            self._batches += 1
            self._queue[0] += len(queue_s)
            self._queue[1] += waited

    def on_forward(self, seconds: float) -> None:
        with self._lock:
            self._compute[0] += 1
            self._compute[1] += seconds

    def counts(self) -> ModelCounts:
        with self._lock:
            return ModelCounts(
                sequences=self._sequences, batches=self._batches, success=_timing(self._success),
                fail=_timing(self._fail), queue=_timing(self._queue), compute=_timing(self._compute),
                last_inference_ms=self._last_ms)


def _timing(pair: list[float]) -> Timing:
    return Timing(int(pair[0]), pair[1])


class Metrics:
    """Every metric of the service, and the service's own counts (`stats`, and per model `counts(name)`)
    from the same events. `for_model(name)` is a model's observer (batcher and runner); the observer
    methods here are those of model "" (a runner or batcher made outside the engine, in tests)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.stats = ModelStats()
        self._models: dict[str, ModelMetrics] = {}
        self._models_lock = threading.Lock()
        # Edge processes only (service/multiproc/edge_worker.py sets it): every process's metrics, summed
        # (prometheus_client's multiprocess mode), the one place an edge finds the model process's batches.
        self.shared: CollectorRegistry | None = None
        r = registry
        self.request_duration = Histogram(
            "attention_request_duration_seconds", "Call latency, end to end in the server (a stream: per request)",
            ["method", "code", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram(
            "attention_queue_duration_seconds", "Time a sequence waited before its batch ran",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_duration = Histogram(
            "attention_compute_duration_seconds", "Model forward time per batch",
            ["precision", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "attention_batch_size", "Sequences per batch", ["model"], buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "attention_batch_tokens", "Padded tokens per batch (size x padded length)", ["model"],
            buckets=TOKEN_BUCKETS, registry=r)
        self.padding_ratio = Histogram(
            "attention_padding_ratio", "Padded tokens / real tokens per batch", ["model"], buckets=RATIO_BUCKETS,
            registry=r)
        self.queue_depth = Gauge("attention_queue_depth", "Sequences waiting for a batch", ["model"], registry=r,
                                 multiprocess_mode="max")
        self.queue_tokens = Gauge("attention_queue_tokens", "Tokens waiting for a batch", ["model"], registry=r,
                                  multiprocess_mode="max")
        self.queue_limit = Gauge(
            "attention_queue_limit_tokens", "Queued tokens beyond which calls are refused", ["model"], registry=r,
            multiprocess_mode="max")
        # Set per model now (ModelMetrics.on_limits); what the server still sets here goes nowhere.
        self.ready = Gauge("attention_ready", "1 when the model is warm and the service SERVING", registry=r,
                           multiprocess_mode="livemin")
        self.model_info = Gauge(
            "attention_model_info", "The model served (value 1); precision_source: configured, default or measured",
            ["name", "version", "device", "precision", "precision_source", "model"], registry=r,
            multiprocess_mode="max")
        self.warmup_forward = Gauge(
            "attention_warmup_forward_seconds", "precision=auto: the warm-up batch's forward per precision",
            ["precision", "model"], registry=r, multiprocess_mode="max")
        self.batch_tokens_limit = Gauge(
            "attention_batch_tokens_limit", "max_batch_tokens in force; source: configured, default or measured",
            ["source", "model"], registry=r, multiprocess_mode="max")
        self.model_workers = Gauge(
            "attention_model_workers", "Model workers running batches side by side; source: configured, default or "
            "measured", ["source"], registry=r, multiprocess_mode="max")
        self.warmup_throughput = Gauge(
            "attention_warmup_tokens_per_second", "The warm-up's measured throughput by batch tokens",
            ["batch_tokens", "model"], registry=r, multiprocess_mode="max")
        self.requests = Counter(
            "attention_requests_total", "Calls by method and gRPC code", ["method", "code", "model"], registry=r)
        # Children looked up once: `labels()` takes a lock and builds a key on every call (issue 22).
        # Safe because no series of these families is ever removed.
        self._request_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._sequence_children: dict[str, Any] = {}
        for method in METHODS:
            self.requests.labels(method, "INTERNAL", "")
        self.sequences = Counter("attention_sequences_total", "Sequences encoded successfully", ["model"],
                                 registry=r)
        self.nonfinite_outputs = Counter(
            "attention_nonfinite_outputs_total", "Sequences whose output held NaN/Inf, by the precision it ran at",
            ["precision", "model"], registry=r)
        self.fp32_retries = Counter(
            "attention_fp32_retries_total", "Sequences re-run in fp32 after a non-finite output", ["model"],
            registry=r)
        self.nonfinite_inputs = Counter(
            "attention_nonfinite_inputs_total", "Embedding inputs refused for holding NaN/Inf", registry=r)
        self.failures = Counter(
            "attention_failures_total", "Failed calls by reason", ["reason"], registry=r)
        self.dropped = Counter(
            "attention_dropped_total", "Queued sequences dropped before compute, by reason", ["reason", "model"],
            registry=r)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.batches = Counter(
            "attention_batches_total", "Batches run, by width: wide (every intra-op thread) or narrow (one model "
            "worker's share, beside another worker's batch)", ["width", "model"], registry=r)
        self.auth_failures = Counter(
            "attention_auth_failures_total", "Calls refused UNAUTHENTICATED, by reason (missing | invalid | scheme | "
            "duplicate)", ["reason"], registry=r)
        self.batch_splits = Counter(
            "attention_batch_splits_total", "Batches split and retried, by reason (oom | error)", ["reason", "model"],
            registry=r)

        # Attention health (sampled, service/runner.py `Runner.after_batch`), per layer; labels made in on_model.
        self.score_max = Histogram(
            "attention_score_max_abs", "Largest |pre-softmax attention score| (scaled, bias added) per sampled "
            "sequence, over real queries and keys", ["layer", "model"], buckets=SCORE_BUCKETS, registry=r)
        self.entropy = Histogram(
            "attention_entropy_normalized", "Attention entropy per sampled sequence over its real keys, divided by "
            "log(keys): 1 uniform, 0 one-hot (mean over heads and queries)", ["layer", "model"],
            buckets=ENTROPY_BUCKETS, registry=r)
        self.overflow_risk = Counter(
            "attention_score_overflow_risk_total", "Sampled sequences whose largest |score| passed "
            "diagnostics_overflow_fraction of the serving dtype's largest finite value (or was not finite)",
            ["layer", "model"], registry=r)
        self.entropy_baseline = Gauge(
            "attention_entropy_baseline", "The operator's normal entropy for this deployment (entropy_baseline)",
            ["layer", "model"], registry=r, multiprocess_mode="max")
        self.diagnostics_enabled = Gauge(
            "attention_diagnostics_enabled", "1 when attention health is sampled (diagnostics_sample > 0 and the "
            "bundle has the diagnostics entry point)", ["model"], registry=r,
            multiprocess_mode="max")

        # The conventional grpc-ecosystem names, so that stock gRPC dashboards work (service/doors/grpc_metrics.py).
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter(
            "grpc_server_started_total", "RPCs started on the server", grpc_labels, registry=r)
        self.grpc_handled = Counter(
            "grpc_server_handled_total", "RPCs completed on the server, by code", [*grpc_labels, "grpc_code"],
            registry=r)
        self.grpc_handling = Histogram(
            "grpc_server_handling_seconds", "RPC handling time on the server", grpc_labels,
            buckets=LATENCY_BUCKETS, registry=r)

    def observe_request(self, method: str, code: str, seconds: float, model: str = "") -> None:
        """One call (or one request of a stream) to `model` (its served name; "": not said) ended with `code`:
        attention_requests_total and its duration, together."""
        children = self._request_children.get((method, code, model))
        if children is None:  # (method, code, model) are few: the front doors' methods x status codes x models
            children = self._request_children[method, code, model] = (
                self.requests.labels(method, code, model), self.request_duration.labels(method, code, model))
        children[0].inc()
        children[1].observe(seconds)
        if method in INFER_METHODS:
            self.stats.on_call(code == "OK", seconds)
            if model and (known := self._models.get(model)) is not None:
                known.stats.on_call(code == "OK", seconds)

    def on_sequences(self, count: int, model: str = "") -> None:
        """A call's sequences came back from `model` (service/doors/calls.py `Calls.compute`)."""
        child = self._sequence_children.get(model)
        if child is None:
            child = self._sequence_children[model] = self.sequences.labels(model)
        child.inc(count)
        self.stats.on_sequences(count)
        if model and (known := self._models.get(model)) is not None:
            known.stats.on_sequences(count)

    def counts(self, model: str = "") -> ModelCounts:
        """The counts KServe's ModelStatistics reports: every model's ("") or one model's, by its served name
        (a model not loaded: zeros). This process's own; in an edge process, every process's summed
        (`summed_counts`), since the batches and forwards are the model process's."""
        if self.shared is not None:
            own = self.stats.counts() if not model else self._model_stats(model).counts()
            return summed_counts(self.shared, own.last_inference_ms, model)
        return self.stats.counts() if not model else self._model_stats(model).counts()

    def _model_stats(self, model: str) -> ModelStats:
        known = self._models.get(model)
        return known.stats if known is not None else ModelStats()

    # -- per model -------------------------------------------------------------------------------

    def for_model(self, model: str) -> ModelMetrics:
        """`model`'s observer: its series made (its alert-watched counters at 0), the same object until
        `forget_model`."""
        with self._models_lock:
            known = self._models.get(model)
            if known is None:
                known = self._models[model] = ModelMetrics(self, model)
            return known

    def forget_model(self, model: str) -> None:
        """`model` is unloaded: its gauges go (a dashboard shows no queue or limits of a model not served);
        its counters and histograms stay, so rates stay right across an unload and a load."""
        with self._models_lock:
            known = self._models.pop(model, None)
        if known is not None:
            known.remove_gauges()

    # -- the observers of model "" (runners and batchers made outside the engine) ---------------

    def on_queue(self, sequences: int, tokens: int) -> None:
        self.for_model("").on_queue(sequences, tokens)

    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float],
                 wide: bool) -> None:
        self.for_model("").on_batch(size, padded_length, real_tokens, queue_s, wide)

    def on_dropped(self, reason: str, count: int) -> None:
        self.for_model("").on_dropped(reason, count)

    def on_forward(self, precision: str, seconds: float) -> None:
        self.for_model("").on_forward(precision, seconds)

    def on_nonfinite(self, precision: str, count: int) -> None:
        self.for_model("").on_nonfinite(precision, count)

    def on_fp32_retry(self, count: int) -> None:
        self.for_model("").on_fp32_retry(count)

    def on_split(self, reason: str) -> None:
        self.for_model("").on_split(reason)

    def on_choices(self, model: Sequence[str], precision: str, precision_source: str,
                   forward_ms: Mapping[str, float], batch_tokens: int, batch_source: str,
                   curve: Mapping[int, float]) -> None:
        self.for_model("").on_choices(model, precision, precision_source, forward_ms, batch_tokens, batch_source,
                                      curve)

    def on_workers(self, workers: int, source: str) -> None:
        """Once warm: the worker split in force (the model threads', shared by every model) and its source."""
        self.model_workers.labels(source).set(workers)

    def on_model(self, n_layers: int, diagnostics: bool, baselines: Sequence[float]) -> None:
        self.for_model("").on_model(n_layers, diagnostics, baselines)

    def on_diagnostics(self, max_scores: Sequence[Sequence[float]], entropies: Sequence[Sequence[float]],
                       limit: float) -> None:
        self.for_model("").on_diagnostics(max_scores, entropies, limit)


class ModelMetrics:
    """One model's metrics: the batcher's observer (`BatchObserver`) and the runner's (`RunnerObserver`) with
    the `model` label bound, and its own `ModelStats` (KServe statistics per model). Made by
    `Metrics.for_model`; children looked up once (the hot path takes no `labels()` lock)."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.stats = ModelStats()
        m = metrics
        self._queue_duration = m.queue_duration.labels(model)
        self._batch_size = m.batch_size.labels(model)
        self._batch_tokens = m.batch_tokens.labels(model)
        self._padding_ratio = m.padding_ratio.labels(model)
        self._queue_depth = m.queue_depth.labels(model)
        self._queue_tokens = m.queue_tokens.labels(model)
        self._fp32_retries = m.fp32_retries.labels(model)
        self._compute: dict[str, Any] = {}  # by precision, made at its first forward
        # Alert-watched counters at 0 from the model's load: rate() then sees their first increase.
        self._nonfinite = {precision: m.nonfinite_outputs.labels(precision, model) for precision in PRECISIONS}
        self._dropped = {reason: m.dropped.labels(reason, model) for reason in DROP_REASONS}
        self._batches_by_width = {True: m.batches.labels("wide", model), False: m.batches.labels("narrow", model)}
        self._gauges: list[tuple[Gauge, tuple[str, ...]]] = [
            (m.queue_depth, (model,)), (m.queue_tokens, (model,)), (m.diagnostics_enabled, (model,))]

    # -- BatchObserver ---------------------------------------------------------------------------

    def on_queue(self, sequences: int, tokens: int) -> None:
        self._queue_depth.set(sequences)
        self._queue_tokens.set(tokens)

    def on_batch(self, size: int, padded_length: int, real_tokens: int, queue_s: Sequence[float],
                 wide: bool) -> None:
        self._batches_by_width[wide].inc()
        self._batch_size.observe(size)
        self._batch_tokens.observe(size * padded_length)
        self._padding_ratio.observe(size * padded_length / max(real_tokens, 1))
        for seconds in queue_s:
            self._queue_duration.observe(seconds)
        self.metrics.stats.on_batch(queue_s)
        self.stats.on_batch(queue_s)

    def on_dropped(self, reason: str, count: int) -> None:
        self._dropped[reason].inc(count)

    # -- RunnerObserver --------------------------------------------------------------------------

    def on_forward(self, precision: str, seconds: float) -> None:
        child = self._compute.get(precision)
        if child is None:
            child = self._compute[precision] = self.metrics.compute_duration.labels(precision, self.model)
        child.observe(seconds)
        self.metrics.stats.on_forward(seconds)
        self.stats.on_forward(seconds)

    def on_nonfinite(self, precision: str, count: int) -> None:
        self._nonfinite[precision].inc(count)

    def on_fp32_retry(self, count: int) -> None:
        self._fp32_retries.inc(count)

    def on_split(self, reason: str) -> None:
        self.metrics.batch_splits.labels(reason, self.model).inc()

    # -- once loaded and warm --------------------------------------------------------------------

    def on_limits(self, max_queue_tokens: int) -> None:
        """The model's lane's bound on queued tokens (what AttentionQueueNearlyFull divides by)."""
        self.metrics.queue_limit.labels(self.model).set(max_queue_tokens)
        self._gauges.append((self.metrics.queue_limit, (self.model,)))
        self.on_queue(0, 0)

    def on_choices(self, model: Sequence[str], precision: str, precision_source: str,
                   forward_ms: Mapping[str, float], batch_tokens: int, batch_source: str,
                   curve: Mapping[int, float]) -> None:
        """Once warm: the model (name, version, device), its precision and budget, and what was measured."""
        m = self.metrics
        info = (*model, precision, precision_source, self.model)
        m.model_info.labels(*info).set(1)
        self._gauges.append((m.model_info, info))
        for name, ms in forward_ms.items():
            m.warmup_forward.labels(name, self.model).set(ms / 1e3)
            self._gauges.append((m.warmup_forward, (name, self.model)))
        m.batch_tokens_limit.labels(batch_source, self.model).set(batch_tokens)
        self._gauges.append((m.batch_tokens_limit, (batch_source, self.model)))
        for tokens, rate in curve.items():
            m.warmup_throughput.labels(str(tokens), self.model).set(rate)
            self._gauges.append((m.warmup_throughput, (str(tokens), self.model)))

    def on_model(self, n_layers: int, diagnostics: bool, baselines: Sequence[float]) -> None:
        """Once the model is loaded: every layer's series at 0 (alerts watch them), and the baselines."""
        m = self.metrics
        m.diagnostics_enabled.labels(self.model).set(1 if diagnostics else 0)
        for layer in range(n_layers):
            label = str(layer)
            m.overflow_risk.labels(label, self.model)
            if diagnostics:
                m.score_max.labels(label, self.model)
                m.entropy.labels(label, self.model)
            if baselines:
                m.entropy_baseline.labels(label, self.model).set(baselines[layer if len(baselines) > 1 else 0])
                self._gauges.append((m.entropy_baseline, (label, self.model)))

    def on_diagnostics(self, max_scores: Sequence[Sequence[float]], entropies: Sequence[Sequence[float]],
                       limit: float) -> None:
        """One sampled batch: per sequence, per layer. A non-finite max score counts as an overflow risk
        and is left out of the histogram (one Inf would poison its sum for good); a NaN entropy (a
        sequence with no row of 2 or more keys) is left out."""
        m = self.metrics
        for scores, ents in zip(max_scores, entropies, strict=True):
            for layer, (score, ent) in enumerate(zip(scores, ents, strict=True)):
                label = str(layer)
                if not score <= limit:  # also NaN
                    m.overflow_risk.labels(label, self.model).inc()
                if math.isfinite(score):
                    m.score_max.labels(label, self.model).observe(score)
                if math.isfinite(ent):
                    m.entropy.labels(label, self.model).observe(ent)

    def remove_gauges(self) -> None:
        for gauge, labels in self._gauges:
            try:
                gauge.remove(*labels)
            except KeyError:  # never set, or already gone
                pass


def summed_counts(registry: CollectorRegistry, last_inference_ms: int = 0, model: str = "") -> ModelCounts:
    """`ModelCounts` from the samples of the metrics `ModelStats` mirrors (the same events update both).
    For edge processes only: there each process has its own `Metrics`, the model process runs the
    batches and forwards while every edge answers its own calls, and prometheus_client's multiprocess
    files are what already sums them all (for /metrics). `last_inference_ms` has no metric: the caller's.
    `model`: that model's samples only ("": all)."""
    totals: dict[str, float] = {}
    calls = {True: [0.0, 0.0], False: [0.0, 0.0]}  # ok -> [count, seconds]
    for family in registry.collect():
        for sample in family.samples:
            if model and sample.labels.get("model") != model:
                continue
            if sample.name.startswith("attention_request_duration_seconds_"):
                if sample.labels.get("method") in INFER_METHODS and sample.name.endswith(("_count", "_sum")):
                    calls[sample.labels["code"] == "OK"][sample.name.endswith("_sum")] += sample.value
            elif not sample.name.endswith("_bucket"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value  # summed over labels

    def timing(prefix: str) -> Timing:
        return Timing(int(totals.get(f"{prefix}_count", 0)), totals.get(f"{prefix}_sum", 0.0))

    return ModelCounts(
        sequences=int(totals.get("attention_sequences_total", 0)),
        batches=int(totals.get("attention_batches_total", 0)),
        success=Timing(int(calls[True][0]), calls[True][1]), fail=Timing(int(calls[False][0]), calls[False][1]),
        queue=timing("attention_queue_duration_seconds"), compute=timing("attention_compute_duration_seconds"),
        last_inference_ms=last_inference_ms)


def metric_families() -> dict[str, tuple[str, frozenset[str]]]:
    """Every family /metrics exports, as exposed (counters with `_total`): name -> (type, labels), `Metrics`' and
    the processes' own (service/process_metrics.py). The contract with dashboards and alerts, derived here once
    (tests/service/test_metrics.py pins it)."""
    families = dict(PROCESS_FAMILIES)
    for metric in vars(Metrics(CollectorRegistry())).values():
        if isinstance(metric, MetricWrapperBase):
            kind = str(metric._type)  # prometheus_client keeps these private; no public accessor exists
            name = f"{metric._name}_total" if kind == "counter" else metric._name
            families[name] = (kind, frozenset(metric._labelnames))
    return families
