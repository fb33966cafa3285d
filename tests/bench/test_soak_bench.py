"""bench/soak.py stays runnable and sees growth: a 15 s run against a real `python -m service` on the fault
model, with the LEAK sentinel in one call of 20, reports the service process's figures from inside it
(bench/soak_probe.py) and a steep RSS slope; and the slope fit on made-up samples."""

import json
from pathlib import Path

import numpy as np
import pytest

from bench import soak


def test_the_summary_fits_the_slope_after_the_warm_up() -> None:
    rows = [{"t": 1000.0 + i, "rss_kb": (300 + (0.1 * max(0, i - 30) if i >= 30 else i)) * 1024, "fds": 18,
             "threads": 15, "tasks": 3 + i % 2} for i in range(300)]  # rises for 30 s, then 6 MB/min
    rows[200]["rss_kb"] += 80 * 1024  # one outlier: trimmed
    summary = soak.summarise(rows, 1000.0, warmup_s=30)
    assert summary["rss_slope_mb_per_min_after_warmup"] == pytest.approx(6.0, abs=0.05)
    assert summary["fds"] == [18, 18] and summary["threads"] == [15, 15] and summary["tasks"] == [3, 4]
    assert summary["rss_max_mb_per_minute"][0] == pytest.approx(329.0)
    assert soak.slope_mb_per_min(np.arange(10.0), np.full(10, 5.0)) == pytest.approx(0.0)


@pytest.mark.slow
def test_a_short_run_with_the_leak_reports_the_service_and_its_growth(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # One caller, every other call LEAK: one forward per call, so each LEAK answered OK kept 1 MiB.
    assert soak.main(["--model", "faults", "--minutes", "0.25", "--warmup-s", "0", "--concurrency", "1",
                      "--leak-every", "2", "--keep", str(tmp_path / "work"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["calls"] > 20 and report["codes"].get("OK", 0) > 0, report
    service = report["processes"]["service"]
    assert service["samples"] >= 10
    assert service["fds"][0] > 0 and service["threads"][0] > 1 and service["tasks"][0] >= 1
    leaked_mb = report["codes"]["LEAK_OK (of OK)"]
    assert leaked_mb >= 10, report
    assert service["rss_mb_end"] - service["rss_mb_at_warmup_end"] >= 0.8 * leaked_mb, (leaked_mb, service)
    assert service["rss_slope_mb_per_min_after_warmup"] > 10, service  # a plateau's is under 1 (RESULTS.md)
