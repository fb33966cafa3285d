"""Closed-loop load generator (the way perf_analyzer and ghz measure): `run_load(...) -> BenchReport`.

`concurrency` callers each keep exactly one Encode call in flight over grpc.aio. Requests are built
and serialized once, up front, and sent as raw bytes through a generic `unary_unary` with identity
serializers, so the generator spends its CPU on gRPC, not on numpy or protobuf. Calls are not
retried (retries would hide errors). The run stops after `duration_s` or `max_requests` measured
calls, whichever comes first; calls started during `warmup_s` are made but not measured. A caller
whose call fails UNAVAILABLE (the server is down or draining) waits before its next one, 50 ms
doubling to 1 s while the failures last, so a dead server gets a few calls a second, not a flood.
With `text_source`, requests carry text (a text model benchmarked with its own inputs; the token
counts are the server's Tokenize answer, asked once before the run).

With `stream`, the callers' requests go instead over one EncodeStream per connection, each still
waiting for its own answer (matched by request_id) before it sends the next: the same closed loop
without a gRPC call per request. A stream that fails fails every request then in flight on it, and
its callers stop.
"""

from __future__ import annotations

import asyncio
import math
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np

from client.channel import SERVICE, TLS, call_metadata, channel_options, open_aio_channel, resolve_target
from client.errors import from_rpc_error
from client.load_calls import CallFailed, Calls, StreamCalls, UnaryCalls
from client.messages import DTypeName, EncodeOptions, ModelInfo, Pooling, build_request
from proto.attention.v1 import attention_pb2 as pb

GET_MODEL_INFO = f"/{SERVICE}/GetModelInfo"
TOKENIZE = f"/{SERVICE}/Tokenize"
BACKOFF_S = (0.05, 1.0)  # after an UNAVAILABLE: the first wait, and the most, doubling in between
WORDS = ("the a of and to in is for on with as by at from that this it be are was model attention "
         "service encoder token sentence vector search query document text embedding layer head batch "
         "server client request answer fast small large first last new old open closed running reading "
         "learned building written data index score rank 2024 3.14 100 , . ; : ! ? ( ) - café naïve").split()
MAX_DURATION_S = 600.0
MAX_REQUESTS = 10_000_000
MAX_CONCURRENCY = 4096


