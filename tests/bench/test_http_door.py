"""bench/http_door.py stays runnable: a bounded run prints a row per door and concurrency."""

import pytest

from bench import http_door


def test_a_bounded_run_prints_a_row_per_door(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_door.main(["--rounds", "1", "--calls", "5", "--concurrency", "1", "--doors", "grpc", "openai",
                           "openai-base64", "tei"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| grpc |", "| openai |", "| openai-base64 |", "| tei |"))]
    assert [r[0].strip() for r in rows] == ["grpc", "openai", "openai-base64", "tei"]
    assert all(float(r[2]) > 0 for r in rows)
