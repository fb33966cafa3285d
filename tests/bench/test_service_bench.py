"""bench/service_bench.py: the concurrency-1 bar is measured over the load's lengths without bias; the table sets
the service against its ceiling and against the naive server of the same round."""

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.service_bench import FIXED, MIXED, InProcess, markdown, process_cpu_s, strata
from model.default import ensure_default_bundle


def test_a_process_cpu_is_read_by_pid_to_the_nanosecond() -> None:
    # This process's CPU-time clock read by pid, between two readings of its own: the same clock, so it falls
    # between them; /proc's stat, whole 10 ms ticks behind, would fall below the first (how bench/late_bench.py's
    # few tiny calls came out as 0 ms of server CPU).
    for _ in range(20):
        before = time.process_time()
        by_pid = process_cpu_s(os.getpid())
        after = time.process_time()
        assert before <= by_pid <= after
        sum(i * i for i in range(20_000))  # some CPU between the rounds


def test_strata_of_the_mixed_lengths_have_their_mean_and_median() -> None:
    rng = np.random.default_rng(0)
    lengths = sorted(int(n) for n in rng.integers(MIXED[0], MIXED[1] + 1, 256))
    sample = strata(lengths, 16)
    assert abs(np.mean(sample) - np.mean(lengths)) < 2
    assert abs(np.median(sample) - np.median(lengths)) < 8  # one stratum is 16 values, about 15 tokens
    every_16th = lengths[:: len(lengths) // 16]  # the sample the bar used to take: half a stride low
    assert np.mean(lengths) - np.mean(every_16th) > 5


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=300).map(sorted), st.data())
def test_strata_takes_one_value_from_the_middle_of_each_equal_stratum(values: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(values)))
    sample = strata(values, k)
    assert len(sample) == k and sample == sorted(sample)
    step = len(values) / k
    for i, value in enumerate(sample):
        assert value in values[int(i * step): int((i + 1) * step) + 1]
    assert strata(values, len(values)) == values


@pytest.mark.parametrize("k", [0, 4])
def test_strata_refuses_a_count_it_cannot_take(k: int) -> None:
    with pytest.raises(ValueError):
        strata([1, 2, 3], k)


def _recorded(ceiling: InProcess) -> list[list[int]]:
    """The batches `ceiling` runs from now on, in order (its real forward, recorded)."""
    forward, batches = ceiling.forward, []

    def recording(lengths: list[int]) -> None:
        batches.append(lengths)
        forward(lengths)

    ceiling.forward = recording  # type: ignore[method-assign]
    return batches


def test_the_concurrency_1_bar_times_single_forwards_at_the_strata_of_the_lengths(tmp_path: Path) -> None:
    ceiling = InProcess(ensure_default_bundle(tmp_path), "fp32", max_batch_size=2, threads=1, workers=1)
    batches = _recorded(ceiling)
    try:
        fixed = ceiling.measure(FIXED, 1)
        fixed_batches, batches[:] = list(batches), []
        mixed = ceiling.measure(MIXED, 1)
    finally:
        ceiling.close()
    assert 0 < fixed < 10_000 and 0 < mixed < 10_000  # milliseconds
    assert fixed_batches == [[FIXED[0]]] * (1 + 3 * 8)  # a warm-up, then 3 rounds of 8
    want = strata(ceiling._mixed, 16)
    assert batches == [[want[8]]] + [[n] for n in want] * 3


def test_a_throughput_bar_measures_the_cpu_a_sequence_cost_and_a_latency_bar_none(tmp_path: Path) -> None:
    ceiling = InProcess(ensure_default_bundle(tmp_path), "fp32", max_batch_size=2, threads=1, workers=1)
    ceiling.best_batch = 2
    batches = _recorded(ceiling)
    try:
        seq_s, cpu_ms = ceiling.measure(FIXED, 64), ceiling.cpu_ms_per_seq
        ceiling.measure(FIXED, 1)
    finally:
        ceiling.close()
    assert batches[:12] == [[FIXED[0]] * 2] * 2 * 6 and seq_s > 0  # a warm-up and 5 timed runs of 2 batches of 2
    assert 0 < cpu_ms < math.inf  # this process's CPU over those 24 sequences, a share of it each
    assert math.isnan(ceiling.cpu_ms_per_seq)  # the latency bar after it has none


def _run(arm: str, concurrency: int, round_: int, seq_s: float, p50: float, bar: float) -> dict[str, Any]:
    """A row as service_bench.main records it, with the numbers the summary reads."""
    return {"arm": arm, "precision": "fp32", "batching": arm == "service", "lengths": list(FIXED), "round": round_,
            "concurrency": concurrency, "bar": [bar, bar], "ceiling_seq_s": bar, "ratio": seq_s / bar,
            "batch1_ms": bar, "bar_cpu_ms_per_seq": 2e3 / bar, "sequences_per_s": seq_s, "tokens_per_s": 128 * seq_s,
            "errors": {}, "client_cpu": 0.5, "latency_ms": {"p50": p50, "p90": p50, "p99": 2 * p50},
            "server": {"queue_ms": 0.0, "compute_ms": 1.0, "batch_size": 1.0, "padding_ratio": 1.0}}


