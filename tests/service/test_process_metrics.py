"""Each process's own health on /metrics (service/process_metrics.py): prometheus_client's process and GC
families for this process and for the processes it lists (real child processes here; the served modes in
tests/service/test_metrics.py, through a real Prometheus, and tests/service/test_multiproc.py), one family per
name, labelled `process`."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.process_metrics import FAMILIES, ProcessMetrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_* are read from /proc")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """The registry as a scraper reads it: through the text format and prometheus_client's parser."""
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE")


@pytest.fixture
def children() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Two real processes: one asleep, one spinning on a CPU until it is killed (bounded: 60 s)."""
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    procs = {"edge 0": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
             "edge 1": subprocess.Popen([sys.executable, "-c", spin])}
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_every_family_is_exported_once_with_each_process_labelled(children: dict[str, subprocess.Popen[bytes]]):
    registry = CollectorRegistry()
    registry.register(ProcessMetrics("model", lambda: [(name, p.pid) for name, p in children.items()]))
    text = generate_latest(registry).decode()
    exported = {(f.name + "_total" if f.type == "counter" else f.name): (f.type, frozenset(
        k for sample in f.samples for k in sample.labels)) for f in text_string_to_metric_families(text)}
    assert exported == FAMILIES
    # Once each: the text format allows no second TYPE line for a family (the parser would merge them silently).
    typed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(typed) == len(set(typed)) == len(FAMILIES), typed
    samples = scrape(registry)
    # process_* for every process; the interpreter's own families for this one only.
    assert {dict(ls)["process"] for n, ls in samples if n == "process_resident_memory_bytes"} == {
        "model", "edge 0", "edge 1"}
    assert {dict(ls)["process"] for n, ls in samples if n.startswith("python_")} == {"model"}
    assert value(samples, "python_gc_collections_total", process="model", generation="2") == gc.get_stats()[2][
        "collections"]


def test_the_values_are_each_process_s_own_read_at_the_scrape(children: dict[str, subprocess.Popen[bytes]]):
    registry = CollectorRegistry()
    registry.register(ProcessMetrics("model", lambda: [(name, p.pid) for name, p in children.items()]))
    time.sleep(0.5)  # the spinning child has taken some CPU
    first = scrape(registry)
    for name, proc in children.items():
        # resident memory as /proc reads it now, within what a sleeping interpreter moves in between
        assert value(first, "process_resident_memory_bytes", process=name) == pytest.approx(rss_bytes(proc.pid),
                                                                                             rel=0.05)
    busy = children["edge 1"].pid
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and value(scrape(registry), "process_cpu_seconds_total",
                                                process="edge 1") <= value(first, "process_cpu_seconds_total",
                                                                           process="edge 1"):
        time.sleep(0.1)
    later = scrape(registry)
    assert value(later, "process_cpu_seconds_total", process="edge 1") > value(first, "process_cpu_seconds_total",
                                                                              process="edge 1"), busy
    assert value(later, "process_start_time_seconds", process="edge 1") == value(
        first, "process_start_time_seconds", process="edge 1")


def test_a_process_that_is_gone_drops_out_and_the_scrape_still_renders(children: dict[str, subprocess.Popen[bytes]]):
    listed = dict(children)
    registry = CollectorRegistry()
    registry.register(ProcessMetrics("model", lambda: [(name, p.pid) for name, p in listed.items()]))
    gone = children["edge 0"]
    gone.kill()
    gone.wait()  # reaped: /proc/<pid> no longer exists, though the list still names it
    samples = scrape(registry)
    assert {dict(ls)["process"] for n, ls in samples if n == "process_cpu_seconds_total"} == {"model", "edge 1"}
