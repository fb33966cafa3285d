"""bench/ab.py end to end on the tiny model: two real servers, one differing by a flag and a prelude."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server_process import PINNED

REPO = Path(__file__).resolve().parents[2]


def pinned(*, precision: bool = True) -> list[str]:
    """bench.ab starts its servers unpinned (the real defaults); these flags pin both sides as the tests' own
    servers are (tests/support/server_process.py PINNED), so no start spends seconds measuring at warm-up.
    `precision=False` leaves the precision to the test's own side flags."""
    pairs = [PINNED[i:i + 2] for i in range(0, len(PINNED), 2)]  # (flag, value)
    flags = [part for pair in pairs if precision or pair[0] != "--precision" for part in pair]
    return [f"--{side}-flag={flag}" for side in ("a", "b") for flag in flags]


@pytest.mark.slow
def test_ab_runs_both_variants_in_alternating_rounds(tiny_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--model", str(tiny_bundle), "--lengths", "8", "16", "--concurrency", "4",
         "--rounds", "2", "--seconds", "0.5", "--b-flag=--max-batch-size=1",
         "--b-prelude", "import service.batching.choice as w; w.AGE_POWER = 0", *pinned()],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for side in ("A", "B"):
        line = re.search(rf"^{side}: seq/s ([\d.]+) ([\d.]+); median ([\d.]+),.*"
                         r"server CPU ms/call ([\d.]+), event loop ([\d.]+)$", proc.stdout, re.M)
        assert line is not None, proc.stdout
        *rates, cpu, loop = (float(x) for x in line.groups())
        assert all(x > 0 for x in rates)
        assert 0 < cpu < 1000 and 0 <= loop <= cpu  # the loop is one of the server's threads
    assert re.search(r"^B/A seq/s per round: [\d.]+ [\d.]+; median [\d.]+$", proc.stdout, re.M), proc.stdout


@pytest.mark.slow
def test_ab_text_mode_reports_texts_per_s_precisions_and_the_cosine_between_the_sides(tiny_text_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--model", str(tiny_text_bundle), "--text", "short",
         "--concurrency", "2", "4", "--rounds", "2", "--seconds", "0.5", "--keep-servers", "--a-flag=--precision=fp32",
         "--b-flag=--precision=bf16", *pinned(precision=False)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"^A precision fp32 \(1 of 1 starts\): configured", out, re.M), out
    assert re.search(r"^B precision bf16 \(1 of 1 starts\): configured", out, re.M), out
    # a group per concurrency, in order, each with both sides' rates per round and their ratio
    groups = re.split(r"^concurrency (\d+):$", out, flags=re.M)
    assert groups[1::2] == ["2", "4"], out
    for group in groups[2::2]:
        for side in ("A", "B"):
            line = re.search(rf"^{side}: texts/s ([\d.]+) ([\d.]+); median ([\d.]+),", group, re.M)
            assert line is not None and all(float(x) > 0 for x in line.groups()), out
        assert re.search(r"^B/A texts/s per round: [\d.]+ [\d.]+; median [\d.]+$", group, re.M), out
    cos = re.search(r"^pooled cosine B vs A on 64 texts x 2 rounds: min ([-\d.]+), median ([-\d.]+)$", out, re.M)
    assert cos is not None, out
    low, mid = (float(x) for x in cos.groups())
    # bf16 against fp32: close (the same model), not identical (a different precision really ran)
    assert 0.99 < low <= mid < 1.0, out
