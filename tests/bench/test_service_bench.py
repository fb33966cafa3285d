"""bench/service_bench.py: the concurrency-1 bar is measured over the load's lengths without bias."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.service_bench import FIXED, MIXED, InProcess, strata
from model.default import ensure_default_bundle


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


def test_the_concurrency_1_bar_times_single_forwards_at_the_strata_of_the_lengths(tmp_path: Path) -> None:
    ceiling = InProcess(ensure_default_bundle(tmp_path), "fp32", max_batch_size=2, threads=1, workers=1)
    forward, batches = ceiling.forward, []

    def recording(lengths: list[int]) -> None:
        batches.append(lengths)
        forward(lengths)

    ceiling.forward = recording  # type: ignore[method-assign]  # the real forward, recorded
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
