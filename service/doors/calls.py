"""The shared call layer every front door stands on: which model a call runs on, and one run of it.

A door is three steps: decode its wire into the door-neutral `Ask` (service/plan.py), `Calls.run`, encode
its wire from the `Ran`. `run` is the only place that plans a call and hands it to the batcher:

    readiness (`Serving.model`, by the door, which needs the model's spec to decode) -> plan (tokenizing,
    windows, limits, the response size; a non-finite input counted) -> admission and the wait for the
    results (`compute`) -> the output stage (`Plan.finish`: windows stitched, vectors cut and quantized)
    -> the output check (a result the asked dtype cannot hold is refused) -> the task's answer (label
    scores, rerank scores and their ranking), in `Ran`.

`tokenize` is the one tokenization a door asks for without encoding (attention.v1 Tokenize, TEI /tokenize).
`failure` maps whatever a call raised to the error its caller sees, counted once; the gRPC doors' answer
and stream loops are service/doors/rpc.py's, the HTTP door's its own route wrapper. Nothing here imports
grpc or aiohttp.

Tracing (service/tracing.py), when on: the answer or route wrapper starts the call's span and sets
`CALL_TRACE` for the call's task; `run` notes its stages' times there (the spans `decode`, `queue`, `encode`),
hands its span context to the batcher with each sequence (`Request.trace`, which the forward spans link
to), and `failure` the message its caller is told. Off, `CALL_TRACE` is None and each stage's test for it
is all tracing costs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from service.batching import Done, Item, Request
from service.config import ServiceConfig
from service.errors import (
    DeadlineExceeded,
    DeadlineUnmeetable,
    ModelFailure,
    NonFiniteInput,
    NotFound,
    NotReady,
    ServiceError,
    ShuttingDown,
    reason_of,
    shown,
)
from service.jobs import Job, ModelSpec, Output
from service.metrics import Metrics
from service.output_range import check_representable
from service.plan import INLINE_CHARS, Ask, Names, Plan, ResponseSize, check_count, plan_call, tokenize
from service.tasks import label_scores, late_scores, ranked, rerank_scores
from service.tracing import CallTrace, Tracing

if TYPE_CHECKING:
    from model.text import Encoded

log = logging.getLogger(__name__)


class Admission(Protocol):
    """Where a model's calls are admitted: its batcher (service/batching/), or, in an edge process, the
    model process's batcher over its socket (service/multiproc/remote.py)."""

    def submit(self, requests: Sequence[Request[Job]], deadline: float) -> list[Item[Job]]: ...
    def cancel(self, items: Sequence[Item[Job]]) -> None: ...


@dataclass(frozen=True)
class Model:
    """One served model as the doors reach it: what it is (its `spec.name` the name it is served as), the
    other names it answers to, where its calls are admitted, and the settings its calls are held to (its
    per-call limits; None: the service's)."""

    spec: ModelSpec
    admission: Admission = field(repr=False)
    aliases: tuple[str, ...] = ()
    config: ServiceConfig | None = field(default=None, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.spec.name, *self.aliases)


class Repository(Protocol):
    """Loading and unloading models while serving (KServe's repository extension), where the process allows it
    (service/server.py, `model_control` explicit): the served models' registry follows."""

    async def load(self, name: str, path: str, settings: Mapping[str, Any]) -> Model: ...
    async def unload(self, name: str, grace: float) -> None: ...


# The served name of the model the call this task handles runs on ("" until a door has found it): what the
# request metrics of a call are labelled with (service/doors/grpc_metrics.py, the HTTP door's route wrapper).
CALL_MODEL: ContextVar[str] = ContextVar("call_model", default="")
# The traced call this task handles (service/tracing.py): None when tracing is off or the call is not sampled.
CALL_TRACE: ContextVar[CallTrace | None] = ContextVar("call_trace", default=None)