def test_the_table_sets_the_service_against_the_naive_server_of_the_same_round() -> None:
    # c64: service / naive per round 1.25, 1.50, 1.20 (median 1.25; each service run set against the next
    # round's naive run, it would be 1.50). Service / ceiling 0.80, 0.90, 0.80. c1: p50 8 ms against 10 ms and
    # a 5 ms forward. The service's runs at c64 say where the CPU went: the model threads 1.5-1.7 cores.
    results = []
    for round_, (service, naive, bar) in enumerate([(100, 80, 125), (90, 60, 100), (120, 100, 150)]):
        cpu = {"model": 1.5 + 0.1 * round_, "loop": 0.2, "other": 0.05}
        results += [{**_run("service", 64, round_, service, 50, bar), "server_cpu": cpu},
                    _run("naive", 64, round_, naive, 60, bar)]
    results += [_run("naive", 1, 0, 100, 10.0, 5.0), _run("service", 1, 0, 125, 8.0, 5.0)]
    served = [{"precision": "fp32", "batching": True, "model_workers": 1, "workers_reason": "measured at warm-up ...",
               "max_batch_tokens": 512, "batch_reason": "configured"}]
    meta = {"date": "d", "machine": "m", "torch": "t", "threads": 2, "workers": 2, "calls": "unary Encode",
            "command": "c", "load_start": (1.0, 2.0, 3.0), "load_end": None, "served": served}
    table = markdown(meta, [], results)
    assert ("the service as it chose at warm-up: fp32 batching on: 1 model workers (measured), max_batch_tokens 512 "
            "(configured); the ceiling tried 1 and 2 workers;") in table.splitlines()[0]
    rows = {line.split(" | ")[2]: line for line in table.splitlines() if line.startswith("| fp32 | 128 | ")}
    assert rows["64"] == ("| fp32 | 128 | 64 | 100.0 (100.0, 90.0, 120.0) | 80.0 (80.0, 60.0, 100.0) | "
                          "125.0 (125.0, 100.0, 150.0) | 0.80 (0.80, 0.90, 0.80) | 1.25 (1.25, 1.50, 1.20) |")
    assert rows["1"] == "| fp32 | 128 | 1 | 8.0 ms | 10.0 ms | 5.0 ms | 1.60 | 0.80 |"
    assert "load average start 1.00 2.00 3.00;" in table
    assert sum(line.startswith("| naive | fp32 | off | 128 |") for line in table.splitlines()) == 4
    targets = table.split("Targets (issue 32)")[1]
    assert "fp32 fixed c64: throughput 0.80 (0.80, 0.90, 0.80) of the ceiling (target >= 0.95)" in targets
    assert ("CPU s/s (medians): the model threads 1.60, the event loop 0.20, the rest of the server 0.05, the load "
            "generator 0.50") in targets
    # The server's CPU a sequence (1.75-1.95 cores over 100, 90, 120 seq/s) against the bars' (2 cores over 125, 100,
    # 150): a ratio per round, then the median.
    assert ("CPU a sequence, the whole server against the forward in process (measured beside each run): 17.50 "
            "(17.50, 20.56, 16.25) ms against 16.00 (16.00, 20.00, 13.33) ms, 1.09 (1.09, 1.03, 1.22)x (issue 42's "
            "target <= 1.10)") in targets
    assert sum(line.endswith("| 0.50 | 1.70 / 0.20 / 0.05 |") for line in table.splitlines()) == 1  # round 2's
    assert sum(line.startswith("| naive | fp32 | off | 128 | 64 |") and line.endswith("| 0.50 | - |")
               for line in table.splitlines()) == 3
    assert ("fp32 fixed c1: p50 minus in-process batch-1 latency +3.00 ms (target <= +1.0 ms); server-side compute "
            "1.00 ms, in-process batch-1 5.00 ms; p50 over the naive server's 0.80") in targets


def test_without_the_naive_server_its_column_is_empty() -> None:
    meta = {"date": "d", "machine": "m", "torch": "t", "threads": 2, "workers": 2, "calls": "unary Encode",
            "command": "c"}
    table = markdown(meta, [], [_run("service", 16, 0, 100, 50, 125)])
    assert "| fp32 | 128 | 16 | 100.0 | - | 125.0 | 0.80 | - |" in table
    assert "load average unknown" in table
