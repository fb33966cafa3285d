"""bench/policy_sim.py: the batch-choice policy under a deterministic model of load (no timing)."""

from __future__ import annotations

import pytest

from bench.policy_sim import age_weighted, ceiling, cost_ms, simulate, unweighted
from service.batching import BatchLimits

LIMITS = BatchLimits(max_batch_tokens=1024, max_batch_size=64)  # the CPU default budget


def test_age_weighting_cuts_the_tail_of_mixed_lengths_without_losing_throughput():
    runs = {name: simulate(policy, LIMITS, concurrency=64, lengths=(16, 256), batches=600)
            for name, policy in (("before", unweighted), ("now", age_weighted))}
    before, now = runs["before"], runs["now"]
    assert now["p99_ms"] / now["p50_ms"] < 0.95 * before["p99_ms"] / before["p50_ms"]
    assert now["seq_s"] >= 0.98 * before["seq_s"]
    assert now["padding"] <= 1.15  # still length-aware: padding every batch to its longest in arrival order gives ~1.7


def test_age_weighting_cuts_the_tail_at_low_concurrency():
    before = simulate(unweighted, LIMITS, concurrency=4, lengths=(16, 256), batches=600)
    now = simulate(age_weighted, LIMITS, concurrency=4, lengths=(16, 256), batches=600)
    assert now["p99_ms"] < 0.6 * before["p99_ms"]  # a long item no longer waits behind every short one


def test_open_loop_load_is_served_and_bounded():
    r = simulate(age_weighted, LIMITS, rate=60, lengths=(16, 256), batches=600)
    assert 50 <= r["seq_s"] <= 70  # below capacity: throughput is the arrival rate
    assert r["p99_ms"] < 500


def test_the_ceiling_beats_any_policy():
    roof = ceiling((16, 256), LIMITS.max_batch_size)
    r = simulate(age_weighted, LIMITS, concurrency=128, lengths=(16, 256), batches=600)
    assert r["seq_s"] <= roof


def test_one_caller_runs_wide_and_a_backlog_runs_narrow_on_both_workers():
    # The batcher's rules: a lone batch runs wide on the lead; under a backlog two narrow batches run side by side.
    alone = simulate(age_weighted, LIMITS, concurrency=1, lengths=(128, 128), batches=100)
    assert alone["seq_s"] == pytest.approx(1e3 / cost_ms([128]))
    backlog = simulate(age_weighted, LIMITS, concurrency=64, lengths=(128, 128), batches=200)
    assert backlog["seq_s"] == pytest.approx(2 * 8 * 1e3 / cost_ms([128] * 8, wide=False), rel=0.01)
    one = simulate(age_weighted, LIMITS, concurrency=64, lengths=(128, 128), batches=200, workers=1)
    assert one["seq_s"] == pytest.approx(8 * 1e3 / cost_ms([128] * 8), rel=0.01)


def test_packing_makes_padding_cheap():
    padded = [16, 128, 128, 256]  # padding 2.4x the real tokens: packed
    assert cost_ms(padded) < cost_ms([256] * 4) - 0.5 * (cost_ms([256] * 4) - cost_ms([128] * 4))
    assert cost_ms([250, 256]) > cost_ms([256]) + 0.9 * (cost_ms([256] * 2) - cost_ms([256]))  # 1% padding: not packed
