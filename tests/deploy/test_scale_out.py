"""Scale-out, run for real on loopback: three `python -m service` replicas behind the pinned Envoy
(deploy/envoy/envoy.yaml with fast health checks, tests/support/envoy_harness.py), under closed-loop load from
the client library, unary and streaming (issue 19; docs/scale-out.md).

- calls spread over the replicas; a replica set NOT_SERVING leaves the rotation and comes back;
- SIGTERM one replica mid-load: no failed call, and its drain ledger balances;
- SIGKILL one mid-load: no failed unary call (Envoy retries elsewhere), every stream recovers (the
  client reopens it) with every request answered exactly once;
- a rolling restart of all three: no failed call;
- every answer equals a single call on a fresh server (fp32, atol 1e-5);
- a real Prometheus scraping the three computes one p99 across them, and the summed request counts equal
  what the load generator sent.
The replicas are one module-scoped fleet; each test leaves three SERVING replicas behind. Every load is
bounded in calls and in time; nothing waits on a sleep to decide an outcome.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import EncoderClient
from client.errors import ClientError
from client.messages import EncodeResult, StreamRequest
from proto.attention.v1.codec import SERVICE_NAME
from tests.support.envoy_harness import Envoy, drain_floor_s, envoy_server, find_envoy, load_config, loopback_config
from tests.support.prometheus_server import prometheus_server
from tests.support.replica import READINESS_SWITCH
from tests.support.server_process import ServerProcess

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_envoy() is None, reason="envoy-server is not installed (requirements-dev.txt)")]

REPLICAS = 3
DRAIN_DELAY_S = 2.0  # > the fast config's drain floor (0.7 s): see test_the_drain_rule_holds_here
DRAIN_GRACE_S = 3.0
RNG = np.random.default_rng(19)
INPUTS = [RNG.integers(1, 100, size=n) for n in (3, 5, 8, 11, 16, 23, 31, 40)]
Answers = dict[str, list[EncodeResult | ClientError]]


def start_replica(bundle: Path, directory: Path, port: int = 0, metrics_port: int = 0) -> ServerProcess:
    """A replica with the SIGUSR1/2 readiness switch (tests/support/replica.py), SERVING when this returns."""
    return ServerProcess(bundle, "--port", str(port), "--metrics-port", str(metrics_port),
                         "--drain-delay-s", str(DRAIN_DELAY_S), "--drain-grace-s", str(DRAIN_GRACE_S),
                         "--log-level", "info", directory=directory, timeout=90, prelude=READINESS_SWITCH)


@dataclass
class Fleet:
    bundle: Path
    workdir: Path
    replicas: list[ServerProcess]
    envoy: Envoy
    references: list[np.ndarray] = field(default_factory=list)
    generation: int = 0

    def port(self, i: int) -> int:
        return self.replicas[i].ports["port"]

    def restart(self, i: int) -> None:
        """Start replica i again on the same ports (the static cluster names them), once it has exited."""
        old = self.replicas[i]
        assert old.proc.poll() is not None, "restart() needs the old process gone"
        self.generation += 1
        self.replicas[i] = start_replica(self.bundle, self.workdir / f"replica{i}-{self.generation}",
                                         old.ports["port"], old.ports["metrics_port"])

    def wait_in_rotation(self, ports: set[int]) -> None:
        self.envoy.wait(lambda: self.envoy.healthy() == ports, f"Envoy to route to exactly {sorted(ports)}")

    def heal(self) -> None:
        """Three SERVING replicas in rotation again: exited ones restarted, live ones switched back to
        SERVING (SIGUSR2 of the readiness switch; a no-op for one that is SERVING)."""
        for i, replica in enumerate(self.replicas):
            if replica.proc.poll() is not None:
                self.restart(i)
            else:
                replica.proc.send_signal(signal.SIGUSR2)
        self.wait_in_rotation(self.all_ports())

    def all_ports(self) -> set[int]:
        return {self.port(i) for i in range(REPLICAS)}

    def ok_calls(self, i: int) -> float:
        return self.replicas[i].sample("attention_requests_total", {"method": "Encode", "code": "OK"})


@pytest.fixture(scope="module")
def module_fleet(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("scale-out")
    replicas: list[ServerProcess] = []
    try:
        for i in range(REPLICAS):
            replicas.append(start_replica(tiny_bundle, workdir / f"replica{i}-0"))
        config = loopback_config(load_config(), [r.ports["port"] for r in replicas], fast=True)
        with envoy_server(config, workdir / "envoy") as envoy:
            fleet = Fleet(tiny_bundle, workdir, replicas, envoy)
            fleet.wait_in_rotation(fleet.all_ports())
            fleet.references = asyncio.run(reference_answers(replicas[0].target))
            yield fleet
    finally:
        for replica in replicas:
            replica.kill()


@pytest.fixture
def fleet(module_fleet: Fleet) -> Iterator[Fleet]:
    """The shared fleet, handed back whole after each test, pass or fail: a test that failed between
    stopping a replica and restarting it must not fail the next tests with a refused connection."""
    yield module_fleet
    module_fleet.heal()


async def reference_answers(target: str) -> list[np.ndarray]:
    """One call per input on a fresh replica, before any load: the answers everything must equal."""
    async with EncoderClient(target, timeout=30) as client:
        return [(await client.encode([ids])).hidden[0] for ids in INPUTS]


@dataclass
class Load:
    """Closed-loop load through Envoy: `unary` callers, each one call at a time, and `streams` streams,
    each with at most `window` requests unanswered. Runs until `stop` is set (when the test's `during`
    ends) or `max_calls` (per caller) / `max_requests` (per stream) are done. The caps are a safety bound,
    far above what any `during` waits for: a load that ran out while a replica drained (400 per caller
    did, on a quiet machine at about 1,000 answers/s) would leave `until_answered` waiting for nothing."""

    target: str
    unary: int = 4
    streams: int = 6
    window: int = 2
    max_calls: int = 5000
    max_requests: int = 5000
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    results: list[tuple[int, EncodeResult | ClientError]] = field(default_factory=list)
    stream_answers: list[Answers] = field(default_factory=list)
    stream_sent: list[dict[str, int]] = field(default_factory=list)
    stream_errors: list[BaseException] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return len(self.results) + sum(len(a) for a in self.stream_answers)

    async def _caller(self, client: EncoderClient, seed: int) -> None:
        for n in range(self.max_calls):
            if self.stop.is_set():
                return
            index = (seed + n) % len(INPUTS)
            try:
                self.results.append((index, await client.encode([INPUTS[index]])))
            except ClientError as exc:
                self.results.append((index, exc))

    async def _stream(self, client: EncoderClient, k: int) -> None:
        answers: Answers = {}
        sent: dict[str, int] = {}
        self.stream_answers.append(answers)
        self.stream_sent.append(sent)
        room = asyncio.Semaphore(self.window)

        async def requests() -> Any:
            for n in range(self.max_requests):
                await room.acquire()
                if self.stop.is_set():
                    return
                index = (k + n) % len(INPUTS)
                sent[f"s{k}-{n}"] = index
                yield StreamRequest([INPUTS[index]], request_id=f"s{k}-{n}")

        try:
            async for item in client.encode_stream(requests(), timeout=120):
                answers.setdefault(item.request_id, []).append(item)
                room.release()
        except BaseException as exc:  # recorded, asserted by the test
            self.stream_errors.append(exc)

    async def run(self, during: Callable[[Load], Any]) -> None:
        async with EncoderClient(self.target, timeout=30) as client:
            tasks = [asyncio.create_task(self._caller(client, i)) for i in range(self.unary)]
            tasks += [asyncio.create_task(self._stream(client, k)) for k in range(self.streams)]
            try:
                await asyncio.wait_for(during(self), timeout=120)
            finally:
                self.stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    async def until_answered(self, more: int, timeout: float = 60) -> None:
        """Wait until `more` further answers have arrived (bounded)."""
        target, end = self.answered + more, time.monotonic() + timeout
        while self.answered < target:
            assert time.monotonic() < end, f"load stalled at {self.answered} answers (want {target})"
            await asyncio.sleep(0.02)


def assert_no_failure_and_every_answer_right(load: Load, references: list[np.ndarray]) -> None:
    failed = [(i, r) for i, r in load.results if not isinstance(r, EncodeResult)]
    assert not failed, f"{len(failed)} of {len(load.results)} unary calls failed: {failed[:3]}"
    assert not load.stream_errors, f"streams failed: {load.stream_errors[:3]}"
    for sent, answers in zip(load.stream_sent, load.stream_answers, strict=True):
        assert answers.keys() == sent.keys(), f"unanswered: {sorted(sent.keys() - answers.keys())[:5]}"
        twice = {rid: len(a) for rid, a in answers.items() if len(a) != 1}
        assert not twice, f"answered more than once: {twice}"
        for rid, (answer,) in answers.items():
            assert isinstance(answer, EncodeResult), f"{rid}: {answer!r}"
            np.testing.assert_allclose(answer.hidden[0], references[sent[rid]], atol=1e-5, rtol=0)
    for index, result in load.results:
        assert isinstance(result, EncodeResult)
        np.testing.assert_allclose(result.hidden[0], references[index], atol=1e-5, rtol=0)


def assert_ledger_balanced(replica: ServerProcess) -> dict[str, Any]:
    """The drained replica's exit ledger: every started call handled, the queue empty, no UNKNOWN."""
    book = replica.exit_ledger()
    assert sum(book["handled"].values()) == book["started"], book
    assert book["queue_depth"] == 0 and "UNKNOWN" not in book["handled"], book
    assert "Traceback" not in replica.output()
    return book