@dataclass
class Serving:
    """Readiness and the served models, by name: shared by the server (which sets them) and the doors (which
    admit by them). A call that names no model runs on the default one (the first added, or the one added
    with `default=True`)."""

    models: dict[str, Model] = field(default_factory=dict)  # by served name
    default: str = ""
    repository: Repository | None = None  # run-time load and unload; None: off (model_control none) or elsewhere
    stopping: bool = False  # a shutdown has begun: not ready, though calls are served until `draining`
    draining: bool = False  # from the end of the drain delay: new calls are refused
    _names: dict[str, str] = field(default_factory=dict, repr=False)  # every name and alias -> served name

    def add(self, model: Model, default: bool = False) -> None:
        """Serve `model` under its names; a name another model holds is refused (ValueError, at start-up)."""
        for name in model.names:
            if self._names.get(name, model.spec.name) != model.spec.name:
                raise ValueError(f"model name {name!r} is already served by {self._names[name]!r}")
        self.models[model.spec.name] = model
        self._names.update(dict.fromkeys(model.names, model.spec.name))
        if default or not self.default:
            self.default = model.spec.name

    def remove(self, name: str) -> Model:
        """Stop serving `name` (a served name): calls that name it are NOT_FOUND from now on."""
        model = self.models.pop(name)
        for n in model.names:
            self._names.pop(n, None)
        return model

    @property
    def ready(self) -> bool:
        """Readiness, as grpc.health.v1 reports it (and KServe's ServerReady/ModelReady, the HTTP health
        routes and the attention_ready gauge): the models are warm and no shutdown has begun."""
        return bool(self.models) and not (self.stopping or self.draining)

    @property
    def spec(self) -> ModelSpec | None:
        """The default model's spec, ready or not (None while loading)."""
        model = self.models.get(self.default)
        return model.spec if model is not None else None

    def names(self) -> list[str]:
        """Every name a call may give, served names first."""
        return [*self.models, *(n for n in self._names if n not in self.models)]

    def find(self, name: str = "") -> Model | None:
        """The model `name` (or an alias, "" the default) names, ready or not; None when none does."""
        served = self._names.get(name) if name else self.default
        return self.models.get(served) if served else None

    def model(self, name: str = "") -> Model:
        """The model a call names ("": the default), or the error its caller gets: UNAVAILABLE while
        loading or draining, NOT_FOUND for a name this service does not serve (the names it does listed)."""
        if self.draining:
            raise ShuttingDown("server shutting down; retry on another replica")
        if not self.models:
            raise NotReady("model loading or warming up; retry shortly")
        model = self.find(name)
        if model is None:
            raise NotFound(f"model {shown(name)} is not served here; this service serves {self.names()}")
        CALL_MODEL.set(model.spec.name)
        return model

    def require_serving(self) -> None:
        """Readiness as a health route reports it: UNAVAILABLE while loading, and from the drain's start."""
        self.model()
        if not self.ready:
            raise NotReady("not serving: draining for shutdown")


class Batch(NamedTuple):
    """What a call's response says of how it ran: the widest batch that carried one of its sequences."""

    queue_s: float
    compute_s: float
    batch_size: int
    padded_length: int
    fp32_retry: bool


@dataclass(frozen=True)
class Ran:
    """One call, run: its plan, every job's `Done` (a chunked sequence's windows each), one finished
    output per sequence of the call, and a task's answer."""

    plan: Plan
    spec: ModelSpec
    done: list[Done]
    outputs: list[Output]
    labels: list[np.ndarray] | None = None  # classify: each sequence's label scores, in the model's label order
    scores: list[float] | None = None  # rerank: each text's score, in the call's order
    ranking: list[int] | None = None  # rerank: the top_n texts' indices, highest score first
    plan_s: float = 0.0  # how long planning (tokenizing) took: TEI's tokenization time

    @property
    def batch(self) -> Batch:
        done = self.done
        if len(done) == 1:  # the common call: no scans
            d = done[0]
            return Batch(d.queue_s, d.compute_s, d.batch_size, d.padded_length, d.output.fp32_rerun)
        widest = max(done, key=lambda d: d.batch_size)
        return Batch(max(d.queue_s for d in done), max(d.compute_s for d in done), widest.batch_size,
                     widest.padded_length, any(d.output.fp32_rerun for d in done))

    @property
    def logits(self) -> list[np.ndarray]:
        """A head task's raw scores, one array per sequence (classify: [labels]; rerank: [1]; sparse: [vocab])."""
        out = [o.scores for o in self.outputs]
        assert all(x is not None for x in out), "a head's scores are missing. This is a bug."
        return [x for x in out if x is not None]


