"""bench/models_bench.py end to end on tiny models: an embedder and a reranker served by one process (A) and by two
one-model processes (B), a short mixed slice and the lone calls on each, one round; the output says what each
server serves, with sensible numbers, and the A / B ratios and targets agree with the per-round figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PASSAGES, CALLS, LONE_CALLS = 4, 5000, 3  # the mixed window closes at its 1 s, not at CALLS
NUMBER = r"([\d.]+)"


@pytest.mark.slow
def test_models_bench_serves_both_models_in_one_process_and_in_two_and_reports_their_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.models_bench", "--size", "tiny", "--rounds", "1", "--seconds", "1",
         "--calls", str(CALLS), "--lone-seconds", "1", "--lone-calls", str(LONE_CALLS), "--passages", str(PASSAGES),
         "--embed-concurrency", "2", "--rerank-concurrency", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^date .*; cpu .*; cores \d+; load average [\d.]+ [\d.]+ [\d.]+$", out, re.M), out
    # A is one process serving both, by the names the calls use; B one process per model, each alone
    servers = re.findall(r"^round 0 (A|B) server pid (\d+): (.*)$", out, re.M)
    assert [s for s, _, _ in servers].count("A") == 1 and [s for s, _, _ in servers].count("B") == 2, out
    assert len({pid for _, pid, _ in servers}) == 3, out
    tiny = r", 2 layers x 32, fp32, max_batch_tokens 1024"
    embed, rerank = rf"tasks embed{tiny}", rf"tasks [a-z,]*\brerank\b[a-z,]*{tiny}"
    assert re.fullmatch(rf"embed: {embed}; rerank: {rerank}", next(d for s, _, d in servers if s == "A")), out
    assert sorted(d.split(":")[0] for s, _, d in servers if s == "B") == ["bench-embed", "bench-rerank"], out
    assert all(re.fullmatch(rf"bench-embed: {embed}|bench-rerank: {rerank}", d) for s, _, d in servers if s == "B")

    figures: dict[tuple[str, str], dict[str, float]] = {}
    for setup in ("A", "B"):
        for model in ("embed", "rerank"):
            line = re.search(rf"^round 0 {setup} mixed {model}: {NUMBER} calls/s, {NUMBER} texts/s, (\d+) calls in "
                             rf"{NUMBER} s, p50 {NUMBER} ms, p99 {NUMBER} ms$", out, re.M)
            assert line is not None, out
            rate, texts, calls, seconds, p50, p99 = (float(x) for x in line.groups())
            # both models ran at once for the whole window; it closed at the time bound or the first call bound
            assert 1 <= calls <= CALLS and 0 < seconds and 0 < p50 <= p99, out
            assert rate == pytest.approx(calls / seconds, rel=0.01)
            per_call = (1, 4) if model == "embed" else (PASSAGES, PASSAGES)  # texts a call, both included
            assert per_call[0] * rate * 0.99 <= texts <= per_call[1] * rate * 1.01, out
            lone = re.search(rf"^round 0 {setup} lone {model}: (\d+) calls, p50 {NUMBER} ms, p99 {NUMBER} ms, load "
                             rf"average", out, re.M)
            assert lone is not None, out
            assert 1 <= int(lone.group(1)) <= LONE_CALLS and 0 < float(lone.group(2)) <= float(lone.group(3))
            figures[setup, model] = {"rate": rate, "p99": p99, "lone": float(lone.group(2)),
                                     "lone calls": int(lone.group(1))}
        cpu = re.search(rf"^round 0 {setup} mixed server CPU {NUMBER} cores, idle servers {NUMBER} cores, client "
                        rf"CPU {NUMBER} cores", out, re.M)
        assert cpu is not None and float(cpu.group(1)) > 0, out  # the servers did the work
    for model in ("embed", "rerank"):  # the lone calls alternate between A and B, one each in turn
        assert figures["A", model]["lone calls"] == figures["B", model]["lone calls"], out

    for model in ("embed", "rerank"):
        for setup in ("A", "B"):  # one round: the medians are that round's figures
            row = re.search(rf"^\| {model} \| {setup}: [a-z ,-]+ \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| "
                            rf"{NUMBER} \|$", out, re.M)
            assert row is not None, out
            assert float(row.group(1)) == pytest.approx(figures[setup, model]["rate"], abs=0.01)
            assert float(row.group(4)) == pytest.approx(figures[setup, model]["p99"], abs=0.1)
            assert float(row.group(5)) == pytest.approx(figures[setup, model]["lone"], abs=0.01)
        ratio = re.search(rf"^A / B {model}: calls/s per round {NUMBER} \(median {NUMBER}\); p99 per round {NUMBER} "
                          rf"\(median {NUMBER}\); lone p50 per round {NUMBER} \(median {NUMBER}\)$", out, re.M)
        assert ratio is not None, out
        a, b = figures["A", model], figures["B", model]
        for group, key in ((1, "rate"), (3, "p99"), (5, "lone")):
            assert float(ratio.group(group)) == float(ratio.group(group + 1))  # one round: its own median
            assert float(ratio.group(group)) == pytest.approx(a[key] / b[key], rel=0.02)
        # each target's verdict follows its ratio
        verdicts = {what: (held == "met", float(median)) for what, held, median in re.findall(
            rf"^target {model} (throughput A >= B|p99 A <= B|lone p50 unchanged)[^:]*: (met|NOT met) "
            rf"\(median A / B {NUMBER}\)$", out, re.M)}
        assert verdicts.keys() == {"throughput A >= B", "p99 A <= B", "lone p50 unchanged"}, out
        assert verdicts["throughput A >= B"][0] == (verdicts["throughput A >= B"][1] >= 1), out
        assert verdicts["p99 A <= B"][0] == (verdicts["p99 A <= B"][1] <= 1), out