def streams_open(replica: ServerProcess) -> float:
    labels = {"grpc_service": SERVICE_NAME, "grpc_method": "EncodeStream"}
    return replica.sample("grpc_server_started_total", labels) - replica.sample("grpc_server_handled_total", labels)


# --- the tests -----------------------------------------------------------------------------------------


def test_the_drain_rule_holds_here() -> None:
    """ATTN_DRAIN_DELAY_S exceeds the time Envoy may still route to a replica that turned NOT_SERVING,
    in this test's fast config as in the shipped one (tests/deploy/test_deploy.py checks the shipped side)."""
    fast = loopback_config(load_config(), [1], fast=True)
    assert DRAIN_DELAY_S > drain_floor_s(fast), (DRAIN_DELAY_S, drain_floor_s(fast))


async def test_calls_spread_over_the_replicas(fleet: Fleet) -> None:
    before = [fleet.ok_calls(i) for i in range(REPLICAS)]
    load = Load(fleet.envoy.target, max_calls=40, max_requests=10)

    async def during(load: Load) -> None:
        while not load.stop.is_set() and load.answered < 4 * 40 + 6 * 10:
            await asyncio.sleep(0.05)

    await load.run(during)
    assert_no_failure_and_every_answer_right(load, fleet.references)
    assert len(load.results) == 160 and sum(len(a) for a in load.stream_answers) == 60
    spread = [fleet.ok_calls(i) - before[i] for i in range(REPLICAS)]
    assert sum(spread) == 160 and all(n > 0 for n in spread), spread
    streams = [fleet.replicas[i].sample("grpc_server_started_total", {"grpc_method": "EncodeStream"})
               for i in range(REPLICAS)]
    assert sum(1 for n in streams if n > 0) >= 2, f"six streams all on one replica: {streams}"


