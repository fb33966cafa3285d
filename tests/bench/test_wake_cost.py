"""bench.wake_cost, bounded: every work, both ways, two gaps, a few calls each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.wake_cost import main

WORKS = ("forward", "plan", "python")  # all three, by default


def test_every_work_way_and_gap_is_measured_on_the_thread_that_ran_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "wake.json"
    assert main(["--gaps", "0", "1", "--calls", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["work"], r["way"], r["gap_ms"]) for r in rows} == {
        (work, way, gap) for work in WORKS for way in ("inline", "hand-off") for gap in (0.0, 1.0)}
    for r in rows:
        assert r["calls"] == 5 and r["work_cpu_us"] > 0
        # The call's wall time holds the work's CPU (inline: on the caller's own thread; handed off: on the
        # worker's, while the caller waits), so a CPU figure above it would be a mix-up of threads or units.
        assert r["work_cpu_us"] <= 1.05 * r["call_us"] + 20
    table = capsys.readouterr().out
    assert all(table.count(f"| {work} |") == 4 for work in WORKS) and "x gap 0" in table


@pytest.mark.parametrize("bad", [["--gaps", "11"], ["--gaps", "-1"], ["--calls", "0"], ["--calls", "5001"]])
def test_unbounded_runs_are_refused(bad: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*bad, "--json", str(tmp_path / "x.json")])
    assert exc.value.code == 2
