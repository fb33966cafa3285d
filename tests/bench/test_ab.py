"""bench/ab.py end to end on the tiny model: two real servers, one differing by a flag and a prelude."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ab_runs_both_variants_in_alternating_rounds(tiny_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--model", str(tiny_bundle), "--lengths", "8", "16", "--concurrency", "4",
         "--rounds", "2", "--seconds", "0.5", "--b-flag=--max-batch-size=1",
         "--b-prelude", "import service.batching.choice as w; w.AGE_POWER = 0"],
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