def generated_texts(count: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    """`count` texts of random English-like words, each of a length uniform in `words` (both included)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(words[0], words[1] + 1)))) for _ in range(count)]


def read_texts(path: str) -> list[str]:
    """One text per line of a UTF-8 file; blank lines are skipped."""
    with open(path, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise ValueError(f"{path}: no text in it (one text per line)")
    return texts


def parse_lengths(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "16:256" -> uniform over 16..256 (both included)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if match is None:
        raise ValueError(f"lengths must be N or LOW:HIGH; got {text!r}")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not 1 <= low <= high:
        raise ValueError(f"lengths need 1 <= LOW <= HIGH; got {text!r}")
    return low, high


@dataclass(frozen=True)
class BenchReport:
    """What a run measured. Latencies in milliseconds; rates per second of measured wall time.

    `server` holds means over successful calls of their response metadata: `queue_ms`, `compute_ms`,
    `batch_size`, `padded_length`, and `padding_ratio` (padded tokens / real tokens of the batches
    that carried the calls; for multi-sequence calls the widest batch stands for all). `client_cpu`
    is the generator process's CPU seconds (user + system) per second of wall time.
    """

    target: str
    model: str
    concurrency: int
    connections: int
    lengths: tuple[int, int]
    sequences_per_request: int
    attention: bool
    dtype: str
    seed: int
    warmup_s: float
    warmup_requests: int
    duration_s: float
    requests: int
    ok: int
    errors: dict[str, int]
    sequences: int
    tokens: int
    requests_per_s: float
    sequences_per_s: float
    tokens_per_s: float
    latency_ms: dict[str, float]
    server: dict[str, float]
    client_cpu_s: float
    client_cpu: float
    stream: bool = False  # requests went over EncodeStream rather than one Encode call each
    samples_ms: list[float] = field(default_factory=list, repr=False)  # per measured call, in completion order

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        """JSON-ready: NaN (no ok calls) becomes None; `samples` keeps the per-call latencies."""
        data = asdict(self)
        data["lengths"] = list(self.lengths)
        if not samples:
            del data["samples_ms"]
        for group in ("latency_ms", "server"):
            data[group] = {k: None if math.isnan(v) else v for k, v in data[group].items()}
        return data

    def format(self) -> str:
        """A ghz-like text summary."""
        lat, srv = self.latency_ms, self.server
        low, high = self.lengths
        errors = ", ".join(f"{code} {n}" for code, n in sorted(self.errors.items())) or "none"
        lines = [
            "Summary:",
            f"  target        {self.target} ({self.model})",
            f"  load          concurrency {self.concurrency}, {self.connections} connection(s), lengths "
            f"{low if low == high else f'{low}..{high}'}, {self.sequences_per_request} seq/call, "
            f"attention {'on' if self.attention else 'off'}, {self.dtype}"
            f"{', over EncodeStream' if self.stream else ''}",
            f"  duration      {self.duration_s:.2f} s "
            f"(after {self.warmup_s:g} s warm-up, {self.warmup_requests} calls)",
            f"  calls         {self.requests} ({self.ok} ok)",
            f"  throughput    {self.requests_per_s:,.1f} calls/s, {self.sequences_per_s:,.1f} sequences/s, "
            f"{self.tokens_per_s:,.0f} tokens/s",
            "Latency (ms):",
            "  " + "  ".join(f"{k} {lat[k]:.2f}" for k in ("p50", "p90", "p99", "max", "mean")),
            "Server side (means over ok calls):",
            f"  queue {srv['queue_ms']:.2f} ms, compute {srv['compute_ms']:.2f} ms "
            f"(queue share {srv['queue_share']:.0%}), batch size {srv['batch_size']:.2f}, "
            f"padded length {srv['padded_length']:.1f}, padding ratio {srv['padding_ratio']:.3f}",
            f"Errors by code: {errors}",
            f"Load generator CPU: {self.client_cpu:.2f} s/s ({self.client_cpu_s:.2f} s)",
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Prepared:
    raw: bytes
    sequences: int
    tokens: int


def prepare_requests(info: ModelInfo, *, lengths: tuple[int, int], sequences_per_request: int, count: int,
                     seed: int, options: EncodeOptions,
                     texts: Sequence[tuple[str, int]] | None = None) -> list[_Prepared]:
    """`count` serialized EncodeRequests with random ids; lengths uniform in `lengths`, clipped to the
    model's max_length. With `texts` ((text, its token count) pairs): texts drawn from them instead."""
    rng = np.random.default_rng(seed)
    if texts:
        text_pool = []
        for i in range(count):
            picked = [texts[int(j)] for j in rng.integers(0, len(texts), sequences_per_request)]
            raw = build_request([t for t, _ in picked], options, request_id=f"bench-{i}").SerializeToString()
            text_pool.append(_Prepared(raw, len(picked), sum(n for _, n in picked)))
        return text_pool
    low, high = (min(n, info.max_length) for n in lengths)
    pool = []
    for i in range(count):
        seqs = [rng.integers(0, info.vocab_size, int(rng.integers(low, high + 1)), dtype=np.int64)
                for _ in range(sequences_per_request)]
        raw = build_request(seqs, options, request_id=f"bench-{i}").SerializeToString()
        pool.append(_Prepared(raw, len(seqs), sum(len(s) for s in seqs)))
    return pool


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {k: math.nan for k in ("p50", "p90", "p99", "max", "min", "mean")}
    a = np.asarray(samples)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()), "min": float(a.min()),
            "mean": float(a.mean())}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_load(
    target: str | Sequence[str], *, concurrency: int = 8, duration_s: float | None = 10.0,
    max_requests: int | None = None, lengths: tuple[int, int] = (128, 128), sequences_per_request: int = 1,
    warmup_s: float = 0.0, seed: int = 0, attention: bool = False, dtype: DTypeName = "float32",
    pooling: Pooling = "none", return_hidden: bool = True, timeout: float = 30.0, connections: int = 1,
    tls: TLS | None = None, token: str | None = None, pool_size: int = 256, progress: bool = False,
    stream: bool = False, texts: Sequence[tuple[str, int]] | None = None,
    text_source: Sequence[str] | None = None,
) -> BenchReport:
    """Closed-loop load on `target` (see the module docstring); returns what was measured.

    At least one of `duration_s` (at most 600 s) and `max_requests` (at most 10 million) must be
    given. `dtype` is the output (and attention) wire precision. `progress` draws a tqdm bar on
    stderr (when tqdm is installed). `texts`: (text, token count) pairs to send instead of random
    ids; `text_source`: texts whose counts the server's tokenizer gives (ValueError for a model that
    takes no text). Raises `ClientError` when the model info cannot be read (server down).
    """
    if duration_s is None and max_requests is None:
        raise ValueError("give duration_s or max_requests (or both): the run must be bounded")
    if duration_s is not None and not 0 < duration_s <= MAX_DURATION_S:
        raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S:g}]; got {duration_s}")
    if max_requests is not None and not 1 <= max_requests <= MAX_REQUESTS:
        raise ValueError(f"max_requests must be in 1..{MAX_REQUESTS}; got {max_requests}")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be in 1..{MAX_CONCURRENCY}; got {concurrency}")
    if not 0 <= warmup_s <= MAX_DURATION_S:
        raise ValueError(f"warmup_s must be in [0, {MAX_DURATION_S:g}]; got {warmup_s}")
    if connections < 1 or sequences_per_request < 1 or pool_size < 1:
        raise ValueError("connections, sequences_per_request and pool_size must be >= 1")

    resolved = resolve_target(target)
    # A local subchannel pool per channel: otherwise grpc shares one connection between channels.
    options = channel_options(retry=None, tls=tls, extra=[("grpc.use_local_subchannel_pool", 1)])
    channels = [open_aio_channel(resolved, tls, options) for _ in range(connections)]
    metadata = call_metadata(token)
    try:
        try:
            raw_info = await channels[0].unary_unary(GET_MODEL_INFO)(
                pb.GetModelInfoRequest().SerializeToString(), timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        info = ModelInfo.from_proto(pb.ModelInfo.FromString(raw_info))
        if text_source is not None:
            source = list(text_source)
            if len(source) > pool_size:  # a random pool_size of them, as with ids
                source = [source[int(i)] for i in np.random.default_rng(seed).choice(len(source), pool_size, False)]
            texts = await _token_counts(channels[0], metadata, timeout, info, source)
        encode_options = EncodeOptions(pooling=pooling, return_hidden=return_hidden, output_dtype=dtype,
                                       attention=attention, attention_dtype=dtype,
                                       truncate=texts is not None)  # text: cut at the model's limit
        if max_requests is not None:
            pool_size = min(pool_size, max_requests + concurrency)
        pool = prepare_requests(info, lengths=lengths, sequences_per_request=sequences_per_request,
                                count=pool_size, seed=seed, options=encode_options, texts=texts)
        calls: list[Calls]
        if stream:
            # One deadline for the whole stream: the run's own bound, plus a call's timeout.
            deadline = (MAX_DURATION_S if duration_s is None else duration_s) + warmup_s + timeout
            calls = [StreamCalls(channel, metadata, deadline, timeout) for channel in channels]
        else:
            calls = [UnaryCalls(channel, metadata, timeout) for channel in channels]
        try:
            return await _drive(
                calls, pool, info=info, target=resolved, concurrency=concurrency, duration_s=duration_s,
                max_requests=max_requests, warmup_s=warmup_s, progress=progress,
                settings=dict(lengths=lengths, sequences_per_request=sequences_per_request, attention=attention,
                              dtype=dtype, seed=seed, connections=connections, stream=stream),
            )
        finally:
            for call in calls:
                await call.close()
    finally:
        for channel in channels:
            await channel.close()


async def _token_counts(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], timeout: float,
                        info: ModelInfo, texts: list[str]) -> list[tuple[str, int]]:
    """(text, its token count as the served tokenizer cuts it at the model's limit) for each text."""
    if info.text is None:
        raise ValueError(f"model {info.name} takes no text (it is served without a tokenizer); bench it with ids "
                         "(without --text-file / --generated-text)")
    tokenize = channel.unary_unary(TOKENIZE)
    counts: list[int] = []
    step = max(1, info.limits.max_sequences_per_call)
    for start in range(0, len(texts), step):
        request = pb.TokenizeRequest(texts=texts[start:start + step], truncate=True)
        try:
            raw = await tokenize(request.SerializeToString(), timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        counts += [len(t.ids) for t in pb.TokenizeResponse.FromString(raw).texts]
    return list(zip(texts, counts, strict=True))


async def _drive(calls: list[Calls], pool: list[_Prepared], *, info: ModelInfo, target: str, concurrency: int,
                 duration_s: float | None, max_requests: int | None, warmup_s: float, progress: bool,
                 settings: dict[str, Any]) -> BenchReport:
    try:
        from tqdm import tqdm
    except ImportError:  # the service's runtime set has no tqdm (requirements.txt): no bar
        tqdm = None
    progress = progress and tqdm is not None

    latencies: list[float] = []
    codes: Counter[str] = Counter()
    meta = np.zeros((0, 4))
    rows: list[tuple[int, int, int, int]] = []  # queue_us, compute_us, batch_size, padded_length
    padded_tokens = 0
    real_tokens = 0
    sequences = 0
    claimed = 0
    warmup_calls = 0

    started = time.perf_counter()
    measure_from = started + warmup_s
    stop_at = math.inf if duration_s is None else measure_from + duration_s
    cpu_at_start: list[float] = [_cpu_seconds()] if warmup_s == 0 else []
    bar = tqdm(total=max_requests, unit="call", file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
               desc="warm-up" if warmup_s else "load") if progress else None

    async def mark_measuring() -> None:
        await asyncio.sleep(warmup_s)
        cpu_at_start.append(_cpu_seconds())
        if bar is not None:
            bar.set_description("load")

    async def caller(index: int) -> None:
        nonlocal claimed, warmup_calls, padded_tokens, real_tokens, sequences
        call = calls[index % len(calls)]
        k = index
        backoff = 0.0  # the wait before the next call: 0 unless the last one failed UNAVAILABLE
        while True:
            if backoff:
                await asyncio.sleep(min(backoff, max(0.0, stop_at - time.perf_counter())))
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            measured = t0 >= measure_from
            if measured:
                if max_requests is not None and claimed >= max_requests:
                    return
                claimed += 1
            else:
                warmup_calls += 1
            item = pool[k % len(pool)]
            k += concurrency
            try:
                m = (await call(item.raw)).metadata
                code = "OK"
            except CallFailed as exc:
                code = exc.code
            if measured:
                latencies.append((time.perf_counter() - t0) * 1e3)
                codes[code] += 1
                if bar is not None:
                    bar.update(1)
            if code != "OK" and call.broken:
                return  # its stream has ended: nothing more can be sent on it
            backoff = min(max(2 * backoff, BACKOFF_S[0]), BACKOFF_S[1]) if code == "UNAVAILABLE" else 0.0
            if measured and code == "OK":
                rows.append((m.queue_us, m.compute_us, m.batch_size, m.padded_length))
                padded_tokens += m.padded_length * item.sequences
                real_tokens += item.tokens
                sequences += item.sequences

    marker = asyncio.create_task(mark_measuring()) if warmup_s else None
    try:
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    finally:
        if marker is not None:
            marker.cancel()
        if bar is not None:
            bar.close()
    ended = time.perf_counter()
    cpu_end = _cpu_seconds()
    elapsed = max(ended - measure_from, 1e-9)
    cpu = cpu_end - (cpu_at_start[0] if cpu_at_start else cpu_end)
    if rows:
        meta = np.asarray(rows, dtype=np.float64)
    means = meta.mean(axis=0) if len(meta) else np.full(4, math.nan)
    queue_ms, compute_ms = means[0] / 1e3, means[1] / 1e3
    ok = codes.get("OK", 0)
    return BenchReport(
        target=target, model=f"{info.name} v{info.version}, {info.device}, {info.precision}",
        concurrency=concurrency, warmup_s=warmup_s, warmup_requests=warmup_calls, duration_s=elapsed,
        requests=sum(codes.values()), ok=ok, errors={c: n for c, n in codes.items() if c != "OK"},
        sequences=sequences, tokens=real_tokens, requests_per_s=ok / elapsed, sequences_per_s=sequences / elapsed,
        tokens_per_s=real_tokens / elapsed, latency_ms=_percentiles(latencies),
        server={
            "queue_ms": float(queue_ms), "compute_ms": float(compute_ms),
            "queue_share": float(queue_ms / (queue_ms + compute_ms)) if queue_ms + compute_ms > 0 else math.nan,
            "batch_size": float(means[2]), "padded_length": float(means[3]),
            "padding_ratio": padded_tokens / real_tokens if real_tokens else math.nan,
        },
        client_cpu_s=cpu, client_cpu=cpu / elapsed, samples_ms=latencies, **settings,
    )
