"""bench/packing_bench.py stays runnable, and its two variants differ in exactly the packing."""

import pytest
import torch

from bench import packing_bench
from tests.support.model_helpers import linear_rows, tiny


def test_the_variants_are_packed_and_unpacked_and_agree() -> None:
    config = tiny()
    packed, unpacked = packing_bench.scripted(config, True), packing_bench.scripted(config, False)
    ((ids, lengths),) = packing_bench.batches(config, 7, 1, seed=3)  # arrival order: padded
    with torch.inference_mode():
        assert set(linear_rows(lambda: packed(ids, None, lengths, False, []))) == {int(lengths.sum())}
        assert set(linear_rows(lambda: unpacked(ids, None, lengths, False, []))) == {ids.numel()}
        a, _ = packed(ids, None, lengths, False, [])
        b, _ = unpacked(ids, None, lengths, False, [])
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(a[row, :n], b[row, :n], atol=1e-5, rtol=0)


def test_a_bounded_run_prints_a_row_per_thread_count_and_pool(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rounds", "2", "--batches", "2", "--threads", "1", "--pools", "7", "50"]
    assert packing_bench.main(argv, config=tiny()) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [int(r[2]) for r in rows] == [7, 50]
    assert all(float(r[3]) >= 1.0 and float(r[4]) > 0 for r in rows)  # padding, speed ratio
