"""bench/backend_bench.py on the compiled test bundle: one round, every case timed on both backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_backend_bench_times_both_backends(aoti_bundle: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.backend_bench", "--bundle", str(aoti_bundle), "--rounds", "1",
                           "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^\| (B=\d+ T=\d+|mixed [^|]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert [r[0].split()[0] for r in rows] == ["B=1", "B=4", "B=8", "mixed"], proc.stdout
    assert all(float(a) > 0 and float(b) > 0 for _, a, b, _ in rows)
    assert "compiled" not in proc.stderr  # the bundle had its model.pt2: nothing recompiled
