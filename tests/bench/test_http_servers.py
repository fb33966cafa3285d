"""bench/http_servers.py stays runnable: a bounded run prints a row per server and concurrency."""

import pytest

from bench import http_servers


def test_a_bounded_run_prints_a_row_per_server_and_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    assert http_servers.main(["--rounds", "1", "--calls", "20", "--concurrency", "1", "4",
                              "--servers", "aiohttp", "asgi"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| aiohttp |", "| asgi |"))]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("aiohttp", 1), ("asgi", 1), ("aiohttp", 4), ("asgi", 4)]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) >= 0  # calls/s, server CPU ms per call
