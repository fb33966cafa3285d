"""bench/policy_sim.py: the batch-choice policy under a deterministic model of load (no timing)."""

from __future__ import annotations

from bench.policy_sim import age_weighted, ceiling, simulate, unweighted
from service.batcher import BatchLimits

LIMITS = BatchLimits(max_batch_tokens=2048, max_batch_size=64)


def test_age_weighting_cuts_the_tail_of_mixed_lengths_without_losing_throughput():
    runs = {name: simulate(policy, LIMITS, concurrency=64, lengths=(16, 256), batches=600)
            for name, policy in (("before", unweighted), ("now", age_weighted))}
    before, now = runs["before"], runs["now"]
    assert now["p99_ms"] / now["p50_ms"] < 0.9 * before["p99_ms"] / before["p50_ms"]
    assert now["seq_s"] >= 0.98 * before["seq_s"]
    assert now["padding"] <= 1.15  # still length-aware: padding every batch to 256 would give ~1.9


def test_age_weighting_cuts_the_tail_at_low_concurrency():
    before = simulate(unweighted, LIMITS, concurrency=4, lengths=(16, 256), batches=600)
    now = simulate(age_weighted, LIMITS, concurrency=4, lengths=(16, 256), batches=600)
    assert now["p99_ms"] < 0.5 * before["p99_ms"]  # a long item no longer waits behind every short one


def test_open_loop_load_is_served_and_bounded():
    r = simulate(age_weighted, LIMITS, rate=60, lengths=(16, 256), batches=600)
    assert 50 <= r["seq_s"] <= 70  # below capacity: throughput is the arrival rate
    assert r["p99_ms"] < 500


def test_the_ceiling_beats_any_policy():
    roof = ceiling((16, 256), LIMITS.max_batch_size)
    r = simulate(age_weighted, LIMITS, concurrency=128, lengths=(16, 256), batches=600)
    assert r["seq_s"] <= roof
