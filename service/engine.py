"""The model half of a serving process: the model threads, the scheduler, and per model its runner, batch
limits and lane (`LoadedModel`).

The order is the dependencies' order: the model threads exist first (as many as a worker split may
use: the configured count, else the device default); each model's runner loads its bundle on the lead
thread; the worker split (the threads', once, at the default model's warm-up) and each model's batch
budget follow from (config, loaded model, a measurement on those threads side by side,
`measure_choices`), and the threads beyond the chosen split end; the batch limits follow from the
budget; the runner warms up on the lead thread; the model's lane joins the one scheduler; once every
configured model is in, the scheduler starts. A model loaded at run time (`load_model`) takes the same
steps, its thread work run between the other models' batches (`Scheduler.run_on`). Both serving modes
hold one `Engine` (service/server.py in one process, service/multiproc/host.py as the model process of
edge processes); its shutdown is `close()` (no new work) then `drain(grace)` (what was admitted is
answered, then the threads stop), written here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.bundle import MANIFEST_FILE, read_manifest
from model.default import default_bundle_dir, ensure_default_bundle
from model.hf_folder import is_hf_folder, prepare_model
from service.batching import Batcher, BatchLimits, ModelThreads, Scheduler
from service.config import ServiceConfig, model_entry
from service.device import default_batch_tokens, default_threads, default_workers, is_cuda, measured_batch_tokens
from service.errors import FailedPrecondition, InvalidInput, NotFound, NotReady, ServiceError, shown
from service.fault_hooks import FaultHooks
from service.jobs import Job, ModelSpec
from service.memory import MIB, estimate_bytes, release, used_bytes
from service.metrics import Metrics
from service.runner import Runner
from service.tracing import Tracing
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
                          submit: Callable[[int, Callable[[], Any]], Future[Any]], threads: int,
                          split: WorkersChoice | None = None) -> tuple[WorkersChoice, BatchChoice]:
    """The worker split and the batch budget: each configured, else measured at warm-up with the
    splits' workers running side by side on the model threads (`submit(worker, fn)` runs fn on one;
    `threads` of them now; service/tuning.py measure_splits), the budget on the chosen split's curve.
    With `split` (the threads' split, chosen at the first model's warm-up), only the budget is measured,
    at that split. The measurement's coordinator waits on a plain thread, never on a model thread, whose
    forwards it waits for."""
    splits = (split.workers,) if split is not None else worker_splits(config)
    total = config.torch_threads or default_threads()
    curves: dict[int, dict[int, float]] = {}
    if config.warmup and (len(splits) > 1 or not config.max_batch_tokens):
        sizes = (config.max_batch_tokens,) if config.max_batch_tokens else measured_batch_tokens(config.device)
        shapes = batch_shapes(spec.max_length, config.max_batch_size, sizes)

        def run(workers: int, rows: int, seq: int) -> None:
            jobs = runner.probe_batch(rows, seq)
            futures = [submit(i, functools.partial(runner.run_probe, jobs, workers)) for i in range(workers)]
            for future in futures:
                future.result()

        curves = await asyncio.to_thread(measure_splits, run, splits, shapes)
        # The lead: every thread again, for what follows.
        await asyncio.wrap_future(submit(0, lambda: runner.set_wide(True)))
        for workers, curve in sorted(curves.items()):
            points = ", ".join(f"{tokens}: {rate:.0f}" for tokens, rate in sorted(curve.items()))
            log.info("warm-up, %d worker(s) x %d thread(s) side by side, tokens/s by batch tokens: %s",
                     workers, max(1, total // workers), points)
    chosen = workers_choice(config, curves, total) if split is None else split
    budget = batch_budget(config, curves.get(chosen.workers, {}), min(128, spec.max_length),
                          max(1, total // chosen.workers), chosen.workers)
    return chosen, budget


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


@dataclass(eq=False)
class LoadedModel:
    """One model served: what the front doors register by name. `spec.name` is its served name; `admission`
    its lane (`submit(requests, deadline) -> items`, all or none, `Overloaded` over its own bounds,
    `ShuttingDown` once it is being unloaded; `cancel(items)`); `aliases` the other names it answers to;
    `config` the settings it runs with (the service's, with its own over them: per-call limits such as
    `max_sequences_per_call` are read there); `memory_bytes` its estimate charged to the memory budget."""

    spec: ModelSpec
    admission: Batcher[Job]
    aliases: tuple[str, ...]
    config: ServiceConfig
    memory_bytes: int
    state: str = "READY"  # READY | UNLOADING (refusing new calls, answering those it accepted)
    runner: Runner | None = field(default=None, repr=False)  # None once unloaded

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.spec.name, *self.aliases)

    @property
    def ready(self) -> bool:
        return self.state == "READY"


@dataclass(frozen=True)
class _Plan:
    """A model to load: its served name ("": its manifest's), where it is ("": the built-in default model), its
    aliases and its config."""

    name: str
    path: str
    aliases: tuple[str, ...]
    config: ServiceConfig


class Engine:
    """Model threads, scheduler, runners and lanes of one serving process. `start()` (on the event loop: the
    threads start), then `load()` loads and warms up the configured models and starts the scheduler;
    `load_model`/`unload_model` at run time (`model_control` explicit); `close()`; `drain(grace)`.

    Several models (`models`, by served name; `default` the one calls that name no model use) share the one
    set of model threads and the one scheduler (service/batching/batcher.py, "Several models"). The worker
    split is the threads', chosen at the default model's warm-up; each model's precision and batch budget
    are measured at its own. Start-up loads the default model first: if it fails, start-up fails; another
    that fails is logged by name and kept in `failed` (name -> why), and the service starts without it."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, hooks: FaultHooks, tracing: Tracing | None = None
                 ) -> None:
        self.config = config
        self.metrics = metrics
        self.hooks = hooks
        self.tracing = tracing  # None: off; else each model's forwards are traced (service/tracing.py)
        self.threads = ModelThreads(model_workers(config))  # fewer once a split is measured (`load`)
        self.scheduler: Scheduler[Job] = Scheduler(self.threads)
        self.models: dict[str, LoadedModel] = {}  # by served name, the default first
        self.default = ""
        self.failed: dict[str, str] = {}  # configured models that did not load at start-up: name -> why
        self.batcher: Batcher[Job] | None = None  # the default model's lane
        self.spec: ModelSpec | None = None  # ... and its spec
        self._split: WorkersChoice | None = None
        self._claimed: set[str] = set()  # names (and aliases) of models loading now
        self._loading: dict[str, int] = {}  # their estimates, held against the budget
        self._budget_lock = asyncio.Lock()

    @property
    def workers(self) -> int:
        return len(self.threads)

    @property
    def cuda(self) -> bool:
        return is_cuda(self.config.device)

    def start(self) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the process's, set where its model threads start
        self.threads.start()

    def resolve(self, name: str) -> LoadedModel:
        """The model a call names (its served name or an alias; "": the default). `NotFound` lists the names
        served; a model being unloaded is still found (its lane answers `ShuttingDown`)."""
        if not name:
            name = self.default
        model = self.models.get(name)
        if model is None:
            model = next((m for m in self.models.values() if name in m.aliases), None)
        if model is None:
            raise NotFound(f"model {shown(name)} is not served here; models: {', '.join(self.models) or 'none'}")
        return model

    async def load(self) -> tuple[Batcher[Job], ModelSpec]:
        """Load and warm every configured model on the (started) model threads, the default first, then start
        the scheduler that runs them; returns the default model's lane and spec."""
        config = self.config
        await self.hooks.pause("before_ready")
        if config.models:
            plans = [_Plan(e.name, e.path, e.aliases, config.for_model(e)) for e in config.model_entries]
        else:  # the one-model form: the config as given (an empty model: the built-in default), named by
            # --served-model-name (else its manifest) with --model-alias's names
            plans = [_Plan(config.served_model_name, config.model, config.model_aliases, config)]
        for i, plan in enumerate(plans):
            if len(plans) > 1:
                log.info("loading model %s (%d of %d) from %s%s", plan.name or "(named by its manifest)", i + 1,
                         len(plans), plan.path, "; the default" if i == 0 else "")
            try:
                model = await self._load(plan)
            except Exception as e:
                if i == 0:
                    raise  # the default: calls that name no model have nowhere to go
                name = plan.name or plan.path
                self.failed[name] = _first_line(e)
                log.error("model %s failed to load, serving the others without it: %s", name, self.failed[name],
                          exc_info=not isinstance(e, FailedPrecondition))
                continue
            if i == 0:
                self.default = model.name
                self.batcher, self.spec = model.admission, model.spec
        self.scheduler.start()
        assert self.batcher is not None and self.spec is not None
        return self.batcher, self.spec

    async def load_model(self, name: str, path: str, settings: Mapping[str, Any] | None = None) -> LoadedModel:
        """Load, warm and serve a model at run time (`model_control` explicit), as `name` (a served name, or
        the key that `settings["served_name"]` replaces), from `path` (a bundle or a Hugging Face folder),
        with `settings` (a models file's per-model keys: precision, max_batch_tokens, aliases, ...). The
        other models' calls keep flowing: its load and warm-up run on the model threads between their
        batches. Raises `FailedPrecondition` (model control off, a name taken, over the memory budget, the
        load failed: the message says which), `InvalidInput` (a bad setting, named), `NotReady` (start-up
        not done)."""
        if self.config.model_control != "explicit":
            raise FailedPrecondition("model control is off: start the service with --model-control explicit to "
                                     "load and unload models at run time")
        if not self.scheduler.started:
            raise NotReady("the service is starting; retry shortly")
        table = dict(settings or {})
        if "default" in table:
            raise InvalidInput("default", "the default model is chosen at start-up, not at run time")
        try:
            entry = model_entry(name, {**table, "path": path})
            plan = _Plan(entry.name, entry.path, entry.aliases, self.config.for_model(entry))
        except ValueError as e:
            raise InvalidInput("model", str(e)) from None
        if not Path(path).exists():
            raise InvalidInput("path", f"{path!r} is neither a model bundle nor a Hugging Face folder")
        try:
            return await self._load(plan)
        except ServiceError:
            raise
        except Exception as e:
            log.error("model %s failed to load", entry.name, exc_info=True)
            raise FailedPrecondition(f"model {entry.name!r} failed to load: {_first_line(e)}") from None

    async def unload_model(self, name: str, grace: float) -> None:
        """Stop serving `name` (`model_control` explicit): its lane refuses new calls (`ShuttingDown`), the calls
        it accepted are answered within `grace` seconds (what is left then: `ShuttingDown`), then it leaves
        `models`, its runner is freed and the memory goes back (`NotFound` once it is gone). The default
        model stays (`FailedPrecondition`)."""
        if self.config.model_control != "explicit":
            raise FailedPrecondition("model control is off: start the service with --model-control explicit to "
                                     "load and unload models at run time")
        model = self.resolve(name) if name else None
        if model is None or name not in model.names:
            raise NotFound(f"model {shown(name)} is not served here; models: {', '.join(self.models) or 'none'}")
        if model.name == self.default:
            raise FailedPrecondition(f"model {model.name!r} is the default model (calls that name no model use it); "
                                     "it is not unloaded at run time")
        if not model.ready:
            raise FailedPrecondition(f"model {model.name!r} is being unloaded already")
        before = used_bytes(self.cuda)
        model.state = "UNLOADING"
        lane = model.admission
        lane.close(f"model {model.name!r} is being unloaded; retry on another replica")
        log.info("unloading model %s: answering the calls it accepted (up to %.1f s)", model.name, grace)
        drained = await lane.drain(grace)
        await lane.aclose(join_timeout=0 if drained else 0.5)
        self.models.pop(model.name, None)
        self.metrics.forget_model(model.name)
        model.runner = None
        await asyncio.to_thread(release, self.cuda)
        log.info("unloaded model %s%s: %s %d -> %d MiB", model.name, "" if drained else " (grace over: the rest "
                 "answered UNAVAILABLE)", "device memory" if self.cuda else "RSS", before // MIB,
                 used_bytes(self.cuda) // MIB)

    @property
    def memory_reserved(self) -> int:
        """Bytes of the loaded (and loading) models' estimates, held against `memory_budget_mb`."""
        return sum(model.memory_bytes for model in self.models.values()) + sum(self._loading.values())

    def _claim(self, names: Sequence[str]) -> None:
        """Refuse a name already served or being loaded; else hold it until the load ends (`_load`)."""
        for name in names:
            taken = name in self._claimed or any(name in model.names for model in self.models.values())
            if taken:
                raise FailedPrecondition(f"model name {name!r} is taken (a model is served, loading or unloading "
                                         "under it); unload that model first")
        self._claimed.update(names)

    async def _reserve(self, name: str, config: ServiceConfig, bundle_dir: str) -> int:
        """The model's estimate (service/memory.py), held for it; `FailedPrecondition` when it does not fit the
        budget (or, on a GPU, the device's free memory), saying by how much."""
        estimate = estimate_bytes(bundle_dir, config, self.cuda)
        async with self._budget_lock:
            budget = self.config.memory_budget_mb * MIB
            held = self.memory_reserved
            if budget and held + estimate > budget:
                taken = ", ".join(f"{m.name} {m.memory_bytes / MIB:.0f}" for m in self.models.values()) or "none"
                raise FailedPrecondition(
                    f"model {name!r} does not fit the memory budget: its weights need about {estimate / MIB:.0f} MiB "
                    f"({config.precision} precision), {held / MIB:.0f} of {budget / MIB:.0f} MiB are taken (MiB by "
                    f"model: {taken}); unload a model or raise memory_budget_mb")
            if self.cuda:
                free, _ = torch.cuda.mem_get_info()
                if estimate > free:
                    raise FailedPrecondition(f"model {name!r} does not fit in device memory: its weights need about "
                                             f"{estimate / MIB:.0f} MiB, {free / MIB:.0f} MiB are free")
            self._loading[name] = estimate
        return estimate

    async def _load(self, plan: _Plan) -> LoadedModel:
        """Load, measure, warm up and attach one model (module docstring); on the model threads, between
        batches once the scheduler runs."""
        config, metrics, threads = plan.config, self.metrics, self.threads
        submit = self.scheduler.run_on
        claimed = [*((plan.name,) if plan.name else ()), *plan.aliases]
        self._claim(claimed)
        try:
            bundle_dir = await self._bundle_dir(plan.path, config)
            name = plan.name or (await asyncio.to_thread(read_manifest, bundle_dir)).name
            if not plan.name:
                self._claim([name])
                claimed.append(name)
            estimate = await self._reserve(name, config, bundle_dir)
        except BaseException:
            self._claimed.difference_update(claimed)
            raise
        try:
            observer = metrics.for_model(name)
            runner = Runner(config, bundle_dir, observer, len(threads))
            spec = await asyncio.wrap_future(submit(0, runner.load))
            split, budget = await measure_choices(config, spec, runner, submit, len(threads), self._split)
            if self._split is None:
                if split.workers < len(threads):
                    threads.shrink(split.workers)
                self._split = split
                log.info("model_workers %d: %s", split.workers, split.reason)
            runner.set_workers(split.workers)
            limits = batch_limits(config, spec, budget)
            reason = budget.reason
            if limits.max_batch_tokens != budget.max_batch_tokens:
                reason += (f"; raised to the model's max_length ({limits.max_batch_tokens}): one longest sequence "
                           "must fit")
            compared = {workers: curve for workers, curve in split.curves.items() if workers != split.workers}
            bundle_name = spec.name
            spec = dataclasses.replace(
                spec, name=name, max_batch_tokens=limits.max_batch_tokens, batch_reason=reason,
                batch_curve=budget.curve, model_workers=split.workers, workers_reason=split.reason,
                compared_workers=next(iter(compared), 0), compared_curve=next(iter(compared.values()), {}))
            log.info("max_batch_tokens %d: %s", limits.max_batch_tokens, reason)
            if config.warmup:
                await asyncio.wrap_future(submit(0, lambda: runner.warmup(limits.max_batch_tokens,
                                                                          limits.max_batch_size)))
            if len(config.entropy_baselines) not in (0, 1, spec.n_layers):
                raise ValueError(f"entropy_baseline has {len(config.entropy_baselines)} values; the model has "
                                 f"{spec.n_layers} layers (give one value, or one per layer)")
            observer.on_model(spec.n_layers, runner.diagnostics, config.entropy_baselines)
            if runner.diagnostics:
                log.info("attention health: sampling %g of batches", config.diagnostics_sample)
            lane: Batcher[Job] = Batcher(self.hooks.runner(runner), limits, threads, observer=observer,
                                         make_queue=self.hooks.queue(),
                                         after_batch=runner.after_batch if runner.diagnostics else None,
                                         scheduler=self.scheduler, name=name,
                                         tracer=self.tracing.forwards(name) if self.tracing is not None else None)
            observer.on_limits(limits.max_queue_tokens)
            observer.on_choices((bundle_name, spec.version, spec.device), spec.precision,
                                _source(spec.precision_reason), spec.precision_forward_ms, spec.max_batch_tokens,
                                _source(spec.batch_reason), spec.batch_curve)
            metrics.on_workers(spec.model_workers, _source(spec.workers_reason))
            model = LoadedModel(spec, lane, plan.aliases, config, estimate, runner=runner)
            self.models[name] = model
            if self.scheduler.started:
                log.info("serving model %s v%s (%s, %s)%s", name, spec.version, spec.device, spec.precision,
                         f", also as {', '.join(plan.aliases)}" if plan.aliases else "")
            return model
        except BaseException:
            metrics.forget_model(name)
            raise
        finally:
            self._loading.pop(name, None)
            self._claimed.difference_update(claimed)

    async def _bundle_dir(self, path: str, config: ServiceConfig) -> str:
        """The bundle to load for `path`: as given, a Hugging Face folder converted into the cache (or reused
        from it), or the built-in default model's ("")."""
        if not path:
            return await self._default_bundle()
        if is_hf_folder(path):
            log.info("a Hugging Face folder: %s; converting it into %s unless a converted bundle is there "
                     "(a first conversion takes seconds to a minute)", path, config.bundle_cache_dir)
        prepared = await asyncio.to_thread(prepare_model, path, config.bundle_cache_dir)
        if note := prepared.note():
            log.info("%s", note)
        return str(prepared.bundle_dir)

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
        self.scheduler.close()

    async def drain(self, grace: float, margin: float) -> None:
        """Answer what was admitted within `grace - margin` (what cannot finish: UNAVAILABLE "shutting
        down"), then stop the scheduler and the model threads. A forward of normal length may end first."""
        await self.scheduler.drain(grace - margin)
        await self.scheduler.aclose(join_timeout=margin / 2 if grace > 0 else 0.5)
        self.threads.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]
