"""bench/ab.py end to end on the tiny model: two real servers, one differing by a flag and a prelude."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hf_helpers import write_tiny_bert
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


@pytest.fixture(scope="module")
def text_bundle_32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random BERT as a text bundle that takes 32 tokens: OpenAI's route refuses a text over the
    model's limit (its API has no truncation), and bench.ab's short texts run to 15 words plus 2 specials."""
    from model.__main__ import main

    src = write_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert-32", config={"max_position_embeddings": 32})
    settings = src / "sentence_bert_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "max_seq_length": 32}))
    out = tmp_path_factory.mktemp("bundles") / "tiny-text-32"
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(out), "--name", "tiny-bert-32"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ids", "text"])
def test_ab_over_the_http_door_reports_the_same_columns(kind: str, tiny_bundle: Path, text_bundle_32: Path) -> None:
    """`--door http`: ids through TEI's /embed, texts through OpenAI's /v1/embeddings, one round of short slices."""
    load = ["--model", str(tiny_bundle), "--lengths", "8", "16"] if kind == "ids" else [
        "--model", str(text_bundle_32), "--text", "short"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--door", "http", *load, "--concurrency", "4", "--rounds", "1",
         "--seconds", "0.5", *pinned()],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    unit = "seq/s" if kind == "ids" else "texts/s"
    for side in ("A", "B"):
        slice_ = re.search(rf"^round 0 c4 {side} \(http\): ([\d.]+) {re.escape(unit)}, p50 [\d.]+ ms, errors 0,", out,
                           re.M)
        assert slice_ is not None and float(slice_.group(1)) > 0, out
        line = re.search(rf"^{side}: {re.escape(unit)} ([\d.]+); median ([\d.]+), p99/p50 ([\d.]+); "
                         r"server CPU ms/call ([\d.]+), event loop ([\d.]+)$", out, re.M)
        assert line is not None, out
        rate, median, tail, cpu, loop = (float(x) for x in line.groups())
        assert rate == median > 0 and tail >= 1
        assert 0 < cpu < 1000 and 0 < loop <= cpu  # the HTTP door answers on the event loop: it costs CPU there
    assert re.search(rf"^B/A {re.escape(unit)} per round: [\d.]+; median [\d.]+$", out, re.M), out
