"""bench/vs_infinity.py stays runnable: a bounded run of this service's arm on the tiny text bundle prints a
row per concurrency (Infinity lives in its own environment, outside the project's requirements)."""

import os
from pathlib import Path

import pytest

from bench import vs_infinity


def test_a_bounded_run_of_the_services_doors_prints_a_row_per_door_and_concurrency(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_text_bundle: Path) -> None:
    # The tiny bundle takes 8 tokens: texts that fit it, so every call must succeed.
    monkeypatch.setattr(vs_infinity, "make_texts", lambda n: ["a b", "the quick fox", "über café"] * n)
    assert vs_infinity.main(["--arms", "http", "grpc", "--model", str(tiny_text_bundle), "--rounds", "1", "--duration",
                             "0.5", "--max-calls", "20", "--warmup", "0.2", "--concurrency", "1", "4",
                             "--threads", "1", "--texts", "16", "--precision", "bf16",
                             "--service-flag=--nonfinite-policy=fail"]) == 0
    out = capsys.readouterr().out
    assert "service: --precision bf16, serving bf16: configured" in out  # the flag reached the server
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(("| http |", "| grpc |"))]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("http", 1), ("grpc", 1), ("http", 4), ("grpc", 4)]
    for row in rows:
        assert float(row[2]) > 0 and float(row[5]) >= 0 and row[8].strip() == "0"  # texts/s, CPU ms/call, errors
    assert "flags:" in out and "load average" in out


def test_short_texts_and_busy_loops_beside_every_slice(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, tiny_text_bundle: Path,
                                                        tmp_path: Path) -> None:
    kinds: list[str] = []

    def short(kind: str, n: int) -> list[str]:
        kinds.append(kind)
        return ["a b", "the fox"] * n

    monkeypatch.setattr(vs_infinity, "make_word_texts", short)
    # Each busy loop leaves a file named by its pid: two per slice, two slices.
    mark = f"import os, pathlib; pathlib.Path({str(tmp_path)!r}, str(os.getpid())).touch()\n"
    monkeypatch.setattr(vs_infinity, "HOG", mark + vs_infinity.HOG)
    assert vs_infinity.main(["--arms", "grpc", "--model", str(tiny_text_bundle), "--rounds", "1", "--duration", "0.5",
                             "--max-calls", "10", "--warmup", "0.2", "--concurrency", "1", "2", "--threads", "1",
                             "--texts", "8", "--words", "short", "--hog", "2"]) == 0
    assert kinds == ["short"]
    assert len(list(tmp_path.iterdir())) == 4
    out = capsys.readouterr().out
    assert "short texts; 2 busy loop(s) beside" in out
    assert [line.split("|")[9].strip() for line in out.splitlines() if line.startswith("| grpc |")] == ["0", "0"]


def test_tree_cpu_counts_this_process() -> None:
    assert vs_infinity.tree_cpu_s(os.getpid()) > 0
