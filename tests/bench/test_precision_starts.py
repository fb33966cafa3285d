"""bench/precision_starts.py stays runnable: fresh processes load a bundle with precision=auto, beside a
busy loop with --hog, and each start's measured choice is printed and counted (no timing asserted)."""

from pathlib import Path

import pytest

from bench import precision_starts


def test_a_bounded_run_prints_each_starts_measured_choice_and_the_count(tiny_bundle: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert precision_starts.main(["--model", str(tiny_bundle), "--starts", "1", "--hog", "--hog-limit", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    starts = [line for line in lines if line.startswith("start ")]
    assert len(starts) == 1 and all(": measured at warm-up on 4x64 tokens at " in line for line in starts), lines
    chosen = [line.split(": ")[1] for line in starts]
    summary = lines[-1]
    assert "with a hog: " in summary and "of 1 starts" in summary
    assert all(f"{name} {chosen.count(name)}" in summary for name in set(chosen)), summary
