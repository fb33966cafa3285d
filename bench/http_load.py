"""Closed-loop load on the HTTP door, the counterpart of client/load.py's `run_load` for gRPC:
`concurrency` callers each keep one POST in flight over keep-alive aiohttp connections; calls started
during `warmup_s` are made but not measured; the run stops after `duration_s` or `max_requests`
measured calls. Bodies are JSON-encoded once, up front, and drawn as `run_load` draws its requests
(the same seed gives the same ids or the same texts in the same order), so that the two doors carry the
same load:
- ids through TEI's POST /embed, `{"inputs": [[ids]]}` (one sequence a call, its pooled vector back);
- texts through OpenAI's POST /v1/embeddings, `{"model": name, "input": [text]}` (one text a call).
A call is OK on status 200 with its body read; any other status counts under its number, a transport
failure under its exception's name. A caller that gets 503 (not ready, draining) or cannot connect waits
before its next call, 50 ms doubling to 1 s, as `run_load` does after UNAVAILABLE. Used by bench/ab.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EMBED = "/embed"  # TEI
EMBEDDINGS = "/v1/embeddings"  # OpenAI
BACKOFF_S = (0.05, 1.0)  # the first wait after a 503 or a refused connection, and the most
MAX_DURATION_S = 600.0


@dataclass(frozen=True)
class HttpReport:
    """What a run measured, named as client/load.py's `BenchReport` names it. Latencies in ms (of measured
    calls, OK or not); rates per second of measured wall time; one sequence per call."""

    concurrency: int
    warmup_requests: int
    requests: int
    ok: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    sequences_per_s: float
    latency_ms: dict[str, float]


def id_bodies(vocab_size: int, max_length: int, lengths: tuple[int, int], count: int, seed: int) -> list[bytes]:
    """`count` TEI /embed bodies of one random id sequence each, drawn as client/load.py's
    `prepare_requests` draws them (lengths uniform in `lengths` clipped to `max_length`, ids below
    `vocab_size`), so a seed gives the gRPC door's sequences."""
    rng = np.random.default_rng(seed)
    low, high = (min(n, max_length) for n in lengths)
    bodies = []
    for _ in range(count):
        ids = rng.integers(0, vocab_size, int(rng.integers(low, high + 1)), dtype=np.int64)
        bodies.append(json.dumps({"inputs": [ids.tolist()]}).encode())
    return bodies


def text_bodies(model: str, texts: Sequence[str], count: int, seed: int) -> list[bytes]:
    """`count` OpenAI /v1/embeddings bodies of one text each, picked from `texts` as client/load.py's
    `prepare_requests` picks them for one text a call."""
    rng = np.random.default_rng(seed)
    return [json.dumps({"model": model, "input": [texts[int(rng.integers(0, len(texts), 1)[0])]]}).encode()
            for _ in range(count)]


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {k: math.nan for k in ("p50", "p90", "p99", "max", "mean")}
    a = np.asarray(samples)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()), "mean": float(a.mean())}


def _check(path: str, status: int, body: bytes) -> None:
    """The door answered one call as its API says: status 200 and one vector."""
    if status != 200:
        raise RuntimeError(f"POST {path}: HTTP {status}: {body[:500]!r}")
    data = json.loads(body)
    vectors = [d["embedding"] for d in data["data"]] if path == EMBEDDINGS else data
    if len(vectors) != 1 or not vectors[0]:
        raise RuntimeError(f"POST {path}: expected one vector, got {body[:500]!r}")


async def run_http_load(base_url: str, path: str, bodies: Sequence[bytes], *, concurrency: int,
                        duration_s: float, warmup_s: float = 0.0, max_requests: int | None = None,
                        timeout: float = 30.0) -> HttpReport:
    """Closed-loop load of POST `base_url + path` with `bodies` (see the module docstring). One call with
    the first body is checked first (RuntimeError when the door does not answer it with one vector)."""
    import aiohttp

    if not 0 < duration_s <= MAX_DURATION_S or not 0 <= warmup_s <= MAX_DURATION_S:
        raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S:g}] and warmup_s in [0, {MAX_DURATION_S:g}]")
    if concurrency < 1 or not bodies:
        raise ValueError("concurrency must be >= 1 and bodies not empty")
    url = base_url + path
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    claimed = 0
    warmup_calls = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(url, data=bodies[0], headers=headers) as r:
            _check(path, r.status, await r.read())

        started = time.perf_counter()
        measure_from = started + warmup_s
        stop_at = measure_from + duration_s

        async def caller(index: int) -> None:
            nonlocal claimed, warmup_calls
            k = index  # caller i sends bodies i, i + c, i + 2c, ...: run_load's order
            backoff = 0.0
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
                body = bodies[k % len(bodies)]
                k += concurrency
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        code = "OK" if r.status == 200 else str(r.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    code = type(exc).__name__
                if measured:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    codes[code] += 1
                retry_later = code == "503" or code.startswith("ClientConnector")
                backoff = min(max(2 * backoff, BACKOFF_S[0]), BACKOFF_S[1]) if retry_later else 0.0

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        elapsed = max(time.perf_counter() - measure_from, 1e-9)
    ok = codes.get("OK", 0)
    return HttpReport(concurrency=concurrency, warmup_requests=warmup_calls, requests=sum(codes.values()), ok=ok,
                      errors={c: n for c, n in codes.items() if c != "OK"}, duration_s=elapsed,
                      requests_per_s=ok / elapsed, sequences_per_s=ok / elapsed, latency_ms=_percentiles(latencies))
