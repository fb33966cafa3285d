"""bench/packing_bench.py stays runnable, and its two variants differ in exactly the packing."""

import math

import pytest
import torch

from bench import packing_bench
from tests.model_helpers import tiny


def _linear_rows(module: torch.jit.ScriptModule, ids: torch.Tensor, lengths: torch.Tensor) -> set[int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.inference_mode():
            module(ids, None, lengths, False, [])
    return {math.prod(e.input_shapes[0][:-1]) for e in prof.events() if e.name == "aten::linear"}


def test_the_variants_are_packed_and_unpacked_and_agree() -> None:
    config = tiny()
    packed, unpacked = packing_bench.scripted(config, True), packing_bench.scripted(config, False)
    ((ids, lengths),) = packing_bench.batches(config, 7, 1, seed=3)  # arrival order: padded
    assert _linear_rows(packed, ids, lengths) == {int(lengths.sum())}
    assert _linear_rows(unpacked, ids, lengths) == {ids.numel()}
    with torch.inference_mode():
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