Check = Callable[[Plan, Sequence[Output]], None]


def check_dtypes(plan: Plan, outputs: Sequence[Output]) -> None:
    """The default output check: hidden, pooled and attention values the call's dtypes can hold."""
    check_representable(outputs, plan.output_dtype, plan.attention_dtype)


def _expire(items: Sequence[Item[Job]]) -> None:
    """A call's deadline passed: each of its items not answered yet fails DeadlineExceeded (gather() reads
    every one, so none is left unretrieved)."""
    for item in items:
        if not item.future.done():
            item.future.set_exception(DeadlineExceeded("deadline exceeded"))


class Calls:
    """The shared call layer of one process (see the module docstring)."""

    def __init__(self, config: ServiceConfig, serving: Serving, metrics: Metrics, tracing: Tracing | None = None
                 ) -> None:
        self.config = config
        self.serving = serving
        self.metrics = metrics
        self.tracing = tracing  # None: tracing off (service/tracing.py)

    def model(self, name: str = "") -> Model:
        """The model a call names, ready (`Serving.model`)."""
        return self.serving.model(name)

    async def run(self, model: Model, ask: Ask, names: Names, response_size: ResponseSize, seconds: float,
                  check: Check = check_dtypes) -> Ran:
        """Plan `ask` on `model`, compute it within `seconds`, finish and check its outputs, and answer its
        task (the module docstring). Raises the `ServiceError` its caller gets."""
        spec = model.spec
        CALL_MODEL.set(spec.name)  # the call's metrics are this model's (a door may have looked up another first)
        started = time.perf_counter()
        trace = CALL_TRACE.get()
        if trace is not None:
            trace.run()
        try:
            plan = await plan_call(ask, spec, model.config or self.config, names, response_size)
        except NonFiniteInput:
            self.metrics.nonfinite_inputs.inc()
            raise
        plan_s = time.perf_counter() - started
        if trace is not None:
            trace.planned(len(plan.sequences), plan.tokens, plan.task)
        done = await self.compute(model, plan.jobs, seconds)
        outputs = plan.finish([d.output for d in done])
        check(plan, outputs)
        ran = self._answer(Ran(plan, spec, done, outputs, plan_s=plan_s))
        if trace is not None:
            trace.ran()
        return ran

    @staticmethod
    def _answer(ran: Ran) -> Ran:
        """The run, with its task's answer (label scores, rerank scores and ranking)."""
        plan, spec, outputs = ran.plan, ran.spec, ran.outputs
        if plan.task == "classify":
            labels = [label_scores(x, spec.problem_type, plan.raw_scores) for x in ran.logits]
            return dataclasses.replace(ran, labels=labels)
        if plan.task == "rerank":
            if plan.late is not None:  # a late-interaction model: token vectors, scored as its authors score them
                scores = late_scores(outputs, *plan.late, spec.colbert_reduce)
                return dataclasses.replace(ran, scores=scores, ranking=ranked(scores, plan.top_n))
            scores = rerank_scores(ran.logits, plan.raw_scores)
            return dataclasses.replace(ran, scores=scores, ranking=ranked(scores, plan.top_n))
        return ran

    async def tokenize(self, model: Model, texts: Sequence[str], *, field: str, truncate: bool,
                       prompt_name: str = "", prompt_field: str = "prompt_name", side: str | None = None,
                       specials: bool = True) -> list[Encoded]:
        """`texts` tokenized as an encoding call would tokenize them (service/plan.py `tokenize`: limits,
        prompt, truncation on `side`, errors naming `field[i]`; `specials` False: without the special
        tokens), in a worker thread when the call is big."""
        config = model.config or self.config
        check_count(len(texts), config, field, "texts")

        def work() -> list[Encoded]:
            return tokenize(texts, model.spec, config, fields=[f"{field}[{i}]" for i in range(len(texts))],
                            truncate=truncate, side=side, prompt_name=prompt_name, all_field=field,
                            prompt_field=prompt_field, specials=specials)

        if sum(len(t) for t in texts) > INLINE_CHARS:
            return await asyncio.to_thread(work)
        return work()

    async def compute(self, model: Model, jobs: Sequence[Job], seconds: float) -> list[Done]:
        """Admit one call's jobs (all or none) and wait up to `seconds` for their results, in order."""
        if self.serving.draining:
            raise ShuttingDown("server shutting down; retry on another replica")
        floor_ms = self.config.min_deadline_ms
        if seconds * 1e3 < floor_ms:  # refuse at the door what could not finish in time
            raise DeadlineUnmeetable(f"deadline too short: {max(seconds, 0) * 1e3:.1f} ms left; "
                                     f"this service needs at least {floor_ms:g} ms")
        admission = model.admission
        trace = CALL_TRACE.get()
        link = None
        if trace is not None:
            trace.admitted()
            link = trace.link
        items = admission.submit([Request(job, job.length, job.key, link) for job in jobs],
                                 time.monotonic() + seconds)
        # The deadline fails the items' futures (`_expire`): one timer handle, about 1 us a call on uvloop where
        # asyncio.timeout() took 3 (bench/RESULTS.md, "No regression"); a result that arrives later is dropped
        # (the batcher settles only futures not done).
        expiry = asyncio.get_running_loop().call_later(seconds, _expire, items)
        try:
            # One sequence (the common call) awaits its future directly: gather() would add a
            # callback and a loop iteration between the model thread's answer and this task.
            done = [await items[0].future] if len(items) == 1 else await asyncio.gather(
                *(item.future for item in items))
        finally:
            expiry.cancel()
            # All of them: a cancelled gather() has already cancelled its futures, but their items
            # may still be queued. Items that ran or are running are left alone.
            admission.cancel(items)
        self.metrics.on_sequences(len(done), model.spec.name)
        if trace is not None:
            trace.computed(done)
        return done

    def failure(self, exc: BaseException, method: str) -> ServiceError:
        """The error a caller sees for `exc`, counted once in attention_failures_total: a `ServiceError`
        as it is, anything else INTERNAL with a reference id (the traceback logged, never sent). `exc`
        loses its traceback: the caller keeps the error past its except block, and the traceback's frames
        (holding the request, up to a message's worth of bytes) would otherwise live on in a reference
        cycle until the garbage collector next runs."""
        try:
            error = self._failure(exc, method)
            trace = CALL_TRACE.get()
            if trace is not None:
                trace.failed(error.message)
            return error
        finally:
            exc.__traceback__ = None

    def _failure(self, exc: BaseException, method: str) -> ServiceError:
        if isinstance(exc, ServiceError):
            self.metrics.failures.labels(reason_of(exc)).inc()
            return exc
        if isinstance(exc, asyncio.CancelledError) and self.serving.draining:
            error: ServiceError = ShuttingDown("request aborted: server shutting down; retry on another replica")
            self.metrics.failures.labels(reason_of(error)).inc()
            return error
        if isinstance(exc, asyncio.CancelledError):
            error = ModelFailure("request aborted")
            log.error("%s: a future this call awaited was cancelled (ref=%s). This is a bug.", method, error.ref)
        else:
            error = ModelFailure("internal error")
            log.error("%s failed (ref=%s)", method, error.ref, exc_info=exc)
        self.metrics.failures.labels("internal").inc()
        return error


def being_cancelled() -> bool:
    """True when this task itself is being cancelled (by grpcio or aiohttp: caller gone or deadline passed),
    False when a CancelledError came from a future our own code cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
