"""The model half of a serving process: the model threads, the runner, the batch limits and the batcher.

The order is the dependencies' order: the model threads exist first (as many as a worker split may
use: the configured count, else the device default); the runner loads the bundle on the lead thread;
the worker split and the batch budget follow from (config, loaded model, a measurement on those
threads side by side, `measure_choices`), computed once, and the threads beyond the chosen split end;
the batch limits follow from the budget; the runner warms up on the lead thread; then the batcher
starts with the runner, the limits and the threads. Both serving modes hold one `Engine`
(service/server.py in one process, service/multiproc/host.py as the model process of edge processes);
its shutdown is `close()` (no new work) then `drain(grace)` (what was admitted is answered, then the
threads stop), written here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys

from model.bundle import MANIFEST_FILE
from model.default import default_bundle_dir, ensure_default_bundle
from model.hf_folder import is_hf_folder, prepare_model
from service.batching import Batcher, BatchLimits, ModelThreads
from service.config import ServiceConfig
from service.device import default_batch_tokens, default_threads, default_workers, is_cuda, measured_batch_tokens
from service.fault_hooks import FaultHooks
from service.jobs import Job, ModelSpec
from service.metrics import Metrics
from service.runner import Runner
from service.tuning import (
    BatchChoice,
    WorkersChoice,
    batch_reason,
    batch_shapes,
    choose_batch_tokens,
    choose_workers,
    measure_splits,
    workers_reason,
)

log = logging.getLogger(__name__)

# How long a thread holding the GIL keeps it while another waits (CPython's default is 5 ms). The model
# threads need it briefly between forwards (collate, results, the next batch) while the event loop runs the
# calls' Python; at 5 ms a model thread, and so a core, waited behind the loop. 0.5 ms: 1.06-1.07x the
# throughput at c64 and 1.14x the calls/s at c1 on the reference model (bench/RESULTS.md, "The GIL").
SWITCH_INTERVAL_S = 0.0005


def model_workers(config: ServiceConfig) -> int:
    """How many model threads run batches (service/device.py has the defaults)."""
    workers = config.model_workers or default_workers(config.device, config.torch_threads or default_threads())
    if workers > 1 and is_cuda(config.device):
        raise ValueError("model_workers > 1 is for CPUs; on cuda one worker pipelines its batches")
    return workers


def batch_budget(config: ServiceConfig, curve: dict[int, float], seq_len: int, threads: int,
                 workers: int = 1) -> BatchChoice:
    """max_batch_tokens: configured, else chosen from the warm-up curve (of `workers` side by side on
    `threads` each), else the device's default."""
    if config.max_batch_tokens:
        return BatchChoice(config.max_batch_tokens, "configured", {})
    if not curve:
        return BatchChoice(default_batch_tokens(config.device), "device default (not measured: warm-up is off)", {})
    chosen = choose_batch_tokens(curve)
    return BatchChoice(chosen, batch_reason(curve, chosen, seq_len, threads, workers), dict(curve))


def worker_splits(config: ServiceConfig) -> tuple[int, ...]:
    """The worker counts warm-up measures side by side: the configured one (measured only for the
    budget), else 1 and the device default (just the default on a GPU, or with one thread)."""
    default = model_workers(config)
    return (default,) if config.model_workers or default == 1 else (1, default)


def workers_choice(config: ServiceConfig, curves: dict[int, dict[int, float]], threads: int) -> WorkersChoice:
    """model_workers: configured, else chosen from the curves of the splits side by side, else the default."""
    default = model_workers(config)
    if config.model_workers:
        return WorkersChoice(default, "configured", {})
    if len(curves) < 2:
        why = "not measured: warm-up is off" if not curves else "one worker on a GPU or on one thread"
        return WorkersChoice(default, f"device default ({why})", dict(curves))
    chosen = choose_workers(curves, default)
    return WorkersChoice(chosen, workers_reason(curves, chosen, default, threads), dict(curves))