async def calls_until(client: EncoderClient, predicate: Callable[[], bool], bound: int = 600) -> int:
    for n in range(bound):
        if predicate():
            return n
        await client.encode([INPUTS[0]])
    raise AssertionError(f"not so after {bound} calls")


async def test_a_not_serving_replica_leaves_rotation_and_comes_back(fleet: Fleet) -> None:
    victim = fleet.replicas[1]
    others = fleet.all_ports() - {fleet.port(1)}
    victim.proc.send_signal(signal.SIGUSR1)  # readiness NOT_SERVING; the process serves on
    fleet.wait_in_rotation(others)
    async with EncoderClient(fleet.envoy.target, timeout=30) as client:
        # Envoy's workers act on the verdict up to about one health-check interval after the admin page
        # shows it: go on until 30 calls in a row miss the victim, then no call may reach it.
        streak, seen = 0, fleet.ok_calls(1)

        def missed_30() -> bool:
            nonlocal streak, seen
            now = fleet.ok_calls(1)
            streak, seen = (0, now) if now != seen else (streak + 1, seen)
            return streak >= 30

        await calls_until(client, missed_30)
        before = fleet.ok_calls(1)
        results = await asyncio.gather(*(client.encode([INPUTS[i % len(INPUTS)]]) for i in range(60)))
        assert fleet.ok_calls(1) == before, "a NOT_SERVING replica still got calls"
        for i, result in enumerate(results):
            np.testing.assert_allclose(result.hidden[0], fleet.references[i % len(INPUTS)], atol=1e-5, rtol=0)

        victim.proc.send_signal(signal.SIGUSR2)  # SERVING again
        fleet.wait_in_rotation(fleet.all_ports())
        await calls_until(client, lambda: fleet.ok_calls(1) > before)


async def test_sigterm_mid_load_loses_no_call(fleet: Fleet) -> None:
    victim = fleet.replicas[0]
    exit_code: list[int] = []

    async def during(load: Load) -> None:
        await load.until_answered(60)
        exit_code.append(await asyncio.to_thread(victim.terminate, 30.0))
        await load.until_answered(100)

    load = Load(fleet.envoy.target)
    await load.run(during)
    assert exit_code == [0], victim.output()[-3000:]
    assert_no_failure_and_every_answer_right(load, fleet.references)
    book = assert_ledger_balanced(victim)
    assert book["started"] > 0, book
    # The drain rule at work: Envoy stopped routing to the replica before it began refusing calls, so
    # none was refused (a refused stream request is answered in the stream, not by the call's status).
    assert book["handled"].get("UNAVAILABLE", 0) == 0, book
    fleet.restart(0)
    fleet.wait_in_rotation(fleet.all_ports())


