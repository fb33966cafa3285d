"""The start-up heap frozen once SERVING (`--gc-freeze`, service/process.py `freeze_heap`): `python -m service`
freezes it in every process (one process; the model process and each edge) and says how much (in its log and, for
the process serving /metrics, as `attention_gc_frozen_objects`), and not when told not to. A model loaded before
the freeze still gives its memory back when unloaded (tests/service/test_models.py, the frozen-heap case of
`test_unloading_a_model_gives_its_memory_back`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess

FROZEN = re.compile(r"gc: (\d+) objects of start-up frozen")


@pytest.mark.parametrize(("flags", "processes", "served"), [
    ((), 1, ["server"]),
    (("--edge-processes", "1"), 2, ["model", "edge 0"]),  # the model process and the edge
    (("--no-gc-freeze",), 0, ["server"]),
], ids=["one-process", "edge-processes", "off"])
def test_the_served_processes_freeze_their_start_up_heap_once_serving_and_report_it(
        tiny_bundle: Path, flags: tuple[str, ...], processes: int, served: list[str]) -> None:
    server = ServerProcess(tiny_bundle, *flags)
    try:
        frozen = [int(n) for n in FROZEN.findall(server.output())]
        samples = server.scrape()
    finally:
        server.stop()
    assert len(frozen) == processes, server.output()[-2000:]
    # Modules, torch, gRPC and the model's Python side: far more than anything a call leaves behind.
    assert all(n > 50_000 for n in frozen), frozen
    # On /metrics (service/process_metrics.py): the process serving it reports its own frozen count, what its log line
    # gave (the model process's is one of the two logged with edges) less the frozen objects freed since, and every
    # process's memory and CPU.
    reported = {dict(labels)["process"]: v for (name, labels), v in samples.items()
                if name == "attention_gc_frozen_objects"}
    assert list(reported) == served[:1]
    assert any(0.9 * n <= reported[served[0]] <= n for n in frozen) if frozen else reported[served[0]] == 0
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total"):
        values = {dict(labels)["process"]: v for (sample, labels), v in samples.items() if sample == name}
        assert sorted(values) == sorted(served) and all(v > 0 for v in values.values()), (name, values)
