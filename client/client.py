"""`EncoderClient` (asyncio) and `SyncEncoderClient`: numpy in, numpy out, a deadline on every call.

    async with EncoderClient("127.0.0.1:50051") as client:
        result = await client.encode([np.array([1, 2, 3])], pooling="mean")
        result.pooled[0]  # float32 [d_model]

Failed calls raise `client.errors.ClientError` subclasses, never a raw `grpc.RpcError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.calls import unary
from client.channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RETRY,
    DEFAULT_TIMEOUT_S,
    HEALTH_PROBE_OPTIONS,
    TLS,
    RetryPolicy,
    call_metadata,
    channel_options,
    open_aio_channel,
    open_sync_channel,
    resolve_target,
    wants_health_check,
)
from client.errors import ClientError, InvalidArgument, error_for, from_rpc_error
from client.messages import (
    Classification,
    ClassifyInput,
    DTypeName,
    EncodeOptions,
    EncodeResult,
    Heads,
    LongInputs,
    ModelInfo,
    Pooling,
    Quantization,
    RankedText,
    Sequences,
    SparseOptions,
    StreamRequest,
    Tokenized,
    build_classify_request,
    build_request,
    build_rerank_request,
    sparse_options,
)
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc

SERVING_STATUS = health_pb2.HealthCheckResponse.ServingStatus
DEFAULT_STREAM_REOPENS = 5
REOPEN_BACKOFF_S = 0.05
# The generated *_pb2_grpc module is untyped; its stubs are used as Any.
_stubs: Any = attention_pb2_grpc
_M = TypeVar("_M", pb.EncodeRequest, pb.ClassifyRequest, pb.RerankRequest)


class _Base:
    """Settings shared by both clients."""

    def __init__(self, target: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, tls: TLS | None = None,
                 token: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retry: RetryPolicy | None = DEFAULT_RETRY, options: Sequence[tuple[str, Any]] = (),
                 health_check: bool | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout}")
        self.target = resolve_target(target)
        self.timeout = timeout
        self._tls = tls
        self._metadata = call_metadata(token)
        if health_check is None:
            health_check = wants_health_check(self.target)
        self._options = channel_options(max_message_bytes=max_message_bytes, retry=retry, tls=tls,
                                        health_check=health_check, extra=options)
        self._probe_options = [*self._options, *HEALTH_PROBE_OPTIONS]
        self._max_message_bytes = max_message_bytes
        # Whether the served model takes text (has a tokenizer): asked once, when a call leaves the
        # pooling to the client and sends no text (see `encode`'s pooling).
        self._text_model: bool | None = None

    def _pooling_unknown(self, options: EncodeOptions, request: pb.EncodeRequest) -> bool:
        """The call leaves its pooling open and sends no text: the default waits on the model's kind."""
        return options.pooling is None and self._text_model is None and not any(
            s.WhichOneof("input") == "text" for s in request.sequences)

    def _default_pooling(self, options: EncodeOptions, request: pb.EncodeRequest) -> pb.EncodeRequest:
        """pooling=None on a text model: the model's own, for ids and embeddings as for text."""
        if options.pooling is None and self._text_model and request.output.pooling == pb.POOLING_NONE:
            request.output.pooling = pb.POOLING_MODEL
        return request

    def _learned(self, info: ModelInfo) -> ModelInfo:
        self._text_model = info.text is not None
        return info

    def _request(self, sequences: Sequences, options: EncodeOptions, request_id: str) -> pb.EncodeRequest:
        return self._sized(build_request(sequences, options, request_id), "sequences")

    def _sized(self, request: _M, field: str) -> _M:
        """The request, unless it is over max_message_bytes: grpc would refuse it locally with
        RESOURCE_EXHAUSTED, and the retry policy would try again."""
        size = request.ByteSize()
        if size > self._max_message_bytes:
            raise InvalidArgument("INVALID_ARGUMENT", f"the request is {size} bytes, over max_message_bytes "
                                  f"{self._max_message_bytes}; split it into several calls", field=field)
        return request

    def _rerank_request(self, query: str, texts: Sequence[str], top_n: int | None, raw_scores: bool,
                        return_text: bool, truncate: bool) -> pb.RerankRequest:
        return self._sized(build_rerank_request(query, texts, top_n, raw_scores, return_text, truncate), "texts")

    def _classify_request(self, inputs: Sequence[ClassifyInput], raw_scores: bool,
                          truncate: bool) -> pb.ClassifyRequest:
        return self._sized(build_classify_request(inputs, raw_scores, truncate), "inputs")

    def _deadline(self, timeout: float | None) -> float:
        """Seconds for this call: its own `timeout`, else the client's. Never None: no call goes
        without a deadline."""
        if timeout is None:
            return self.timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout}")
        return timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, timeout={self.timeout}, tls={self._tls is not None})"