async def test_sigkill_mid_load_fails_no_unary_call_and_every_stream_recovers(fleet: Fleet) -> None:
    killed: list[int] = []

    async def during(load: Load) -> None:
        await load.until_answered(60)
        # The replica holding the most open streams dies, so that streams are lost and must recover.
        victim = max(range(REPLICAS), key=lambda i: streams_open(fleet.replicas[i]))
        assert streams_open(fleet.replicas[victim]) > 0
        fleet.replicas[victim].proc.send_signal(signal.SIGKILL)
        fleet.replicas[victim].proc.wait(timeout=30)
        killed.append(victim)
        await load.until_answered(120)

    load = Load(fleet.envoy.target)
    await load.run(during)
    assert_no_failure_and_every_answer_right(load, fleet.references)
    (victim,) = killed
    assert fleet.replicas[victim].proc.returncode == -signal.SIGKILL
    fleet.restart(victim)
    fleet.wait_in_rotation(fleet.all_ports())


# Three replica start-ups in a row (each a fresh Python importing torch, then a warm-up): about 30 s on
# an idle 2-core machine, several times that on a loaded one.
@pytest.mark.timeout(400)
async def test_rolling_restart_loses_no_call(fleet: Fleet) -> None:
    codes: list[int] = []

    async def during(load: Load) -> None:
        for i in range(REPLICAS):
            await load.until_answered(30)
            codes.append(await asyncio.to_thread(fleet.replicas[i].terminate, 30.0))
            assert_ledger_balanced(fleet.replicas[i])
            await asyncio.to_thread(fleet.restart, i)
            await asyncio.to_thread(fleet.wait_in_rotation, fleet.all_ports())
        await load.until_answered(30)

    # Lighter load than the other tests: three replica start-ups (Python, torch, warm-up) share the CPU.
    load = Load(fleet.envoy.target, unary=3, streams=3)
    await load.run(during)
    assert codes == [0] * REPLICAS
    assert_no_failure_and_every_answer_right(load, fleet.references)


def merged_quantile(q: float, buckets: dict[float, float]) -> float:
    """histogram_quantile over cumulative bucket counts {le: count}, as Prometheus computes it."""
    bounds = sorted(buckets)
    total = buckets[math.inf]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == math.inf:
                return lower
            return lower + (le - lower) * (rank - below) / (buckets[le] - below)
        lower, below = le, buckets[le]
    raise AssertionError("no +Inf bucket")


async def test_prometheus_sums_the_replicas(fleet: Fleet) -> None:
    """One p99 across the replicas from their histograms, and the summed counts equal the calls sent."""
    targets = [f"127.0.0.1:{r.ports['metrics_port']}" for r in fleet.replicas]
    encode_ok = 'sum(attention_requests_total{method="Encode", code="OK"})'
    with prometheus_server(targets) as prom:
        prom.wait_for('up{job="attention"} == 1', lambda r: len(r) == REPLICAS, timeout=30)
        before = sum(fleet.ok_calls(i) for i in range(REPLICAS))
        prom.wait_for(encode_ok, lambda r: len(r) == 1 and r[0].value == before, timeout=30)

        sent = 120
        async with EncoderClient(fleet.envoy.target, timeout=30) as client:
            for _ in range(sent // 8):
                await asyncio.gather(*(client.encode([INPUTS[i]]) for i in range(8)))
        total = prom.wait_for(encode_ok, lambda r: len(r) == 1 and r[0].value == before + sent, timeout=30)
        assert total[0].value - before == sent
        per_instance = prom.query('sum by (instance) (attention_requests_total{method="Encode", code="OK"})')
        assert len(per_instance) == REPLICAS

        p99 = prom.query('histogram_quantile(0.99, sum by (le) '
                         '(rate(attention_request_duration_seconds_bucket{method="Encode"}[1m])))')
        assert len(p99) == 1 and math.isfinite(p99[0].value) and p99[0].value > 0, p99
        # The same aggregation over the totals equals the quantile of the three replicas' merged buckets.
        buckets: dict[float, float] = {}
        for replica in fleet.replicas:
            for le, count in replica_buckets(replica).items():
                buckets[le] = buckets.get(le, 0.0) + count
        expected = merged_quantile(0.99, buckets)
        # Polled: a replica counts a call, then observes its duration, so a scrape between the two (the counter
        # already at before + sent) holds the histogram a call short; the next scrape has it (no calls come now).
        merged = prom.wait_for('histogram_quantile(0.99, sum by (le) '
                               '(attention_request_duration_seconds_bucket{method="Encode"}))',
                               lambda r: len(r) == 1 and r[0].value == pytest.approx(expected, rel=1e-9), timeout=30)
        assert merged[0].value == pytest.approx(expected, rel=1e-9)


def replica_buckets(replica: ServerProcess) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for (name, labels), value in replica.scrape().items():
        label = dict(labels)
        if name == "attention_request_duration_seconds_bucket" and label.get("method") == "Encode":
            le = float(label["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    return buckets
