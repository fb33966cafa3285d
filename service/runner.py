"""The model runner: loads a bundle, picks device and precision, pads and collates a batch, runs it
under `torch.inference_mode()`, checks every sequence's output for NaN/Inf, and splits the batch
back into per-sequence numpy arrays with the padding stripped. Pooling runs on the device, and hidden
states are copied back only when a sequence of the batch returns them.

`load`, `warmup` and every batch run on the model threads only (service/batching/threads.py; the
event loop never runs a forward). The runner is the batcher's `BatchRunner`.
When `pipelined` (config `pipeline`: on, or auto on CUDA), the batcher calls the two halves instead:
`launch` (collate, copy in, enqueue the forward and the copy out, record an event) and `finish`
(wait for the event, check, split, fp32 re-run), so it can choose and collate the next batch while
the device runs this one. On CUDA host buffers are pinned and every copy is non-blocking: nothing in
`launch` waits for the device. On CPU tensors stay where they are (no pinning, no extra copies) and
`launch` simply runs the forward. A failure in either half is handled as in `execute` (below),
starting from the failed whole batch: `launch` keeps its exception and `finish` splits the batch.
This is the pipelined path's one fallback: `launch` and `finish` never raise.
Failure handling, per batch:
- NaN/Inf in a sequence's output under fp16/bf16: re-run those sequences in fp32 (policy `retry`)
  or fail them (`fail`) with `NonFiniteOutput`; counted either way. A non-finite output is never
  returned.
- out of memory: split the batch in halves and retry; one sequence that still does not fit gets
  `OutOfMemory` (RESOURCE_EXHAUSTED).
- any other exception: bisect the same way, so only the sequence that makes the model fail gets
  `ModelFailure` (INTERNAL, with a reference id that is in the log next to the traceback).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from model.bundle import (
    BundleError,
    CompiledForward,
    LoadedBundle,
    has_diagnostics,
    has_unpacked,
    load_bundle,
    load_compiled,
)
from model.heads import pair_embeddings
from service.calibration import bundle_outputs, calibration_for
from service.config import ServiceConfig
from service.device import DTYPES, default_threads, resolve_device, resolve_precision
from service.errors import ModelFailure, NonFiniteOutput, OutOfMemory, ServiceError
from service.jobs import POOL_MEAN, POOL_NONE, Job, ModelSpec, Output
from service.tuning import (
    MIN_SPEEDUP,
    PRECISION_BOUNDS,
    PrecisionChoice,
    choose_precision,
    fidelity,
    round_ratios,
    speedups,
    timed_rounds,
)

log = logging.getLogger(__name__)

# The precision probe's timing (service/tuning.py timed_rounds): up to 7 interleaved rounds, at least 3 (a
# median of fewer would be one round's ratio), fewer once about 2 s are spent.
PROBE_ROUNDS, PROBE_MIN_ROUNDS, PROBE_BUDGET_S = 7, 3, 2.0
PROBE_SLOW = 2.0  # a candidate this many times fp32's time on its second call cannot win: it is not timed further


class RunnerObserver(Protocol):
    def on_forward(self, precision: str, seconds: float) -> None: ...
    def on_nonfinite(self, precision: str, count: int) -> None: ...
    def on_fp32_retry(self, count: int) -> None: ...
    def on_split(self, reason: str) -> None: ...
    def on_diagnostics(self, max_scores: Sequence[Sequence[float]], entropies: Sequence[Sequence[float]],
                       limit: float) -> None: ...


def is_oom(exc: BaseException) -> bool:
    # TorchScript hides the type: an allocation failure inside it arrives as a plain RuntimeError.
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Runner:
    """Owns the model. `load()` and `warmup()` run once before serving; then per batch `execute()`, or
    `launch()` and `finish()` when `pipelined`."""

    def __init__(self, config: ServiceConfig, bundle_dir: str, observer: RunnerObserver, workers: int = 1) -> None:
        self._config = config
        self._threads = config.torch_threads or default_threads()
        self._workers = self._narrow_threads = 1
        self.set_workers(workers)  # at load: one compiled runner per worker (model/bundle.py load_compiled)
        self._bundle_dir = bundle_dir
        self._observer = observer
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.precision, self.device)
        self._module: Any = None
        self._fp32_module: Any = None
        # backend=aoti: the bundle's compiled forward (model.pt2), for the calls it covers (`_compiled_covers`);
        # None: every forward on the TorchScript module.
        self._compiled: CompiledForward | None = None
        self.backend = "torchscript"
        self.compiled_forwards = 0  # forwards the compiled backend ran (the rest ran on TorchScript)
        self._heads: dict[str, Any] = {}  # task -> its scripted head (model/heads.py), fp32, on the device
        self._unpacked = False  # the bundle's encoder has forward_unpacked (Job.attend: query expansion)
        self._tables: dict[int, torch.Tensor | None] = {}  # id(module) -> its word table, for pairs' token types
        self.spec: ModelSpec | None = None
        self._cuda = self.device.type == "cuda"
        self._finished_at = 0.0  # perf_counter when the last batch finished (see _busy_since)
        self.diagnostics = False  # set by load(): sampling on and the bundle has the entry point
        self._sample_credit = 0.0  # + diagnostics_sample per batch; a batch is sampled when it reaches 1
        self._sample_lock = threading.Lock()  # after_batch runs on every model worker
        self._width = threading.local()  # .threads: what set_wide last asked for on this model thread

    def load(self) -> ModelSpec:
        if self.device.type == "cpu":
            torch.set_num_threads(self._threads)
        if self._config.precision == "auto" and self.device.type == "cpu" and self._config.warmup:
            bundle, fp32, choice = self._measure_precision()
        else:
            bundle, fp32 = load_bundle(self._bundle_dir, device=str(self.device), dtype=DTYPES[self.precision]), None
            choice = PrecisionChoice(self.precision, _unmeasured_reason(self._config, self.device), {})
        log.info("precision %s: %s", choice.precision, choice.reason)
        self.precision = choice.precision
        self._module = bundle.module
        self._heads = dict(bundle.heads)
        self._tables = {id(bundle.module): bundle.token_embeddings}
        self._compiled, self.backend, reason = self._load_backend(bundle)
        log.info("backend %s: %s", self.backend, reason)
        if self.precision != "fp32" and self._config.nonfinite_policy == "retry":
            fp32 = fp32 or load_bundle(self._bundle_dir, device=str(self.device))
            self._fp32_module = fp32.module
            self._tables[id(fp32.module)] = fp32.token_embeddings
        m, cfg = bundle.manifest, bundle.manifest.config
        classify = (m.tasks or {}).get("classify") or {}
        colbert, sparse = (m.tasks or {}).get("colbert") or {}, (m.tasks or {}).get("sparse")
        self._unpacked = has_unpacked(self._module)
        self.spec = ModelSpec(
            name=m.name, version=m.version, checksum=m.sha256,
            d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
            max_length=cfg.max_length, positional=cfg.positional,
            precision=self.precision, device=str(self.device), tokenizer=bundle.tokenizer,
            attention_scale=cfg.scale, standard_scale=cfg.attention_scale is None, relative_bias=cfg.relative_bias,
            precision_reason=choice.reason, precision_forward_ms=choice.forward_ms,
            precision_fidelity=choice.fidelity,
            quantization_ranges=m.quantization_ranges,
            tasks=m.task_names, labels=tuple(classify.get("labels", ())),
            problem_type=str(classify.get("problem_type", "")), pair_types=bundle.token_embeddings is not None,
            backend=self.backend, vector_dim=int(colbert.get("dim", 0)), colbert_reduce=str(colbert.get("reduce", "")),
            sparse_kind="" if sparse is None else str(sparse.get("kind", "splade")),
        )
        if self._config.diagnostics_sample > 0:
            self.diagnostics = has_diagnostics(self._module)
            if not self.diagnostics:
                log.warning("attention health unavailable: bundle %s has no `diagnostics` entry point (exported "
                            "before it, or a wrapper exporting only forward); re-export it to enable it",
                            self._bundle_dir)
        return self.spec

    def _load_backend(self, bundle: LoadedBundle) -> tuple[CompiledForward | None, str, str]:
        """(the compiled forward or None, the backend's name, why). The compiled model.pt2 is loaded with its checks
        (model/bundle.py load_compiled: sha256, torch version, device, dtype, a probe against model.pt). `aoti`:
        any failure stops the start-up. `auto`: the compiled backend on CPU where the bundle has a model.pt2 that
        passes them (it was faster than TorchScript where measured, docs/performance.md), else TorchScript, the
        reason logged; on CUDA TorchScript (not measured there yet)."""
        backend, artefact = self._config.backend, bundle.manifest.aoti
        if backend == "torchscript":
            return None, "torchscript", "configured"
        if backend == "auto":
            if artefact is None:
                return None, "torchscript", "auto: the bundle has no compiled model.pt2 (python -m model compile-aoti)"
            if self._cuda:
                return None, "torchscript", "auto: the compiled backend is not measured on cuda yet; model.pt2 unused"
        try:
            compiled = load_compiled(self._bundle_dir, bundle.manifest, device=self.device,
                                     dtype=DTYPES[self.precision], reference=bundle.module, runners=self._workers)
        except BundleError as e:
            if backend == "aoti":
                raise BundleError(f"backend aoti: {e}") from None
            log.warning("backend auto: the bundle's compiled model.pt2 is not usable here, serving TorchScript: %s", e)
            return None, "torchscript", f"auto: model.pt2 refused ({e})"
        covered = (f"model.pt2 for batches of up to {compiled.max_batch_size} token-id sequences without attention "
                   "weights or causal mask; other calls run on model.pt")
        if backend == "auto":
            return compiled, "aoti", f"auto: on cpu the compiled backend where the bundle has one: {covered}"
        return compiled, "aoti", f"configured: {covered}"

    def _measure_precision(self, candidates: Sequence[str] = ("bf16", "fp16")
                           ) -> tuple[LoadedBundle, LoadedBundle | None, PrecisionChoice]:
        """precision=auto on CPU: load the bundle in fp32 and each candidate, time them interleaved on one probe
        batch, check each candidate fast enough to be chosen against fp32 on the calibration inputs (the accuracy
        gate: service/calibration.py, every output the bundle serves) and choose (service/tuning.py).
        Returns (the chosen bundle, the fp32 bundle, the choice).

        Timed at one worker's width (`narrow_threads`: the threads over the configured or default worker
        count the runner was made with), the width its batches run at side by side under load, from one
        thread. Not at every thread: then each forward waits at every OpenMP barrier for whichever of its
        threads the machine's other work has descheduled, by more in one precision's calls than the other's
        (bench/RESULTS.md). Bounded: a few forwards of 512 tokens each, `timed_rounds` within about 2 s; a
        candidate more than twice as slow as fp32 on its second call is not timed further. The gate runs at the
        same width, for the same reason: the calibration inputs in fp32 and in each candidate checked, about
        2,200 tokens plus 1.25 times the tokenizer's limit for a text model (MiniLM: 2.2 s at 1 thread, load 6)."""
        device = str(self.device)
        loaded = {"fp32": load_bundle(self._bundle_dir, device=device)}
        ids, lengths = _probe_batch(loaded["fp32"].manifest.config)
        width = self._narrow_threads
        share = f"one of {self._workers} workers' share" if self._workers > 1 else "one worker, every thread"
        measured = f"{ids.shape[0]}x{ids.shape[1]} tokens at {width} of {self._threads} thread(s) ({share})"

        def run(module: Any) -> None:
            with torch.inference_mode():
                module(ids, None, lengths, False, [])

        def twice(module: Any) -> float:
            """TorchScript profiles and optimises on the first calls: the second one's time."""
            run(module)
            started = time.perf_counter()
            run(module)
            return time.perf_counter() - started

        _set_threads(width)
        try:
            warm_fp32 = twice(loaded["fp32"].module)
            notes: list[str] = []
            slow = {}
            for name in candidates:
                try:
                    loaded[name] = load_bundle(self._bundle_dir, device=device, dtype=DTYPES[name])
                    warm = twice(loaded[name].module)
                except RuntimeError as exc:  # kernels missing for this dtype on this CPU
                    loaded.pop(name, None)
                    notes.append(f"{name} cannot run here ({str(exc).splitlines()[0][:80]})")
                    continue
                if warm > PROBE_SLOW * warm_fp32:  # cannot win: not worth the rounds (fp16 on most CPUs)
                    slow[name] = warm
            timed = {name: functools.partial(run, b.module) for name, b in loaded.items() if name not in slow}
            times = timed_rounds(timed, rounds=PROBE_ROUNDS, budget_s=PROBE_BUDGET_S, min_rounds=PROBE_MIN_ROUNDS)
        except Exception as exc:  # noqa: BLE001 - a failed measurement serves fp32, it does not stop the start
            log.warning("precision measurement failed; serving fp32", exc_info=True)
            return loaded["fp32"], None, PrecisionChoice("fp32", f"measurement failed ({exc}); fp32", {})
        finally:
            _set_threads(self._threads)
        ratios = {**round_ratios(times, "fp32"), **{name: [warm / warm_fp32] for name, warm in slow.items()}}
        forward_ms = {**{name: 1e3 * statistics.median(seconds) for name, seconds in times.items()},
                      **{name: 1e3 * warm for name, warm in slow.items()}}
        fidelities, calibrated = {}, ""
        fast = [name for name, speedup in speedups(ratios).items() if speedup >= MIN_SPEEDUP]
        if fast:
            _set_threads(width)  # as timed: a wide forward on a busy machine waits on its slowest thread
            started = time.perf_counter()
            try:
                calibration = calibration_for(loaded["fp32"])
                want = list(bundle_outputs(loaded["fp32"], calibration))
                for name in fast:
                    fidelities[name] = fidelity(bundle_outputs(loaded[name], calibration), want, calibration.groups,
                                                PRECISION_BOUNDS[name])
            except Exception as exc:  # noqa: BLE001 - as a failed measurement: fp32
                log.warning("precision accuracy gate failed; serving fp32", exc_info=True)
                return loaded["fp32"], None, PrecisionChoice("fp32", f"the accuracy gate failed ({exc}); fp32",
                                                             {name: round(ms, 3) for name, ms in forward_ms.items()})
            finally:
                _set_threads(self._threads)
            calibrated = (f"{calibration.source}, {calibration.tokens} tokens (checked in "
                          f"{time.perf_counter() - started:.1f} s)")
        rounds = len(times["fp32"])
        choice = choose_precision(ratios, fidelities, f"{measured}, {rounds} interleaved rounds", forward_ms,
                                  calibrated=calibrated)
        if notes:
            choice = dataclasses.replace(choice, reason=f"{choice.reason}; {'; '.join(notes)}")
        return loaded[choice.precision], loaded["fp32"], choice

    def probe_batch(self, rows: int, seq: int) -> list[Job]:
        """A warm-up measurement's batch (service/tuning.py measure_splits): `rows` pooled rows of `seq`
        ids, seeded, from the lower 90% of the vocabulary (test models keep sentinel ids at the top)."""
        spec = self._require_spec()
        ids = np.random.default_rng(rows).integers(0, max(1, spec.vocab_size - spec.vocab_size // 10), seq)
        return [Job(ids, None, pooling=POOL_MEAN)] * rows

    def run_probe(self, jobs: list[Job], workers: int) -> None:
        """On a model thread: `jobs` as one batch, on the threads one of `workers` side-by-side workers
        gets (every thread for 1). The width stays set for what this thread runs next."""
        self._width.threads = max(1, self._threads // workers)
        _warm(self.execute(jobs))

    def warmup(self, max_batch_tokens: int, max_batch_size: int) -> None:
        """Forwards at the largest batch shape the limits allow, plus the attention path."""
        spec = self._require_spec()
        n = max(1, min(max_batch_size, max_batch_tokens // spec.max_length))
        ids = np.zeros(spec.max_length, dtype=np.int64)
        for jobs in (
            [Job(ids, None)] * n,
            [Job(ids[:8], None, attn_layers=tuple(range(spec.n_layers)), pooling=POOL_MEAN)] * 2,
            [Job(None, np.zeros((8, spec.d_model), np.float32), causal=True)],
        ):
            _warm(self.execute(jobs))
        if self.pipelined:
            # Two batches in flight, as the batcher runs them: both sets of pinned buffers get allocated
            # now, and a broken two-phase path fails start-up rather than the first calls.
            launched = [self.launch([Job(ids, None)] * n) for _ in range(2)]
            for batch in launched:
                _warm(self.finish(batch))
        for head in sorted(self._heads):  # each task head once, on pairs' embeddings too where it has a type delta
            types = np.array([0] * 4 + [1] * 4, np.int64) if self._tables.get(id(self._module)) is not None else None
            _warm(self.execute([Job(ids[:8], None, return_hidden=False, head=head, token_types=types)] * 2))
        if self._fp32_module is not None:
            self._forward(self._fp32_module, [Job(ids[:8], None)])
        if self.diagnostics:
            # TorchScript profiles and optimises a method on its first calls: without this, the first
            # sampled batches would pay that on a model thread, rather than the service's start.
            for jobs in ([Job(ids, None)] * n, [Job(ids[:8], None)] * 2, [Job(ids[:8], None)] * 2):
                self._diagnose(jobs)

    def set_workers(self, workers: int) -> None:
        """How many workers run batches side by side (their narrow batches share the threads): set
        before the batcher starts, once the split is chosen (service/engine.py)."""
        self._workers = workers
        self._narrow_threads = max(1, self._threads // workers)  # a batch's share beside other workers' batches

    def set_wide(self, wide: bool) -> None:
        """On the thread about to run a batch: all the intra-op threads (it runs alone) or one worker's
        share. OpenMP keeps the setting per thread, so each model thread sets its own."""
        self._width.threads = self._threads if wide else self._narrow_threads
        _set_threads(self._width.threads)

    def _fit_threads(self, jobs: Sequence[Job]) -> None:
        """On CPU, before a batch: one intra-op thread for a batch below `small_batch_work` (tokens x d_model
        x layers), else the width set_wide asked for. Splitting a tiny forward costs more in OpenMP's
        hand-offs than it saves, and the pool's threads spin on between such batches (docs/performance.md)."""
        if self._cuda:
            return
        spec = self._require_spec()
        work = len(jobs) * max(job.length for job in jobs) * spec.d_model * spec.n_layers
        _set_threads(1 if work < self._config.small_batch_work else getattr(self._width, "threads", self._threads))

    @property
    def narrow_threads(self) -> int:
        """The intra-op threads of a batch that runs beside other workers' batches."""
        return self._narrow_threads

    @property
    def pipelined(self) -> bool:
        """Whether the batcher should overlap batches through `launch`/`finish` rather than `execute`.

        Off on CPU by default: a CPU forward is synchronous, so overlapping would only delay delivering
        one batch until the next one's forward is done."""
        return self._config.pipeline == "on" or (self._config.pipeline == "auto" and self._cuda)

    def execute(self, jobs: list[Job]) -> tuple[list[Output | ServiceError], float]:
        self._fit_threads(jobs)
        started = time.perf_counter()
        outputs = self._run_split(jobs)
        if not self.pipelined:  # several workers may run batches at once: each counts its own time
            return outputs, time.perf_counter() - started
        return outputs, self._busy_since(started)

    def launch(self, jobs: list[Job]) -> InFlight:
        """First half of a pipelined batch: everything up to the device work, which it does not wait for."""
        self._fit_threads(jobs)
        started = time.perf_counter()
        try:
            return InFlight(jobs, started, self._enqueue(self._module, jobs))
        except Exception as exc:  # noqa: BLE001 - `finish` handles it, in the batch's turn
            return InFlight(jobs, started, None, exc)

    def finish(self, launched: InFlight) -> tuple[list[Output | ServiceError], float]:
        """Second half: wait for the batch's device work, check finiteness, split, re-run in fp32.
        On a failure of either half, the synchronous path takes over (split, bisect)."""
        error = launched.error
        if launched.pending is not None:
            try:
                outputs = self._complete(launched.jobs, self._collect(launched.pending))
                return outputs, self._busy_since(launched.started)
            except Exception as exc:  # noqa: BLE001 - as `execute` handles it
                error = exc
        assert error is not None
        return self._run_split(launched.jobs, error), self._busy_since(launched.started)

    def after_batch(self, jobs: list[Job]) -> Callable[[], None] | None:
        """On a model thread, after each batch: every 1/diagnostics_sample-th batch (a deterministic
        credit, not a coin, so 1 samples every batch) gets its sample, which the batcher runs once the
        batch's results are handed to its callers (service/batching/batcher.py); the other batches
        get None, at the cost of one locked addition."""
        with self._sample_lock:
            self._sample_credit += self._config.diagnostics_sample
            if self._sample_credit < 1.0:
                return None
            self._sample_credit -= 1.0
        return functools.partial(self._sample, jobs)

    def _sample(self, jobs: list[Job]) -> None:
        """Re-run the batch through the bundle's `diagnostics` (all layers explicit, the serving dtype);
        the per-layer attention health goes to the observer. Never raises: a failure is logged, the
        callers already have their answers."""
        try:
            stats = self._diagnose(jobs)
        except Exception:  # noqa: BLE001 - diagnostics must never hurt serving
            log.warning("attention health sampling failed on a batch of %d", len(jobs), exc_info=True)
            return
        limit = self._config.diagnostics_overflow_fraction * float(torch.finfo(DTYPES[self.precision]).max)
        self._observer.on_diagnostics(stats[:, :, 0].tolist(), stats[:, :, 1].tolist(), limit)

    def _diagnose(self, jobs: list[Job]) -> np.ndarray:
        """(B, n_layers, 2): max |score|, normalised entropy per sequence and layer (Encoder.diagnostics)."""
        ids, emb, lengths = self._collate(self._module, jobs)
        with torch.inference_mode():
            stats = self._module.diagnostics(ids, emb, lengths, jobs[0].causal)
        return np.asarray(stats.float().cpu().numpy())

    # -- internals -------------------------------------------------------------------------------

    def _require_spec(self) -> ModelSpec:
        assert self.spec is not None, "Runner.load() was not called. This is a bug."
        return self.spec

    def _busy_since(self, started: float) -> float:
        """A batch's compute time. A pipelined batch launched while the previous one still ran counts
        from when that one finished, so batches' compute times add up to the model's busy time (as
        they do unpipelined, where `started` is always the later)."""
        now = time.perf_counter()
        seconds = now - max(started, self._finished_at)
        self._finished_at = now
        return seconds

    def _run_split(self, jobs: list[Job], failed: Exception | None = None) -> list[Output | ServiceError]:
        """Run `jobs`, splitting on failure; `failed`: they already failed together with it (pipelined)."""
        if failed is None:
            try:
                return self._run(jobs)
            except Exception as exc:  # noqa: BLE001 - classified below; never escapes the model thread
                failed = exc
        oom = is_oom(failed)
        if len(jobs) == 1:
            if oom:
                return [OutOfMemory(f"insufficient device memory for 1 sequence of {jobs[0].length} tokens")]
            error = ModelFailure()
            log.error("model failed on one sequence (ref=%s)", error.ref, exc_info=failed)
            return [error]
        if oom and self._cuda:
            torch.cuda.empty_cache()
        self._observer.on_split("oom" if oom else "error")
        mid = len(jobs) // 2
        return self._run_split(jobs[:mid]) + self._run_split(jobs[mid:])

    def _run(self, jobs: list[Job]) -> list[Output | ServiceError]:
        return self._complete(jobs, self._forward(self._module, jobs))

    def _complete(self, jobs: list[Job], result: _Result) -> list[Output | ServiceError]:
        """Per-sequence outputs from a forward's result; non-finite rows re-run in fp32 or failed."""
        outputs: list[Output | ServiceError] = [
            _split(job, result, row, fp32_rerun=False) for row, job in enumerate(jobs)
        ]
        bad = [row for row in range(len(jobs)) if not result.finite[row]]
        if not bad:
            return outputs
        self._observer.on_nonfinite(self.precision, len(bad))
        if self._fp32_module is None:
            for row in bad:
                outputs[row] = error = NonFiniteOutput()
                log.warning("non-finite output at %s; policy fails it (ref=%s)", self.precision, error.ref)
            return outputs
        self._observer.on_fp32_retry(len(bad))
        retry = [jobs[row] for row in bad]
        result32 = self._forward(self._fp32_module, retry)
        for i, row in enumerate(bad):
            if result32.finite[i]:
                outputs[row] = _split(retry[i], result32, i, fp32_rerun=True)
            else:
                outputs[row] = error = NonFiniteOutput()
                log.warning("non-finite output even in fp32 (ref=%s)", error.ref)
        return outputs

    def _forward(self, module: Any, jobs: Sequence[Job]) -> _Result:
        """Collate, run and wait for the batch's results on the host (`_Result`)."""
        return self._collect(self._enqueue(module, jobs))

    def _collate(self, module: Any, jobs: Sequence[Job]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                   torch.Tensor]:
        """(ids (B, T) or None, embeddings (B, T, D) or None, both on the device, lengths (B,) on the host: the
        tokens attended as keys, Job.attend or its length)."""
        spec = self._require_spec()
        first = jobs[0]
        B, T = len(jobs), max(job.length for job in jobs)
        lengths_host = self._host_zeros((B,), torch.int64)
        # The keys attended: all the tokens, or only those before a query's expansion (Job.attend).
        lengths_host.numpy()[:] = [job.attend or job.length for job in jobs]
        ids = emb = None
        if first.token_ids is not None:
            ids_host = self._host_zeros((B, T), torch.int64)
            rows = ids_host.numpy()  # a view: collate straight into the (pinned) buffer
            for row, job in enumerate(jobs):
                assert job.token_ids is not None  # one key per batch: all ids or all embeddings
                rows[row, : job.length] = job.token_ids
            ids = self._to_device(ids_host)
            if first.token_types is not None:  # pairs with token type 1: fed as embeddings (model/heads.py)
                emb = self._pair_embeddings(module, jobs, ids, (B, T))
                ids = None
        else:
            emb_host = self._host_zeros((B, T, spec.d_model), torch.float32)
            rows_f = emb_host.numpy()
            for row, job in enumerate(jobs):
                rows_f[row, : job.length] = job.embeddings
            dtype = DTYPES[self.precision] if module is self._module else torch.float32
            emb = self._to_device(emb_host, dtype)  # non-blocking: cast on the device
        return ids, emb, lengths_host

    def _pair_embeddings(self, module: Any, jobs: Sequence[Job], ids: torch.Tensor,
                         shape: tuple[int, int]) -> torch.Tensor:
        """(B, T, D): the word table's rows plus the head's token type delta where a pair's type is 1."""
        table = self._tables.get(id(module))
        head = self._heads.get(jobs[0].head)
        assert table is not None and head is not None, "token types for a model without a type delta. This is a bug."
        types_host = self._host_zeros(shape, torch.int64)
        rows = types_host.numpy()
        for row, job in enumerate(jobs):
            assert job.token_types is not None  # one key per batch: all with token types or none
            rows[row, : job.length] = job.token_types
        return pair_embeddings(table, head.type_delta, ids, self._to_device(types_host))

    def _run_heads(self, jobs: Sequence[Job], hidden: torch.Tensor, lengths: torch.Tensor,
                   ids: torch.Tensor | None) -> torch.Tensor | None:
        """(B, n_labels) fp32: each row's head logits (rows without a head: zeros); None when no row has one."""
        names = {job.head for job in jobs if job.head}
        if not names:
            return None
        out: torch.Tensor | None = None
        for name in sorted(names):
            rows = [i for i, job in enumerate(jobs) if job.head == name]
            if len(rows) == len(jobs):
                scores = _call_head(self._heads[name], hidden, lengths, ids)
            else:  # a batch shared with other tasks: the head on its own rows
                index = torch.tensor(rows, device=hidden.device)
                part = _call_head(self._heads[name], hidden.index_select(0, index), lengths.index_select(0, index),
                                  None if ids is None else ids.index_select(0, index))
                scores = torch.zeros((len(jobs), part.shape[1]), device=hidden.device).index_copy(0, index, part)
            out = scores if out is None else torch.where(
                torch.tensor([job.head == name for job in jobs], device=hidden.device)[:, None], scores, out)
        return out

    def _run_vectors(self, jobs: Sequence[Job], hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """(B, T, dim) fp32: the colbert head's unit token vectors, every position of the rows that asked for them
        (other rows zeros); None when no row did."""
        rows = [i for i, job in enumerate(jobs) if job.vectors]
        if not rows:
            return None
        head = self._heads.get("colbert")
        assert head is not None, "token vectors of a model without a colbert head. This is a bug."
        if len(rows) == len(jobs):
            vectors: torch.Tensor = head(hidden, lengths)
            return vectors
        index = torch.tensor(rows, device=hidden.device)
        part = head(hidden.index_select(0, index), lengths.index_select(0, index))  # (rows, T, dim)
        return torch.zeros((len(jobs), *part.shape[1:]), device=hidden.device).index_copy(0, index, part)

    def _enqueue(self, module: Any, jobs: Sequence[Job]) -> _Enqueued:
        """Collate, copy in, run, check finiteness and copy out, all queued on the current CUDA stream
        without waiting for it (on CPU, done by the time it returns).

        Nothing here may synchronize with the device, or a pipelined launch would wait for the batch
        before it: inputs go through pinned buffers (a copy from pageable memory blocks), and the
        attention layers are reordered with slices (indexing with a list copies the index in, blocking).
        """
        first = jobs[0]
        ids, emb, lengths_host = self._collate(module, jobs)
        lengths = self._to_device(lengths_host)
        # Query expansion not attended: the rows past a sequence's keys are outputs too, so the batch must not
        # run packed (which leaves them zeros); `full` counts every token of each sequence.
        unpacked = any(0 < job.attend < job.length for job in jobs)
        full = lengths
        if unpacked:
            assert self._unpacked, "Job.attend on a bundle without forward_unpacked. This is a bug."
            full_host = self._host_zeros((len(jobs),), torch.int64)
            full_host.numpy()[:] = [job.length for job in jobs]
            full = self._to_device(full_host)
        layers = sorted(set(first.attn_layers))
        precision = self.precision if module is self._module else "fp32"
        events = (_timing_event(), _timing_event()) if self._cuda else None
        started = time.perf_counter()
        with torch.inference_mode():
            if events is not None:
                events[0].record()
            # Host lengths (pinned on CUDA): the model reads them to skip the mask when nothing is padded.
            if unpacked:
                hidden, attention = module.forward_unpacked(ids, emb, lengths_host, first.causal, layers)
            elif module is self._module and self._compiled_covers(ids, emb, lengths_host, first.causal, layers):
                assert self._compiled is not None and ids is not None
                hidden, attention = self._compiled(ids, lengths_host), None
                self.compiled_forwards += 1
            else:
                hidden, attention = module(ids, emb, lengths_host, first.causal, layers)
            hidden = _fp32(hidden)
            if attention is not None:
                attention = _fp32(attention)
            finite = self._finite_rows(hidden, attention, full)
            # Pooled on the device, so a batch that returns only pooled vectors copies B x D values
            # back rather than B x T x D (on a GPU the copy of a large batch costs a good part of its
            # forward); on CPU it saves the per-row pooling.
            pooled = None
            if any(job.pooling != POOL_NONE for job in jobs):
                pooled = _pool(hidden, lengths, normalized=any(job.normalize for job in jobs))
            scores = self._run_heads(jobs, hidden, lengths, ids)
            if scores is not None:
                finite = finite & torch.isfinite(scores).all(dim=1)
            vectors = self._run_vectors(jobs, hidden, full)
            if vectors is not None:
                real = torch.arange(vectors.shape[1], device=vectors.device)[None, :] < full[:, None]  # (B, T)
                finite = finite & (torch.isfinite(vectors).all(dim=-1) | ~real).all(dim=-1)
            if attention is not None:
                if first.heads_mean:
                    attention = attention.mean(dim=2, keepdim=True)  # (B, L, 1, T, T)
                if layers != list(first.attn_layers):  # the order asked for
                    attention = torch.stack([attention[:, layers.index(layer)] for layer in first.attn_layers], 1)
                attention = self._to_host(attention)
            pending = _Enqueued(
                precision, self._to_host(hidden) if any(job.return_hidden for job in jobs) else None,
                self._to_host(pooled) if pooled is not None else None, attention, self._to_host(finite), events,
                time.perf_counter() - started, self._to_host(scores) if scores is not None else None,
                self._to_host(vectors) if vectors is not None else None,
            )
            if events is not None:
                events[1].record()
        return pending

    def _compiled_covers(self, ids: torch.Tensor | None, emb: torch.Tensor | None, lengths: torch.Tensor,
                         causal: bool, layers: list[int]) -> bool:
        """Whether this forward runs on the compiled backend: token ids in (not embeddings, not pairs' token
        types), no causal mask, no attention weights, a batch within its compiled shapes. The serving module
        only (`module is self._module`): the fp32 retry of non-finite rows stays on TorchScript."""
        return (self._compiled is not None and ids is not None and emb is None and not causal and not layers
                and self._compiled.covers(int(ids.shape[0]), lengths))

    def _finite_rows(self, hidden: torch.Tensor, attention: torch.Tensor | None,
                     lengths: torch.Tensor) -> torch.Tensor:
        """(B,) bool: whether each sequence's output (padding excluded) is all finite."""
        if not self._cuda and np.isfinite(hidden.numpy().sum()) and (
                attention is None or np.isfinite(attention.numpy().sum())):
            # A sum is finite only if every term is (NaN and Inf propagate), so one reduction clears the
            # whole batch; the per-row check below costs far more on CPU (bench/RESULTS.md). In numpy, which
            # keeps the GIL. Not on CUDA: branching on a device value would wait for the device in a
            # pipelined launch.
            return torch.from_numpy(np.ones(hidden.shape[0], dtype=bool))
        real = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]  # (B, T)
        finite = (torch.isfinite(hidden).all(dim=-1) | ~real).all(dim=-1)
        if attention is not None:
            finite &= torch.isfinite(attention).flatten(1).all(dim=1)
        return finite

    def _collect(self, pending: _Enqueued) -> _Result:
        """Wait for an enqueued forward, report its time, and hand its host tensors over as numpy."""
        seconds = pending.seconds
        if pending.events is not None:
            start, done = pending.events
            done.synchronize()
            seconds = start.elapsed_time(done) / 1e3  # device time: not the wait behind an earlier batch
        finite = pending.finite.tolist()
        self._observer.on_forward(pending.precision, seconds)
        return _Result(_numpy(pending.hidden), _numpy(pending.pooled), _numpy(pending.attention), finite,
                       _numpy(pending.scores), _numpy(pending.vectors))

    def _host_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Pinned on CUDA, so the copy in is an asynchronous DMA; CPU tensors are used in place, made by numpy:
        # a torch call is a dispatch that also lets go of the GIL and takes it back, per batch.
        if not self._cuda:
            return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype]))
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def _to_device(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor on the device (a non-blocking copy, cast there), or as it is on CPU in its dtype."""
        if not self._cuda and (dtype is None or tensor.dtype == dtype):
            return tensor
        return tensor.to(self.device, dtype=dtype, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a device tensor into pinned host memory (read it after the done event)."""
        if not self._cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host


@dataclass(frozen=True)
class _Result:
    """A batch's results on the host, fp32, as numpy views of the batch's tensors; None: not asked for."""

    hidden: np.ndarray | None  # [B, T, D]: None when no sequence returns hidden states
    pooled: np.ndarray | None  # [B, 2 or 4, D]: (mean, first token[, both L2-normalised]); None without pooling
    attention: np.ndarray | None  # [B, L, H or 1, T, T]
    finite: list[bool]  # per row: hidden states (padding excluded) and attention all finite
    scores: np.ndarray | None = None  # [B, n_labels]: head logits; None when no row has a head
    vectors: np.ndarray | None = None  # [B, T, dim]: colbert token vectors; None when no row asked


@dataclass(frozen=True)
class _Enqueued:
    """One forward queued on the device. Its host tensors hold the results once `events[1]` has fired
    (events is None on CPU, where they are complete already)."""

    precision: str
    hidden: torch.Tensor | None  # fp32 [B, T, D], as _Result
    pooled: torch.Tensor | None  # fp32 [B, 2 or 4, D]
    attention: torch.Tensor | None  # fp32 [B, L, H or 1, T, T]
    finite: torch.Tensor  # bool [B]
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # (start, done), timing the device work
    seconds: float  # host time of the forward: its duration on CPU
    scores: torch.Tensor | None = None  # fp32 [B, n_labels]: head logits
    vectors: torch.Tensor | None = None  # fp32 [B, T, dim]: colbert token vectors


@dataclass(frozen=True)
class InFlight:
    """A batch in flight, from `Runner.launch` to `Runner.finish` (the batcher's `InFlight`)."""

    jobs: list[Job]
    started: float
    pending: _Enqueued | None  # None: launch failed
    error: Exception | None = None  # ... with this

    @property
    def failed(self) -> bool:
        return self.error is not None


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it untyped


def _set_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:  # OpenMP keeps it per thread; setting it again is not free
        torch.set_num_threads(threads)


def _unmeasured_reason(config: ServiceConfig, device: torch.device) -> str:
    if config.precision != "auto":
        return "configured"
    if device.type == "cuda":
        return "device default: bf16 where the GPU supports it, else fp16"
    return "not measured (warm-up is off): fp32"


def _probe_batch(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The precision probe's timing batch (the accuracy gate runs on service/calibration.py's inputs): 4 rows of
    min(128, max_length) tokens, two of them padded, ids drawn (seeded) from the lower 90% of the vocabulary
    (test models keep their sentinel ids at the top, model/faults.py)."""
    T = min(128, cfg.max_length)
    lengths = torch.tensor([T, T, max(1, T // 2), max(1, T // 8)])
    high = max(1, cfg.vocab_size - cfg.vocab_size // 10)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, high, size=(4, T)))  # (4, T)
    return ids, lengths


def _warm(result: tuple[list[Output | ServiceError], float]) -> None:
    failed = [o for o in result[0] if isinstance(o, ServiceError)]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


_NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32; as it is when it is already (`.float()` is a torch call, which lets go of the GIL)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def _numpy(tensor: torch.Tensor | None) -> np.ndarray | None:
    return tensor.numpy() if tensor is not None else None


def _pool(hidden: torch.Tensor, lengths: torch.Tensor, normalized: bool = False) -> torch.Tensor:
    """(B, 2, D): each row's mean over its real tokens, and its first token; (B, 4, D) with `normalized`:
    then both again, L2-normalised. hidden is fp32, so both are computed in fp32."""
    real = torch.arange(hidden.shape[1], device=hidden.device)[None, :, None] < lengths[:, None, None]  # (B, T, 1)
    # where, not a product with the mask: 0 x NaN in a padded position would be NaN.
    mean = torch.where(real, hidden, 0.0).sum(dim=1) / lengths[:, None].to(hidden.dtype)
    pooled = torch.stack((mean, hidden[:, 0]), dim=1)  # (B, 2, D)
    if not normalized:
        return pooled
    # x / max(|x|, 1e-12): sentence-transformers' Normalize (F.normalize), so a zero vector stays zero.
    return torch.cat((pooled, torch.nn.functional.normalize(pooled, p=2.0, dim=-1)), dim=1)  # (B, 4, D)


def _split(job: Job, result: _Result, row: int, *, fp32_rerun: bool) -> Output:
    """One row of a batch, padding stripped. numpy, not torch: indexing a tensor costs far more,
    once per sequence of every batch."""
    hidden = result.hidden[row, : job.length] if job.return_hidden and result.hidden is not None else None
    pooled = None
    if job.pooling != POOL_NONE and result.pooled is not None:
        pooled = result.pooled[row, (0 if job.pooling == POOL_MEAN else 1) + (2 if job.normalize else 0)]
    att = None
    if result.attention is not None:
        att = np.ascontiguousarray(result.attention[row, :, :, : job.length, : job.length])  # (L, H, T, T)
    scores = None
    if job.head and result.scores is not None:
        scores = np.array(result.scores[row], dtype=np.float32)
    vectors = None
    if job.vectors and result.vectors is not None:
        rows = job.vector_rows if job.vector_rows is not None else slice(0, job.length)
        vectors = np.array(result.vectors[row, rows], dtype=np.float32)  # (n, dim), a copy: not a view of the batch
    return Output(hidden, pooled, att, fp32_rerun, scores, vectors)


def _call_head(head: Any, hidden: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """A head's output; one that reads the token ids (BGE-M3's LexicalHead, `takes_ids`) gets them too."""
    if getattr(head, "takes_ids", False):
        assert ids is not None, "a head that reads token ids, on embeddings. This is a bug."
        out: torch.Tensor = head(hidden, lengths, ids)
        return out
    out = head(hidden, lengths)
    return out
