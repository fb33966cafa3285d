"""The processes' own health on /metrics: prometheus_client's standard `process_*` families (CPU, resident and
virtual memory, file descriptors, start time), `python_gc_*` and `python_info`, each sample labelled `process`
with the name the process has in traces and logs (`server`; with edge processes `model` and `edge 0`, `edge 1`,
...; service/tracing.py).

prometheus_client's multiprocess mode sums only the library's own metric types from the processes' files, so its
process and GC collectors do not work there. Instead the process that serves /metrics reads them at each scrape:
its own from its interpreter and /proc, and each edge process's `process_*` from /proc/<pid> (it knows their pids;
a restarted edge appears under the same name with its new start time and a counter reset, as after any
restart). An edge's interpreter cannot be read from outside it, so `python_gc_*` and `python_info` are the model
process's alone in that mode. Nothing is stored or pushed: an edge pays nothing for it, and every value is read
after the scrape arrived. `process_*` exist on Linux only (prometheus_client reads /proc).
Not exported: the count of objects `--gc-freeze` froze. `gc.get_freeze_count()` walks the whole permanent
generation: in a served process, its 200,000 objects scattered through its memory, a /metrics render took 88 ms
with it against 5.6 without (median of 30, edge processes, 2026-12-03), holding the GIL. It is logged once, at the
freeze.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LABEL = "process"

# The families, as exposed: name -> (type, labels), for the metrics contract (service/metrics.py `metric_families`).
FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    "process_cpu_seconds_total": ("counter", frozenset({LABEL})),
    "process_resident_memory_bytes": ("gauge", frozenset({LABEL})),
    "process_virtual_memory_bytes": ("gauge", frozenset({LABEL})),
    "process_start_time_seconds": ("gauge", frozenset({LABEL})),
    "process_open_fds": ("gauge", frozenset({LABEL})),
    "process_max_fds": ("gauge", frozenset({LABEL})),
    "python_gc_objects_collected_total": ("counter", frozenset({"generation", LABEL})),
    "python_gc_objects_uncollectable_total": ("counter", frozenset({"generation", LABEL})),
    "python_gc_collections_total": ("counter", frozenset({"generation", LABEL})),
    "python_info": ("gauge", frozenset({"implementation", "major", "minor", "patchlevel", "version", LABEL})),
}


class ProcessMetrics(Collector):
    """This process (`name`) and the ones `others` lists now ((name, pid) each), labelled `process`."""

    def __init__(self, name: str, others: Callable[[], Iterable[tuple[str, int]]] = lambda: ()) -> None:
        self._name = name
        self._others = others
        # GCCollector registers itself wherever it is made; a registry of its own keeps it off the served one.
        self._interpreter = (GCCollector(registry=CollectorRegistry()), PlatformCollector(registry=None))
        self._procs: dict[int, ProcessCollector] = {}

    def collect(self) -> Iterable[Metric]:
        me = os.getpid()
        processes = [(self._name, me), *self._others()]
        procs = {pid: self._procs.get(pid) or _proc(pid) for _, pid in processes}
        self._procs = procs  # replaced whole: a pid gone is forgotten
        families: dict[str, Metric] = {}
        for name, pid in processes:
            # A process that exits meanwhile yields nothing (prometheus_client skips what it cannot read).
            _relabel(families, procs[pid].collect(), name)
        for collector in self._interpreter:
            _relabel(families, collector.collect(), self._name)
        return list(families.values())


def _proc(pid: int) -> ProcessCollector:
    """prometheus_client's process collector of `pid`."""
    return ProcessCollector(pid=lambda: pid, registry=None)


def _relabel(families: dict[str, Metric], metrics: Iterable[Metric], name: str) -> None:
    """`metrics`' samples, with `process` set to `name`, into `families` (one family per name, as the
    exposition format requires)."""
    for metric in metrics:
        family = families.get(metric.name)
        if family is None:
            family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
        for sample in metric.samples:
            family.add_sample(sample.name, {**sample.labels, LABEL: name}, sample.value, sample.timestamp,
                              sample.exemplar)
