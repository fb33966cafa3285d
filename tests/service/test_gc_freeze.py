"""The start-up heap frozen once SERVING (`--gc-freeze`, service/process.py `freeze_heap`): `python -m service`
freezes it in every process (one process; the model process and each edge) and says how much, and not when told
not to. A model loaded before the freeze still gives its memory back when unloaded (tests/service/test_models.py,
the frozen-heap case of `test_unloading_a_model_gives_its_memory_back`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess

FROZEN = re.compile(r"gc: (\d+) objects of start-up frozen")


@pytest.mark.parametrize(("flags", "processes"), [
    ((), 1),
    (("--edge-processes", "1"), 2),  # the model process and the edge
    (("--no-gc-freeze",), 0),
], ids=["one-process", "edge-processes", "off"])
def test_the_served_processes_freeze_their_start_up_heap_once_serving(
        tiny_bundle: Path, flags: tuple[str, ...], processes: int) -> None:
    server = ServerProcess(tiny_bundle, *flags)
    try:
        frozen = [int(n) for n in FROZEN.findall(server.output())]
        assert len(frozen) == processes, server.output()[-2000:]
        # Modules, torch, gRPC and the model's Python side: far more than anything a call leaves behind.
        assert all(n > 50_000 for n in frozen), frozen
    finally:
        server.stop()
