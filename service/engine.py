"""The model half of a serving process: the model threads, the runner, the batch limits and the batcher.

The order is the dependencies' order: the model threads exist first; the runner loads the bundle and
warms up on the lead thread; the batch limits follow from (config, loaded model), computed once; then
the batcher starts with the runner, the limits and the threads. Both serving modes hold one `Engine`
(service/server.py in one process, service/multiproc/host.py as the model process of edge processes);
its shutdown is `close()` (no new work) then `drain(grace)` (what was admitted is answered, then the
threads stop), written here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

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
from service.tuning import BatchChoice, batch_reason, choose_batch_tokens

log = logging.getLogger(__name__)


def model_workers(config: ServiceConfig) -> int:
    """How many model threads run batches (service/device.py has the defaults)."""
    workers = config.model_workers or default_workers(config.device, config.torch_threads or default_threads())
    if workers > 1 and is_cuda(config.device):
        raise ValueError("model_workers > 1 is for CPUs; on cuda one worker pipelines its batches")
    return workers


def batch_budget(config: ServiceConfig, curve: dict[int, float], seq_len: int, threads: int) -> BatchChoice:
    """max_batch_tokens: configured, else chosen from the warm-up curve, else the device's default."""
    if config.max_batch_tokens:
        return BatchChoice(config.max_batch_tokens, "configured", {})
    if not curve:
        return BatchChoice(default_batch_tokens(config.device), "device default (not measured: warm-up is off)", {})
    chosen = choose_batch_tokens(curve)
    return BatchChoice(chosen, batch_reason(curve, chosen, seq_len, threads), dict(curve))


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
        self.threads = ModelThreads(model_workers(config))
        self.batcher: Batcher[Job] | None = None
        self.spec: ModelSpec | None = None

    @property
    def workers(self) -> int:
        return len(self.threads)

    def start(self) -> None:
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
        curve: dict[int, float] = {}
        if config.warmup and not config.max_batch_tokens:
            sizes = measured_batch_tokens(config.device)
            curve = await threads.call(lambda: runner.measure_batches(sizes, config.max_batch_size))
        budget = batch_budget(config, curve, min(128, spec.max_length), runner.narrow_threads)
        limits = batch_limits(config, spec, budget)
        log.info("max_batch_tokens %d: %s", limits.max_batch_tokens, budget.reason)
        spec = dataclasses.replace(spec, max_batch_tokens=limits.max_batch_tokens, batch_reason=budget.reason,
                                   batch_curve=budget.curve)
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
