"""The HTTP front door: an aiohttp application in the gRPC server's event loop, on its own port.

Bound when built (a port in use fails start-up as the gRPC port does; SO_REUSEPORT only for the edge
processes of one service), started with the gRPC server, stopped in its drain: the listener closes,
readiness routes answer 503 from the moment the drain starts, and accepted calls have the grace to
finish. TLS with the gRPC port's certificate and key (mutual TLS with `tls_client_ca`); bearer tokens
checked as on gRPC (service/doors/security.py), health routes exempt. Limits: the body by
`max_message_bytes` (413, its Content-Length checked before reading), `http_read_timeout_s` for it
to arrive (408), aiohttp's bounds on the request line and headers (8190 bytes each, 128 headers:
400), `http_keepalive_s` of idle keep-alive. A caller that disconnects cancels its handler, and
with it its queued work (handler_cancellation; service/doors/calls.py `Calls.compute` cancels its items).
The caller's deadline is its `grpc-timeout` header, else `default_timeout_s` (service/doors/http/deadline.py).

Every call of a route (health routes aside) is counted in attention_requests_total{method, code} with
the gRPC code name of its outcome (so the alerts on code="INTERNAL" see this door too), method being
"<VERB> <route>", e.g. "POST /v1/embeddings".
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import numpy as np
from aiohttp import web
from google.protobuf import json_format

from model.text import special_ids
from proto.attention.v1 import attention_pb2 as pb
from service.config import ServiceConfig
from service.doors.attention_v1 import AttentionServicer
from service.doors.calls import Calls, being_cancelled
from service.doors.http import deadline, kserve_rest, openai, tei
from service.doors.http.inputs import Inputs, json_size, names
from service.doors.http.wire import (
    JSON,
    Dialect,
    field_of,
    json_object,
    json_response,
    read_body,
    read_json,
    renamed,
)
from service.doors.kserve_v2 import SERVER_NAME, SERVER_VERSION, KServeServicer
from service.doors.security import UNAUTHENTICATED, TokenChecker, load_tokens
from service.errors import InvalidInput, NonFiniteInput, NotAcceptable, NotReady, ServiceError, TooLarge, status_of
from service.jobs import ModelSpec
from service.metrics import Metrics
from service.output_range import check_representable
from service.plan import Ask, Plan, head_response_bytes, plan_call
from service.process import port_error
from service.tasks import label_scores, ranked, rerank_scores, sparse_entries

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HEALTH = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
MAX_HEADERS = 128
MAX_LINE = 8190


class _PeerErrors(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's log of a request it refused itself (a malformed request line, headers over the bounds):
    one line at INFO without a traceback. The caller has its 400; anyone can send these, so they must
    not fill the log with ERROR tracebacks."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        kind = type(exc_info).__name__ if isinstance(exc_info, BaseException) else "error"
        self.logger.info("%s: %s", str(msg) % args, kind)


def _encode_error(error: ServiceError, status: int) -> dict[str, Any]:
    """attention.v1 over HTTP: the gRPC status's code, message and field."""
    return {"error": {"code": status_of(error), "message": error.message, "field": field_of(error) or ""}}


ENCODE = Dialect("attention.v1", _encode_error)


def dialect_task(task: str) -> str:
    """A task as the TEI routes name it (the field of a TaskUnavailable)."""
    return {"rerank": "/rerank", "classify": "/predict"}.get(task, task)


def dialect_of(path: str) -> Dialect:
    if path.startswith("/v2"):
        return kserve_rest.DIALECT
    if path.startswith("/v1/encode"):
        return ENCODE
    if path.startswith("/v1/"):
        return openai.DIALECT
    return tei.DIALECT


