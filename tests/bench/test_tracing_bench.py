"""bench/tracing_bench.py runs, small: every span it makes reaches the receiver in the other process, and it
reports the layer's cost on and off."""

from __future__ import annotations

import re

import pytest

from bench import tracing_bench


def test_every_span_is_received_and_both_costs_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert tracing_bench.main(["--calls", "300", "--calls-per-batch", "4"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"received: spans (\d+) in \d+ exports \(sent (\d+)\)", out)
    assert found is not None, out
    assert int(found[1]) == int(found[2]) == 3 * 300 * 4 + 3 * 75
    assert re.search(r"tracing on: +[\d.]+ us/call", out) and re.search(r"tracing off: +[\d.]+ us/call", out), out
