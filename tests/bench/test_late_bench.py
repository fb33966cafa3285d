"""bench/late_bench.py end to end on tiny models: a ColBERT and a cross-encoder of one encoder, each in its own real
server, a short slice per concurrency, one round; the output names both models with sensible numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PASSAGES, WORDS = 8, (10, 20)
NUMBER = r"([\d.]+)"


@pytest.mark.slow
def test_late_bench_reranks_with_both_models_and_reports_their_rates_and_ratio() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.late_bench", "--size", "tiny", "--rounds", "1", "--concurrency", "1", "2",
         "--seconds", "0.5", "--calls", "3", "--passages", str(PASSAGES), "--words", *map(str, WORDS)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^date .*; cpu .*; cores \d+; load average [\d.]+ [\d.]+ [\d.]+$", out, re.M), out
    # the servers serve what their names say: token vectors and no head, or one label and no vectors
    assert re.search(r"^round 0 colbert started: bench-colbert: tasks .*\bembed\b.*, vector_dim 16, labels 0, "
                     r"2 layers x 32, ", out, re.M), out
    assert re.search(r"^round 0 cross-encoder started: bench-cross-encoder: tasks .*\brerank\b.*, vector_dim 0, "
                     r"labels 1, 2 layers x 32, ", out, re.M), out
    for c in (1, 2):
        for model in ("colbert", "cross-encoder"):
            line = re.search(rf"^round 0 c{c} {model}: {NUMBER} passages/s, (\d+) calls in {NUMBER} s, "
                             rf"p50 {NUMBER} ms, p99 {NUMBER} ms, server CPU {NUMBER} ms/call, tokens/call real "
                             rf"(\d+) padded (\d+), fp32, load average", out, re.M)
            assert line is not None, out
            rate, calls, seconds, p50, p99, cpu, real, padded = (float(x) for x in line.groups())
            assert 1 <= calls <= 3 and seconds > 0 and 0 < p50 <= p99
            assert rate == pytest.approx(PASSAGES * calls / seconds, rel=0.05)
            assert cpu > 0  # the server did the work: scoring 8 passages is not free
            # every passage's words are tokens of the vocabulary, at least one each, plus the specials
            assert PASSAGES * (WORDS[0] + 2) <= real <= padded, out
            row = re.search(rf"^\| {model} \| {c} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| "
                            rf"(\d+) / (\d+) \|$", out, re.M)
            assert row is not None, out
            # one round: the medians are that round's figures
            assert float(row.group(1)) == pytest.approx(rate, abs=0.1)
            assert float(row.group(3)) == pytest.approx(p50, abs=0.5)
            assert (int(row.group(6)), int(row.group(7))) == (round(real), round(padded))
        ratio = re.search(rf"^colbert / cross-encoder c{c}: passages/s per round {NUMBER}, median {NUMBER}; "
                          rf"p50 per round {NUMBER}, median {NUMBER}; server CPU/call per round {NUMBER}, median "
                          rf"{NUMBER}$", out, re.M)
        assert ratio is not None, out
        for per_round, median in ((1, 2), (3, 4), (5, 6)):  # one round: the median is that round's ratio
            assert float(ratio.group(per_round)) == float(ratio.group(median)) > 0
    assert "both sides are encoded per call" in out and "padded to 32 with [MASK]" in out