def ssl_context(config: ServiceConfig) -> ssl.SSLContext | None:
    """The gRPC port's TLS, for HTTP: same certificate and key; with tls_client_ca, client certificates required."""
    if not config.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        context.load_verify_locations(config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(port_error("HTTP", host, port, reason, "ATTN_HTTP_PORT / --http-port")) from None


class HttpDoor:
    def __init__(self, config: ServiceConfig, edge: Calls, metrics: Metrics, attention: AttentionServicer,
                 kserve: KServeServicer, *, reuse_port: bool = False) -> None:
        self._config = config
        self._edge = edge
        self._metrics = metrics
        self._attention = attention
        self._kserve = kserve
        tokens = load_tokens(config)
        self._checker = TokenChecker(tokens) if tokens else None
        self._ssl = ssl_context(config)
        self._created = int(time.time())
        self._special: dict[int, frozenset[int]] = {}
        self.app = web.Application(client_max_size=config.max_message_bytes, middlewares=[self._middleware])
        self._routes()
        self._socket = bind(config.host, config.http_port, reuse_port)
        self.port: int = self._socket.getsockname()[1]
        self._runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None, handler_cancellation=True,
            logger=_PeerErrors(logging.getLogger("service.doors.http.peer"), {}),
            keepalive_timeout=config.http_keepalive_s, max_line_size=MAX_LINE, max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS, shutdown_timeout=config.drain_grace_s)
        self._started = False

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._runner.setup()
        site = web.SockSite(self._runner, self._socket, ssl_context=self._ssl)
        await site.start()
        self._started = True

    async def stop(self, grace: float) -> None:
        """Stop listening; accepted calls have `grace` seconds to finish (the drain's)."""
        if not self._started:
            self._socket.close()
            return
        self._started = False
        self._runner._shutdown_timeout = max(grace, 0.0)  # this drain's grace, not the build-time default
        await self._runner.cleanup()

    # -- plumbing ----------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        dialect = dialect_of(request.path)
        if self._checker is not None and request.path not in HEALTH:
            reason = self._checker.refusal(request.headers.items())
            if reason is not None:
                self._metrics.auth_failures.labels(reason).inc()
                return dialect.error(UNAUTHENTICATED)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # the router's 404 and 405
            if exc.status == 413:
                return dialect.error(TooLarge("body", f"over max_message_bytes {self._config.max_message_bytes}"))
            if exc.status < 400:
                raise
            return dialect.error(NotAcceptable(exc.status, f"{request.method} {_path(request)}: {exc.reason}"))

    def _route(self, verb: str, path: str, dialect: Dialect, work: Handler, counted: bool = True) -> None:
        method = f"{verb} {path}"

        async def handle(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            code = "CANCELLED"  # the caller went away (aiohttp cancelled this handler)
            try:
                try:
                    deadline.start(request.headers.getall(deadline.HEADER, []), self._config.default_timeout_s)
                    response = await work(request)
                    code = "OK"
                    return response
                except asyncio.CancelledError as exc:
                    if being_cancelled():
                        raise
                    error = self._edge.failure(exc, method)
                except Exception as exc:  # every failure answered in the dialect, never a traceback
                    error = self._edge.failure(exc, method)
                code = status_of(error)
                return dialect.error(error)
            finally:
                if counted:
                    self._metrics.observe_request(method, code, time.perf_counter() - started)

        self.app.router.add_route(verb, path, handle)

    def _routes(self) -> None:
        o, t, k = openai.DIALECT, tei.DIALECT, kserve_rest.DIALECT
        self._route("POST", "/v1/embeddings", o, self._embeddings)
        self._route("GET", "/v1/models", o, self._models)
        self._route("POST", "/embed", t, self._embed)
        self._route("POST", "/embed_all", t, self._embed_all)
        self._route("POST", "/embed_sparse", t, self._embed_sparse)
        self._route("POST", "/tokenize", t, self._tokenize)
        self._route("POST", "/decode", t, self._decode)
        self._route("POST", "/rerank", t, self._rerank)
        self._route("POST", "/predict", t, self._predict)
        self._route("GET", "/info", t, self._info)
        self._route("GET", "/health", t, self._health, counted=False)
        self._route("GET", "/v2", k, self._server_metadata)
        self._route("GET", "/v2/health/live", k, self._live, counted=False)
        self._route("GET", "/v2/health/ready", k, self._ready, counted=False)
        self._route("GET", "/v2/models/stats", k, self._all_stats)  # before /v2/models/{model}
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            self._route("GET", base, k, self._model_metadata)
            self._route("GET", f"{base}/ready", k, self._model_ready)
            self._route("GET", f"{base}/config", k, self._model_config)
            self._route("GET", f"{base}/stats", k, self._model_stats)
            self._route("POST", f"{base}/infer", k, self._infer)
        self._route("POST", "/v1/encode", ENCODE, self._encode)

    async def _body(self, request: web.Request) -> Any:
        return await read_json(request, self._config.max_message_bytes, self._config.http_read_timeout_s)

    def _spec(self) -> ModelSpec:
        spec, _ = self._edge.serving.require_ready()
        return spec

    async def _pooled(self, inputs: Inputs, field: str, *, normalize: bool | None, truncate: bool = False,
                      prompt_name: str = "", hidden: bool = False,
                      dimensions: int | None = None) -> tuple[Plan, list[np.ndarray]]:
        """Plan and compute `inputs`: the plan, and each sequence's pooled vector (cut to `dimensions`)
        or its hidden states. Pooling: a text bundle's own, else mean."""
        spec = self._spec()
        ask = Ask(inputs=inputs, return_hidden=hidden, normalize=None if hidden else normalize,
                  pooling="none" if hidden else "model" if spec.tokenizer is not None else "mean",
                  truncate=truncate, prompt_name=prompt_name, dimensions=dimensions)
        try:
            plan = await plan_call(ask, spec, self._config, names(field), json_size)
        except NonFiniteInput:
            self._metrics.nonfinite_inputs.inc()
            raise
        done = await self._edge.compute(plan.jobs, deadline.remaining())
        outputs = plan.finish([d.output for d in done])
        check_representable(outputs, plan.output_dtype, plan.attention_dtype)
        arrays = [out.hidden if hidden else out.pooled for out in outputs]
        assert all(a is not None for a in arrays), "an output asked for is missing. This is a bug."
        return plan, [a for a in arrays if a is not None]

    # -- OpenAI ------------------------------------------------------------------------------------

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        spec = self._spec()
        call = openai.decode(body)
        openai.check_model(call, spec.name)
        # OpenAI's vectors are unit vectors: a model without a tokenizer's own defaults normalises them too.
        normalize = None if spec.tokenizer is not None else True
        plan, vectors = await self._pooled(call.inputs, "input", normalize=normalize, dimensions=call.dimensions)
        return json_response(openai.encode(call, plan.sequences, vectors, spec.name))

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return json_response(openai.models(self._spec().name, self._created))

    # -- TEI ---------------------------------------------------------------------------------------

    def _side(self, spec: ModelSpec) -> str:
        return spec.tokenizer.settings.truncation_side if spec.tokenizer is not None else "right"

    async def _embed(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        spec = self._spec()
        call = tei.decode_embed(body, max_inputs=self._config.max_sequences_per_call, side=self._side(spec))
        _, vectors = await self._pooled(call.inputs, "inputs", normalize=call.normalize, truncate=call.truncate,
                                        prompt_name=call.prompt_name, dimensions=call.dimensions)
        return json_response([np.asarray(v, np.float32).tolist() for v in vectors])

    async def _embed_all(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        spec = self._spec()
        call = tei.decode_embed(body, max_inputs=self._config.max_sequences_per_call, side=self._side(spec),
                                all_tokens=True)
        _, hidden = await self._pooled(call.inputs, "inputs", normalize=None, truncate=call.truncate,
                                       prompt_name=call.prompt_name, hidden=True)
        return json_response([np.asarray(h, np.float32).tolist() for h in hidden])

    async def _embed_sparse(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        spec = self._spec()
        call = tei.decode_embed(body, max_inputs=self._config.max_sequences_per_call, side=self._side(spec),
                                all_tokens=True)
        ask = Ask(inputs=call.inputs, return_hidden=False, truncate=call.truncate, prompt_name=call.prompt_name,
                  sparse=(0, 0.0))
        plan = await plan_call(ask, spec, self._config, replace(names("inputs"), sparse="/embed_sparse"), json_size)
        done = await self._edge.compute(plan.jobs, deadline.remaining())
        out = []
        for d in done:
            assert d.output.scores is not None, "a sparse vector is missing. This is a bug."
            out.append(tei.sparse(*sparse_entries(d.output.scores, 0, 0.0)))
        return json_response(out)

    def _specials(self, spec: ModelSpec) -> frozenset[int]:
        if spec.tokenizer is None:
            return frozenset()
        key = id(spec.tokenizer)
        if key not in self._special:
            self._special[key] = frozenset(special_ids(spec.tokenizer.data).values())
        return self._special[key]

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        texts, prompt = tei.decode_tokenize(body, self._config.max_sequences_per_call)
        spec = self._spec()
        tokenized = pb.TokenizeRequest(texts=texts, prompt_name=prompt)
        try:
            response = await asyncio.to_thread(self._attention._tokenize, tokenized) if sum(map(len, texts)) > 4096 \
                else self._attention._tokenize(tokenized)
        except InvalidInput as exc:
            raise renamed(exc, lambda f: "inputs" + f[len("texts"):] if f.startswith("texts") else f) from None
        special = self._specials(spec)
        return json_response([tei.tokens(list(t.ids), list(t.tokens), special) for t in response.texts])

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        spec = self._spec()
        rows, skip = tei.decode_decode(body, self._config.max_sequences_per_call, spec.vocab_size)
        if spec.tokenizer is None:
            raise InvalidInput("ids", f"model {spec.name} has no tokenizer to decode with")
        return json_response(spec.tokenizer.decode(rows, skip_special_tokens=skip))

    async def _head_call(self, ask: Ask, field: str) -> tuple[Plan, list[np.ndarray], ModelSpec]:
        """A head task's call (classify, rerank) planned and computed: the plan, each sequence's logits."""
        spec = self._spec()
        plan = await plan_call(ask, spec, self._config, replace(names(field), task=dialect_task(ask.task)),
                               head_response_bytes)
        done = await self._edge.compute(plan.jobs, deadline.remaining())
        logits = [d.output.scores for d in done]
        assert all(x is not None for x in logits), "a head's scores are missing. This is a bug."
        return plan, [x for x in logits if x is not None], spec

    async def _rerank(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        call = tei.decode_rerank(body, max_inputs=self._config.max_sequences_per_call, side=self._side(self._spec()))
        ask = Ask(inputs=call.texts, return_hidden=False, task="rerank", query=call.query, top_n=call.top_n,
                  truncate=call.truncate)
        plan, logits, _ = await self._head_call(ask, "texts")
        scores = rerank_scores(logits, call.raw_scores)
        return json_response([{"index": i, "score": scores[i], **({"text": call.texts[i]} if call.return_text else {})}
                              for i in ranked(scores, plan.top_n)])

    async def _predict(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        call = tei.decode_predict(body, max_inputs=self._config.max_sequences_per_call, side=self._side(self._spec()))
        ask = Ask(inputs=call.inputs, return_hidden=False, task="classify", truncate=call.truncate)
        _, logits, spec = await self._head_call(ask, "inputs")
        out = [tei.predictions(spec.labels, label_scores(x, spec.problem_type, call.raw_scores).tolist())
               for x in logits]
        return json_response(out if call.batch else out[0])

    async def _info(self, request: web.Request) -> web.StreamResponse:
        spec, c = self._spec(), self._config
        settings = spec.tokenizer.settings if spec.tokenizer is not None else None
        return json_response({
            "model_id": spec.name, "model_sha": spec.checksum, "model_dtype": spec.precision,
            "model_type": {"embedding": {"pooling": settings.pooling if settings is not None else "mean"}},
            "max_concurrent_requests": c.max_queue_requests,
            "max_input_length": settings.max_tokens if settings is not None else spec.max_length,
            # max_batch_tokens: the one in force (measured at warm-up or configured)
            "max_batch_tokens": spec.max_batch_tokens, "max_batch_requests": c.max_batch_size,
            "max_client_batch_size": c.max_sequences_per_call, "auto_truncate": False, "tokenization_workers": 1,
            "version": SERVER_VERSION, "sha": None, "docker_label": None})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        self._require_serving()
        return web.Response(status=200)

    def _require_serving(self) -> None:
        """Readiness as gRPC health reports it (attention_ready): 503 while loading and from the drain's start."""
        self._edge.serving.require_ready()
        if not self._kserve._ready():
            raise NotReady("not serving: draining for shutdown")

    # -- KServe v2 REST ----------------------------------------------------------------------------

    async def _server_metadata(self, request: web.Request) -> web.StreamResponse:
        return json_response({"name": SERVER_NAME, "version": SERVER_VERSION,
                              "extensions": ["model_configuration", "statistics", "parameters",
                                             "binary_tensor_data"]})

    async def _live(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.StreamResponse:
        self._require_serving()
        return web.Response(status=200)

    def _names(self, request: web.Request) -> tuple[str, str]:
        return request.match_info["model"], request.match_info.get("version", "")

    async def _model_metadata(self, request: web.Request) -> web.StreamResponse:
        from tritonclient.grpc import service_pb2 as v2

        name, version = self._names(request)
        meta = self._kserve._model_metadata(v2.ModelMetadataRequest(name=name, version=version))
        tensors = [[{"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]} for t in group]
                   for group in (meta.inputs, meta.outputs)]
        return json_response({"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                              "inputs": tensors[0], "outputs": tensors[1]})

    async def _model_ready(self, request: web.Request) -> web.StreamResponse:
        from tritonclient.grpc import service_pb2 as v2

        name, version = self._names(request)
        self._kserve._served(name, version)  # unknown: 404
        self._require_serving()
        ready = self._kserve._model_ready(v2.ModelReadyRequest(name=name, version=version)).ready
        return web.Response(status=200 if ready else 503)

    async def _model_config(self, request: web.Request) -> web.StreamResponse:
        from tritonclient.grpc import service_pb2 as v2

        name, version = self._names(request)
        config = self._kserve._model_config(v2.ModelConfigRequest(name=name, version=version)).config
        return json_response(kserve_rest.message(config))

    async def _model_stats(self, request: web.Request) -> web.StreamResponse:
        from tritonclient.grpc import service_pb2 as v2

        name, version = self._names(request)
        stats = self._kserve._model_statistics(v2.ModelStatisticsRequest(name=name, version=version))
        return json_response(kserve_rest.message(stats))

    async def _all_stats(self, request: web.Request) -> web.StreamResponse:
        from tritonclient.grpc import service_pb2 as v2

        return json_response(kserve_rest.message(self._kserve._model_statistics(v2.ModelStatisticsRequest())))

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        raw = await read_body(request, self._config.max_message_bytes, self._config.http_read_timeout_s)
        header, binary = kserve_rest.split(raw, request.headers.get(kserve_rest.HEADER))
        name, version = self._names(request)
        infer, binary_out = kserve_rest.infer_request(header, binary, name, version)
        response = await self._kserve._infer(infer, deadline.remaining())
        body, header_length = kserve_rest.infer_response(response, binary_out)
        if header_length is None:
            return web.Response(body=body, content_type=JSON)
        return web.Response(body=body, content_type="application/octet-stream",
                            headers={kserve_rest.HEADER: str(header_length)})

    # -- attention.v1 ------------------------------------------------------------------------------

    async def _encode(self, request: web.Request) -> web.StreamResponse:
        body = json_object(await self._body(request))
        try:
            message = json_format.ParseDict(body, pb.EncodeRequest(), ignore_unknown_fields=False)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
            raise InvalidInput("body", f"not an attention.v1.EncodeRequest: {str(exc)[:160]}") from None
        response = await self._attention._encode(message, deadline.remaining())
        return json_response(json_format.MessageToDict(response, preserving_proto_field_name=True))


class HttpFront:
    """The drain's view of the HTTP door (service/process.py `Front`). Unlike the gRPC server (whose GOAWAY
    moves streaming callers elsewhere at once; HTTP calls are short), it keeps accepting through the grace,
    its handlers refusing new calls UNAVAILABLE "shutting down" (`Serving.draining`, which the gRPC front's
    `refuse` sets for both), and closes once the model has answered what it admitted; readiness routes
    answer 503 from the drain's start (attention_ready 0)."""

    def __init__(self, door: HttpDoor, serving: Any) -> None:
        self._door = door
        self._serving = serving
        self._deadline = 0.0

    def announce(self, grace: float) -> None:
        pass

    def refuse(self) -> None:
        self._serving.draining = True

    def close(self, grace: float) -> None:
        self._deadline = time.monotonic() + grace

    async def closed(self, margin: float) -> None:
        await self._door.stop(max(margin, self._deadline - time.monotonic()))


class Fronts:
    """Several fronts drained as one (the gRPC server and the HTTP door of one process)."""

    def __init__(self, *fronts: Any) -> None:
        self._fronts = [f for f in fronts if f is not None]

    def announce(self, grace: float) -> None:
        for front in self._fronts:
            front.announce(grace)

    def refuse(self) -> None:
        for front in self._fronts:
            front.refuse()

    def close(self, grace: float) -> None:
        for front in self._fronts:
            front.close(grace)

    async def closed(self, margin: float) -> None:
        await asyncio.gather(*(front.closed(margin) for front in self._fronts))


def _path(request: web.Request) -> str:
    path = request.path
    return path if len(path) <= 64 and path.isprintable() else "(path not shown)"