def _options(pooling: Pooling | None, return_hidden: bool, output_dtype: DTypeName, attention: bool,
             layers: Iterable[int] | None, heads: Heads, attention_dtype: DTypeName, causal: bool,
             normalize: bool | None, prompt_name: str, truncate: bool, return_tokens: bool,
             long_inputs: LongInputs | None, stride: int, dimensions: int = 0, quantization: Quantization = "none",
             quantization_ranges: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
             sparse: SparseOptions | bool | None = None) -> EncodeOptions:
    return EncodeOptions(pooling, return_hidden, output_dtype, attention, None if layers is None else tuple(layers),
                         heads, attention_dtype, causal, normalize, prompt_name, truncate, return_tokens,
                         long_inputs, stride, dimensions, quantization, quantization_ranges, sparse_options(sparse))


def _health_status(response: health_pb2.HealthCheckResponse) -> str:
    return str(SERVING_STATUS.Name(response.status))


class EncoderClient(_Base):
    """Asyncio client of `attention.v1.AttentionService`. Use `async with`, or call `aclose()`.

    `target`: "host:port", a gRPC URI such as "dns:///encoder.svc:50051", or several "host:port"
    addresses (a list or a comma-separated string), balanced round-robin. `timeout` is the default
    deadline of every call, in seconds. `tls` turns on TLS (mutual with a client certificate);
    `token` is sent as `authorization: Bearer <token>`. `retry=None` switches gRPC retries off.
    `options` are extra channel arguments, e.g. `[("grpc.keepalive_time_ms", 60000)]`.
    `health_check`: send calls only to addresses whose readiness is SERVING (gRPC client-side health
    checking); by default on for several addresses and `dns:` names, off for one host:port. Pass
    False for a `dns:` name of a proxy (Envoy health-checks the replicas behind it).
    """

    def __init__(self, target: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, tls: TLS | None = None,
                 token: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retry: RetryPolicy | None = DEFAULT_RETRY, options: Sequence[tuple[str, Any]] = (),
                 health_check: bool | None = None) -> None:
        super().__init__(target, timeout=timeout, tls=tls, token=token, max_message_bytes=max_message_bytes,
                         retry=retry, options=options, health_check=health_check)
        # Opened on first use: a grpc.aio channel belongs to the event loop it is created in.
        self._channel: grpc.aio.Channel | None = None
        self._probe_channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._health: Any = None

    def _open(self) -> None:
        if self._channel is None:
            self._channel = open_aio_channel(self.target, self._tls, self._options)
            self._stub = _stubs.AttentionServiceStub(self._channel)

    def _open_probe(self) -> None:
        if self._probe_channel is None:
            self._probe_channel = open_aio_channel(self.target, self._tls, self._probe_options)
            self._health = health_pb2_grpc.HealthStub(self._probe_channel)

    async def __aenter__(self) -> Self:
        self._open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the channel; calls still running are cancelled."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
        if self._probe_channel is not None:
            probe, self._probe_channel = self._probe_channel, None
            await probe.close()

    async def encode(self, sequences: Sequences, *, pooling: Pooling | None = None, return_hidden: bool = True,
                     output_dtype: DTypeName = "float32", attention: bool = False, layers: Iterable[int] | None = None,
                     heads: Heads = "all", attention_dtype: DTypeName = "float32", causal: bool = False,
                     normalize: bool | None = None, prompt_name: str = "", truncate: bool = False,
                     return_tokens: bool = False, long_inputs: LongInputs | None = None, stride: int = 0,
                     dimensions: int = 0, quantization: Quantization = "none",
                     quantization_ranges: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
                     sparse: SparseOptions | bool = False, request_id: str = "",
                     timeout: float | None = None) -> EncodeResult:
        """Encode sequences of token ids ([T] integers), embeddings ([T, d_model] floats) or text (str).

        Text needs a model served with a tokenizer (`model_info().text`): `encode(["a sentence", ...])`
        returns its sentence embeddings in `result.pooled` (pooling "model": the model's own, and its
        default normalisation). `normalize` L2-normalises pooled vectors (None: the model's default);
        `prompt_name` prepends one of the model's prompts; `truncate=True` cuts sequences over the model's
        limit (long_inputs="truncate"; else INVALID_ARGUMENT naming sequences[i]...); `return_tokens` adds
        `result.token_ids` and `result.tokens` for text. `result.token_counts`/`truncated` per sequence.
        `long_inputs`: what to do with a sequence longer than the model (ids, embeddings and text):
        "error" (the default), "truncate" (keep the first max_length tokens; `result.truncated`) or
        "chunk" (encode it in overlapping windows starting every `stride` tokens, 0 = half the window;
        `result.windows`; no attention for such a sequence). None: "truncate" if `truncate`, else "error".
        `pooling`: "mean" (over the real tokens), "cls" (the first token) or "model" (the model's own;
        text models only) adds `result.pooled`, "none" leaves it empty. The default (None) depends on
        the model, not on the input: on a model served with a tokenizer it is "model", for ids and
        embeddings as for text (so encoding `tokenize(...)`'s ids equals encoding the texts); on any
        other model "none". A call without text learns which from one `model_info()` per client.
        `return_hidden=False` leaves `result.hidden` empty. `output_dtype` is the wire precision of
        hidden and pooled: "float32", "float16" (returned as float16 arrays) or "bfloat16" (half the
        bytes; returned as float32 arrays holding exactly the bfloat16 values, numpy having no
        bfloat16 dtype).
        `attention=True` adds `result.attention`, [L, H, T, T] per sequence: `layers` picks layers
        (negative counts from the end; naming layers implies attention), `heads="mean"` averages
        the heads ([L, 1, T, T]), `attention_dtype` as `output_dtype`. `causal` masks lookahead.
        `dimensions` keeps the first n values of each pooled vector (Matryoshka; 1..d_model, 0 = all),
        renormalised when normalised. `quantization` returns pooled vectors as sentence-transformers'
        `quantize_embeddings` makes them: "int8"/"uint8" (np.int8/np.uint8 arrays [n]) from
        `quantization_ranges` = (min, max), each one value or one per dimension (None: the model's,
        `model_info().quantization_ranges`), "binary"/"ubinary" (np.int8/np.uint8 [ceil(n / 8)] of packed
        sign bits). docs/outputs.md has the details.
        `sparse`: True, or `SparseOptions(top_k=..., threshold=...)`, adds `result.sparse`, one SPLADE
        `SparseVector` (indices, values) per sequence, for a model whose `model_info().tasks` has "sparse"
        (docs/tasks.md); other models refuse it (InvalidArgument, field output.sparse).
        Raises `ClientError` subclasses; `InvalidArgument.field` names the offending input.
        """
        options = _options(pooling, return_hidden, output_dtype, attention, layers, heads, attention_dtype, causal,
                           normalize, prompt_name, truncate, return_tokens, long_inputs, stride, dimensions,
                           quantization, quantization_ranges, sparse)
        loop = asyncio.get_running_loop()
        end = loop.time() + self._deadline(timeout)
        request = await self._build(sequences, options, request_id, end)
        return EncodeResult.from_proto(await self._encode(request, _left(end - loop.time())))

    async def _build(self, sequences: Sequences, options: EncodeOptions, request_id: str,
                     end: float) -> pb.EncodeRequest:
        """The request; first the model's kind when the default pooling needs it, within the deadline."""
        request = self._request(sequences, options, request_id)
        if self._pooling_unknown(options, request):
            await self.model_info(timeout=_left(end - asyncio.get_running_loop().time()))
        return self._default_pooling(options, request)

    async def _encode(self, request: pb.EncodeRequest, timeout: float | None) -> pb.EncodeResponse:
        self._open()
        try:
            response: pb.EncodeResponse = await unary(self._stub.Encode(request, timeout=self._deadline(timeout),
                                                                        metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return response

    async def tokenize(self, texts: Sequence[str], *, prompt_name: str = "", truncate: bool = False,
                       timeout: float | None = None) -> list[Tokenized]:
        """`texts` as the served model's tokenizer turns them into ids, exactly as `encode` would (the
        same prompt, limits and errors), without running the model. A model without a tokenizer, or a
        text over its token limit without `truncate`, raises `InvalidArgument` naming texts[i]."""
        self._open()
        request = pb.TokenizeRequest(texts=list(texts), prompt_name=prompt_name, truncate=truncate)
        try:
            response = await unary(self._stub.Tokenize(request, timeout=self._deadline(timeout),
                                                       metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return Tokenized.many_from_proto(response)

    async def rerank(self, query: str, texts: Sequence[str], *, top_n: int | None = None, raw_scores: bool = False,
                     return_text: bool = False, truncate: bool = False,
                     timeout: float | None = None) -> list[RankedText]:
        """Score each (query, text) pair with the served cross-encoder (a model whose `model_info().tasks`
        has "rerank"; docs/tasks.md) and return them best first, as the server orders them (ties in the
        texts' order): `RankedText(index, score, text, ...)`, `text` None unless `return_text`. Scores are
        sigmoid(logit) unless `raw_scores`. `top_n` keeps the best n (1..len(texts); None: all).
        `truncate=True` cuts a pair over the model's token limit (longest first) instead of refusing it.
        The server refuses an empty query, no texts, a top_n out of range or a model without the task
        (InvalidArgument; `.field` query, texts, top_n, texts[i], Rerank); wrong Python types raise
        TypeError before anything is sent."""
        request = self._rerank_request(query, texts, top_n, raw_scores, return_text, truncate)
        self._open()
        try:
            response = await unary(self._stub.Rerank(request, timeout=self._deadline(timeout), metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return RankedText.many_from_proto(response, return_text)

    async def classify(self, inputs: Sequence[ClassifyInput], *, raw_scores: bool = False, truncate: bool = False,
                       timeout: float | None = None) -> list[Classification]:
        """Classify texts, or (text, text) pairs (all one or all the other), with the served classification
        head (`model_info().tasks` has "classify"): one `Classification` per input, in order, whose
        `scores` map each of `model_info().labels` to its score: softmax (sigmoid for multi-label and
        one-label heads) unless `raw_scores` (the logits). `truncate` as in `rerank`. The server refuses
        no inputs, a text over the limit or a model without the task (InvalidArgument; `.field` texts,
        texts[i], pairs[i], Classify); wrong Python types raise TypeError, a mix of texts and pairs
        InvalidArgument (inputs[i]), before anything is sent."""
        request = self._classify_request(inputs, raw_scores, truncate)
        self._open()
        try:
            response = await unary(self._stub.Classify(request, timeout=self._deadline(timeout),
                                                       metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return Classification.many_from_proto(response)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model, its precision and device, and the per-call limits."""
        self._open()
        try:
            info = await unary(self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._deadline(timeout),
                                                       metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return self._learned(ModelInfo.from_proto(info))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """`grpc.health.v1` status of `service` ("" = the process, "attention.v1.AttentionService" =
        ready to encode): "SERVING", "NOT_SERVING", or "SERVICE_UNKNOWN" for a name the server
        does not know. An unreachable server raises `Unavailable`. Asked over a channel of its own
        without client-side health checking, which would hide a NOT_SERVING server."""
        self._open_probe()
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = await unary(self._health.Check(request, timeout=self._deadline(timeout),
                                                      metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise from_rpc_error(exc) from exc
        return _health_status(response)

    async def encode_stream(self, requests: AsyncIterable[StreamRequest] | Iterable[StreamRequest], *,
                            timeout: float | None = None,
                            max_reopens: int = DEFAULT_STREAM_REOPENS) -> AsyncIterator[EncodeResult | ClientError]:
        """Send `StreamRequest`s over a bidirectional stream; yield one item per request, in completion
        order: an `EncodeResult`, or the `ClientError` of a request that failed (its `request_id`
        set; the stream goes on). `requests` is an iterable or async iterable of `StreamRequest`
        (anything else raises `TypeError`). `timeout` bounds the whole stream. A failure of the
        stream itself raises; so does a request the client cannot build (`InvalidArgument`,
        `TypeError`) or an error of `requests` itself, after the requests sent before it have been
        answered. Pooling as in `encode` (None: the model's own on a text model).

        A stream is one HTTP/2 stream, pinned to one server (a balancer cannot move or retry it once
        answers flow). When that server drains (it answers a request UNAVAILABLE) or the stream is
        lost (UNAVAILABLE; a reset; any end grpc reports without a status from the server, such as
        INTERNAL "Internal error from Core" when the server was killed), the stream is reopened, up
        to `max_reopens` times (0: never), where the channel's balancer sends it, and the requests
        that got no answer are sent again. Encoding is idempotent, so the caller sees each request
        answered exactly once and no error from a drain or a crash. Request ids must be unique among
        the requests not yet answered (an empty id is replaced by the request's index). To spread
        one caller's load over several servers, open several streams."""
        if max_reopens < 0:
            raise ValueError(f"max_reopens must be >= 0; got {max_reopens}")
        if isinstance(requests, StreamRequest | str | bytes) or not isinstance(requests, AsyncIterable | Iterable):
            raise TypeError(f"encode_stream takes an iterable (or async iterable) of StreamRequest; got "
                            f"{type(requests).__name__} (one request: [StreamRequest(sequences)])")
        self._open()
        loop = asyncio.get_running_loop()
        end = loop.time() + self._deadline(timeout)
        # One task reads the caller's requests for every stream in turn: a stream that is stopped
        # must not cancel (and so close) the caller's generator.
        queue: asyncio.Queue[pb.EncodeRequest | None] = asyncio.Queue(maxsize=1)
        failure: list[Exception] = []
        pending: dict[str, pb.EncodeRequest] = {}  # sent, not yet answered, in sending order
        ended = False  # the caller's requests are all taken

        async def build(index: int, item: object) -> pb.EncodeRequest:
            if not isinstance(item, StreamRequest):
                raise TypeError(f"encode_stream takes StreamRequest items, e.g. StreamRequest([ids], "
                                f"request_id='a'); item {index} is a {type(item).__name__}")
            return await self._build(item.sequences, item.options, item.request_id or str(index), end)

        async def pump() -> None:
            index = 0
            try:
                if isinstance(requests, AsyncIterable):
                    async for item in requests:
                        await queue.put(await build(index, item))
                        index += 1
                else:
                    for item in requests:
                        await queue.put(await build(index, item))
                        index += 1
            except Exception as exc:
                # End the request stream instead, let the requests already sent finish, then raise
                # it to the caller.
                failure.append(exc)
            await queue.put(None)

        def accept(taken: pb.EncodeRequest | None) -> pb.EncodeRequest | None:
            """Record a request taken from the queue in `pending`; None when there is none to send."""
            nonlocal ended
            if taken is None:
                ended = True
                return None
            if taken.request_id in pending:
                failure.append(InvalidArgument(
                    "INVALID_ARGUMENT", f"request_id {taken.request_id!r} is already in flight on this "
                    "stream; ids must be unique among unanswered requests", field="request_id"))
                ended = True
                return None
            pending[taken.request_id] = taken
            return taken

        async def write(call: Any, resend: list[pb.EncodeRequest], draining: asyncio.Event) -> None:
            """This stream's sender, cancelled when the stream ends. A request is in `pending` before it
            is written, so the next stream sends it again whatever happens to this one."""
            try:
                for again in resend:
                    await call.write(again)
                while not ended:
                    take = asyncio.ensure_future(queue.get())
                    stop = asyncio.ensure_future(draining.wait())
                    try:
                        await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
                    except asyncio.CancelledError:
                        if take.done() and not take.cancelled():
                            accept(take.result())  # taken as the stream ended: the next stream sends it
                        raise
                    finally:
                        stop.cancel()
                        if not take.done():
                            take.cancel()  # a get cancelled before it returned takes nothing from the queue
                    if not take.done():
                        break  # draining: half-close, so the server answers what it holds and ends
                    request = accept(take.result())
                    if request is None or draining.is_set():
                        break  # no more requests; or taken as the drain was seen: the next stream sends it
                    await call.write(request)
                await call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the stream has ended; its reader says how

        pumping = asyncio.create_task(pump())
        reopens = 0
        try:
            while True:
                draining = asyncio.Event()
                remaining = end - loop.time()
                call = self._stub.EncodeStream(timeout=max(remaining, 1e-3), metadata=self._metadata)
                writer = asyncio.create_task(write(call, list(pending.values()), draining))
                broken: grpc.aio.AioRpcError | None = None
                try:
                    async for response in call:
                        if response.HasField("error"):
                            e = response.error
                            if e.code == "UNAVAILABLE" and max_reopens > 0:
                                draining.set()  # this server is shutting down: send the rest elsewhere
                                continue
                            pending.pop(response.request_id, None)
                            yield error_for(e.code, e.message, field=e.field or None, request_id=response.request_id)
                        else:
                            pending.pop(response.request_id, None)
                            yield EncodeResult.from_proto(response)
                except grpc.aio.AioRpcError as exc:
                    if failure:
                        raise failure[0] from exc
                    if not _stream_broken(exc):
                        raise from_rpc_error(exc) from exc
                    broken = exc
                finally:
                    call.cancel()  # no-op once finished; stops the stream when the caller stops early
                    writer.cancel()
                    await asyncio.gather(writer, return_exceptions=True)
                if ended and not pending:
                    break
                if reopens >= max_reopens:
                    if broken is not None:
                        raise from_rpc_error(broken) from broken
                    raise error_for("UNAVAILABLE", f"the stream was moved {reopens} times and {len(pending)} "
                                    "requests are still unanswered", request_id=next(iter(pending), ""))
                reopens += 1
                # Not at once: the balancer needs a moment to see the server that went away.
                await asyncio.sleep(min(REOPEN_BACKOFF_S * 2 ** (reopens - 1), 1.0))
        finally:
            pumping.cancel()
        if failure:
            raise failure[0]


def _left(seconds: float) -> float:
    """What is left of a deadline, as a call's timeout; DeadlineExceeded once it has passed."""
    if seconds <= 0:
        raise error_for("DEADLINE_EXCEEDED", "the deadline passed before the call was sent (the model info it "
                        "needed took it)")
    return seconds


def _stream_broken(error: grpc.aio.AioRpcError) -> bool:
    """The stream was lost rather than answered by the server: UNAVAILABLE (the server went away or
    refused), a reset stream (grpc reports INTERNAL "RST_STREAM"; a proxy sends one when the server
    behind it dies mid-stream), or any INTERNAL/UNKNOWN that grpc made up itself rather than received
    as the server's status (e.g. "Internal error from Core" when a write meets a killed server's
    connection). A status the server sent says "Error received from peer" in grpc's debug string."""
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return False
    return "RST_STREAM" in (error.details() or "") or "received from peer" not in (error.debug_error_string() or "")


class SyncEncoderClient(_Base):
    """Blocking twin of `EncoderClient` (same arguments and methods, no streaming). Use `with`,
    or call `close()`."""

    def __init__(self, target: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, tls: TLS | None = None,
                 token: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retry: RetryPolicy | None = DEFAULT_RETRY, options: Sequence[tuple[str, Any]] = (),
                 health_check: bool | None = None) -> None:
        super().__init__(target, timeout=timeout, tls=tls, token=token, max_message_bytes=max_message_bytes,
                         retry=retry, options=options, health_check=health_check)
        self._channel = open_sync_channel(self.target, self._tls, self._options)
        self._stub = _stubs.AttentionServiceStub(self._channel)
        self._probe_channel: grpc.Channel | None = None
        self._health: Any = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._probe_channel is not None:
            self._probe_channel.close()

    def encode(self, sequences: Sequences, *, pooling: Pooling | None = None, return_hidden: bool = True,
               output_dtype: DTypeName = "float32", attention: bool = False, layers: Iterable[int] | None = None,
               heads: Heads = "all", attention_dtype: DTypeName = "float32", causal: bool = False,
               normalize: bool | None = None, prompt_name: str = "", truncate: bool = False,
               return_tokens: bool = False, long_inputs: LongInputs | None = None, stride: int = 0,
               dimensions: int = 0, quantization: Quantization = "none",
               quantization_ranges: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
               sparse: SparseOptions | bool = False, request_id: str = "",
               timeout: float | None = None) -> EncodeResult:
        """See `EncoderClient.encode`."""
        options = _options(pooling, return_hidden, output_dtype, attention, layers, heads, attention_dtype, causal,
                           normalize, prompt_name, truncate, return_tokens, long_inputs, stride, dimensions,
                           quantization, quantization_ranges, sparse)
        end = time.monotonic() + self._deadline(timeout)
        request = self._request(sequences, options, request_id)
        if self._pooling_unknown(options, request):
            self.model_info(timeout=_left(end - time.monotonic()))
        request = self._default_pooling(options, request)
        try:
            response = self._stub.Encode(request, timeout=_left(end - time.monotonic()), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return EncodeResult.from_proto(response)

    def tokenize(self, texts: Sequence[str], *, prompt_name: str = "", truncate: bool = False,
                 timeout: float | None = None) -> list[Tokenized]:
        """See `EncoderClient.tokenize`."""
        request = pb.TokenizeRequest(texts=list(texts), prompt_name=prompt_name, truncate=truncate)
        try:
            response = self._stub.Tokenize(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return Tokenized.many_from_proto(response)

    def rerank(self, query: str, texts: Sequence[str], *, top_n: int | None = None, raw_scores: bool = False,
               return_text: bool = False, truncate: bool = False, timeout: float | None = None) -> list[RankedText]:
        """See `EncoderClient.rerank`."""
        request = self._rerank_request(query, texts, top_n, raw_scores, return_text, truncate)
        try:
            response = self._stub.Rerank(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return RankedText.many_from_proto(response, return_text)

    def classify(self, inputs: Sequence[ClassifyInput], *, raw_scores: bool = False, truncate: bool = False,
                 timeout: float | None = None) -> list[Classification]:
        """See `EncoderClient.classify`."""
        request = self._classify_request(inputs, raw_scores, truncate)
        try:
            response = self._stub.Classify(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return Classification.many_from_proto(response)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """See `EncoderClient.model_info`."""
        try:
            info = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._deadline(timeout),
                                           metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return self._learned(ModelInfo.from_proto(info))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """See `EncoderClient.health`."""
        if self._probe_channel is None:
            self._probe_channel = open_sync_channel(self.target, self._tls, self._probe_options)
            self._health = health_pb2_grpc.HealthStub(self._probe_channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = self._health.Check(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise from_rpc_error(exc) from exc
        return _health_status(response)