async def measure_choices(config: ServiceConfig, spec: ModelSpec, runner: Runner,
                          threads: ModelThreads) -> tuple[WorkersChoice, BatchChoice]:
    """The worker split and the batch budget: each configured, else measured at warm-up with the
    splits' workers running side by side on `threads` (service/tuning.py measure_splits), the budget
    on the chosen split's curve. The measurement's coordinator waits on a plain thread, never on a
    model thread, whose forwards it waits for."""
    splits = worker_splits(config)
    total = config.torch_threads or default_threads()
    curves: dict[int, dict[int, float]] = {}
    if config.warmup and (len(splits) > 1 or not config.max_batch_tokens):
        sizes = (config.max_batch_tokens,) if config.max_batch_tokens else measured_batch_tokens(config.device)
        shapes = batch_shapes(spec.max_length, config.max_batch_size, sizes)

        def run(workers: int, rows: int, seq: int) -> None:
            jobs = runner.probe_batch(rows, seq)
            futures = [threads.submit(i, functools.partial(runner.run_probe, jobs, workers)) for i in range(workers)]
            for future in futures:
                future.result()

        curves = await asyncio.to_thread(measure_splits, run, splits, shapes)
        await threads.call(lambda: runner.set_wide(True))  # the lead: every thread again, for what follows
        for workers, curve in sorted(curves.items()):
            points = ", ".join(f"{tokens}: {rate:.0f}" for tokens, rate in sorted(curve.items()))
            log.info("warm-up, %d worker(s) x %d thread(s) side by side, tokens/s by batch tokens: %s",
                     workers, max(1, total // workers), points)
    split = workers_choice(config, curves, total)
    budget = batch_budget(config, curves.get(split.workers, {}), min(128, spec.max_length),
                          max(1, total // split.workers), split.workers)
    return split, budget


def batch_limits(config: ServiceConfig, spec: ModelSpec, budget: BatchChoice | None = None) -> BatchLimits:
    """The batcher's limits, from the config, the loaded model and the budget (`batch_budget`): computed
    once, before it starts."""
    tokens = (budget or batch_budget(config, {}, 0, 0)).max_batch_tokens
    if spec.max_length > tokens:
        if config.max_batch_tokens:
            raise ValueError(f"max_batch_tokens ({tokens}) is below the model's max_length ({spec.max_length}): "
                             "a longest sequence could never be batched")
        tokens = spec.max_length  # the device's default budget is for the reference model; one sequence must fit
    return BatchLimits(
        max_batch_tokens=tokens, max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms,
        max_age_ms=config.max_age_ms, max_queue_tokens=config.max_queue_tokens,
        max_queue_requests=config.max_queue_requests,
    )


def _source(reason: str) -> str:
    """A choice's reason as a metric label: configured | measured | default."""
    return "configured" if reason == "configured" else "measured" if reason.startswith("measured") else "default"


class Engine:
    """Model threads, runner and batcher of one serving process. `start()` (on the event loop: the
    threads start, then `load()` loads, warms up and starts the batcher); `close()`; `drain(grace)`."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, hooks: FaultHooks) -> None:
        self.config = config
        self.metrics = metrics
        self.hooks = hooks
        self.threads = ModelThreads(model_workers(config))  # fewer once a split is measured (`load`)
        self.batcher: Batcher[Job] | None = None
        self.spec: ModelSpec | None = None

    @property
    def workers(self) -> int:
        return len(self.threads)

    def start(self) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the process's, set where its model threads start
        self.threads.start()

    async def load(self) -> tuple[Batcher[Job], ModelSpec]:
        """Load and warm the model on the (started) model threads, then start the batcher that runs it."""
        config, metrics, threads = self.config, self.metrics, self.threads
        await self.hooks.pause("before_ready")
        if config.model:  # a bundle, or a Hugging Face folder converted into the cache (or reused from it)
            if is_hf_folder(config.model):
                log.info("a Hugging Face folder: %s; converting it into %s unless a converted bundle is there "
                         "(a first conversion takes seconds to a minute)", config.model, config.bundle_cache_dir)
            prepared = await asyncio.to_thread(prepare_model, config.model, config.bundle_cache_dir)
            if note := prepared.note():
                log.info("%s", note)
            bundle_dir = str(prepared.bundle_dir)
        else:
            bundle_dir = await self._default_bundle()
        runner = Runner(config, bundle_dir, metrics, len(threads))
        spec = await threads.call(runner.load)
        if config.served_model_name:  # the name every door, the metrics and an edge process's HELLO show
            spec = dataclasses.replace(spec, name=config.served_model_name)
        split, budget = await measure_choices(config, spec, runner, threads)
        if split.workers < len(threads):
            threads.shrink(split.workers)
        runner.set_workers(split.workers)
        limits = batch_limits(config, spec, budget)
        log.info("model_workers %d: %s", split.workers, split.reason)
        reason = budget.reason
        if limits.max_batch_tokens != budget.max_batch_tokens:
            reason += f"; raised to the model's max_length ({limits.max_batch_tokens}): one longest sequence must fit"
        compared = {workers: curve for workers, curve in split.curves.items() if workers != split.workers}
        spec = dataclasses.replace(
            spec, max_batch_tokens=limits.max_batch_tokens, batch_reason=reason, batch_curve=budget.curve,
            model_workers=split.workers, workers_reason=split.reason,
            compared_workers=next(iter(compared), 0), compared_curve=next(iter(compared.values()), {}))
        log.info("max_batch_tokens %d: %s", limits.max_batch_tokens, reason)
        if config.warmup:
            await threads.call(lambda: runner.warmup(limits.max_batch_tokens, limits.max_batch_size))
        if len(config.entropy_baselines) not in (0, 1, spec.n_layers):
            raise ValueError(f"entropy_baseline has {len(config.entropy_baselines)} values; the model has "
                             f"{spec.n_layers} layers (give one value, or one per layer)")
        metrics.on_model(spec.n_layers, runner.diagnostics, config.entropy_baselines)
        if runner.diagnostics:
            log.info("attention health: sampling %g of batches", config.diagnostics_sample)
        batcher: Batcher[Job] = Batcher(self.hooks.runner(runner), limits, threads, observer=metrics,
                                        make_queue=self.hooks.queue(),
                                        after_batch=runner.after_batch if runner.diagnostics else None)
        batcher.start()
        metrics.on_choices((spec.name, spec.version, spec.device), spec.precision, _source(spec.precision_reason),
                           spec.precision_forward_ms, spec.max_batch_tokens, _source(spec.batch_reason),
                           spec.batch_curve)
        metrics.on_workers(spec.model_workers, _source(spec.workers_reason))
        self.batcher, self.spec = batcher, spec
        return batcher, spec

    async def _default_bundle(self) -> str:
        """The built-in default model's bundle, built (seconds, no download) into the cache if absent."""
        cache = self.config.bundle_cache_dir
        if (default_bundle_dir(cache) / MANIFEST_FILE).is_file():
            log.info("no --model given: serving the built-in default model from %s", default_bundle_dir(cache))
            return str(default_bundle_dir(cache))
        log.info("no --model given: building the built-in default model (seeded weights, no download) into %s",
                 default_bundle_dir(cache))
        built = await asyncio.to_thread(ensure_default_bundle, cache)
        log.info("built the default model at %s", built)
        return str(built)

    def close(self) -> None:
        """Admit nothing more (a call that still arrives is refused UNAVAILABLE "shutting down")."""
        if self.batcher is not None:
            self.batcher.close()

    async def drain(self, grace: float, margin: float) -> None:
        """Answer what was admitted within `grace - margin` (what cannot finish: UNAVAILABLE "shutting
        down"), then stop the batcher and the model threads. A forward of normal length may end first."""
        if self.batcher is not None:
            await self.batcher.drain(grace - margin)
            await self.batcher.aclose(join_timeout=margin / 2 if grace > 0 else 0.5)
        self.threads.close()
