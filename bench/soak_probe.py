"""The in-process half of bench/soak.py: a daemon thread that appends one JSON line a second to
`<SOAK_PROBE_DIR>/<pid>.jsonl` with what a soak judges (RSS, fds, threads, live asyncio tasks) and
what explains it (anonymous RSS, glibc's heap in use and free, mmapped blocks, gc objects).

bench/soak.py puts a generated `sitecustomize.py` on the server's PYTHONPATH that calls `start()`, so
the service process and every edge process it spawns (they inherit the environment) report the same
way without the service knowing. `SOAK_TRACEMALLOC=<frames>` also starts tracemalloc and writes the
top growth since the first minute to `<pid>.tracemalloc.txt` every minute (slow: diagnosis only);
`SOAK_TYPES=1` writes the gc-tracked objects' growth by type since the first minute to `<pid>.types.txt`;
`SOAK_COLLECT=1` runs a full gc.collect() once a minute and records what it found (`collected`) and the
objects left (`gc_objects_after`): growth that a collection takes back is garbage waiting, not a leak.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import gc
import json
import os
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

PERIOD_S = 1.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def _live_tasks() -> int:
    # asyncio.all_tasks() needs the loop's thread; asyncio's registry (a WeakSet in 3.11, which the C
    # tasks join too) can be read from here, retried as all_tasks() itself does when it changes under us.
    registry = getattr(asyncio.tasks, "_all_tasks", None)
    if registry is None:
        return -1
    for _ in range(100):
        try:
            return sum(1 for task in list(registry) if not task.done())
        except RuntimeError:
            continue
    return -1


def _type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _run(path: Path, trace_path: Path | None, types_path: Path | None) -> None:
    mallinfo = _mallinfo()
    started = time.monotonic()
    first: tracemalloc.Snapshot | None = None
    first_types: collections.Counter[str] | None = None
    collect = bool(os.environ.get("SOAK_COLLECT"))
    n = 0
    with open(path, "a", buffering=1) as out:
        while True:
            status = _status()
            row: dict[str, Any] = {
                "t": round(time.time(), 3), "rss_kb": status.get("VmRSS"), "anon_kb": status.get("RssAnon"),
                "file_kb": status.get("RssFile"), "threads": status.get("Threads"),
                "fds": len(os.listdir("/proc/self/fd")), "tasks": _live_tasks(), "gc_counts": gc.get_count(),
            }
            if mallinfo is not None:
                info = mallinfo()
                row.update(heap_used_kb=info.uordblks // 1024, heap_free_kb=info.fordblks // 1024,
                           mmapped_kb=info.hblkhd // 1024, arena_kb=info.arena // 1024)
            if n % 10 == 0:
                row["gc_objects"] = len(gc.get_objects())
            if collect and n % 60 == 30:
                row["collected"] = gc.collect()
                row["gc_objects_after"] = len(gc.get_objects())
            out.write(json.dumps(row) + "\n")
            if trace_path is not None and n % 60 == 0 and time.monotonic() - started >= 60:
                snapshot = tracemalloc.take_snapshot()
                if first is None:
                    first = snapshot
                else:
                    top = snapshot.compare_to(first, "traceback")[:15]
                    with open(trace_path, "w") as trace:
                        trace.write(f"# {time.strftime('%H:%M:%S')} growth since the first minute\n")
                        for stat in top:
                            trace.write(f"{stat}\n" + "\n".join(stat.traceback.format()) + "\n\n")
            if types_path is not None and n % 60 == 0 and time.monotonic() - started >= 60:
                counts = _type_counts()
                if first_types is None:
                    first_types = counts
                else:
                    grown = sorted(((counts[k] - first_types[k], k) for k in counts), reverse=True)[:20]
                    with open(types_path, "w") as out_types:
                        out_types.write(f"# {time.strftime('%H:%M:%S')} gc objects by type, growth since the "
                                        f"first minute ({sum(counts.values())} now)\n")
                        out_types.writelines(f"{d:+d} {k}\n" for d, k in grown if d)
            n += 1
            time.sleep(PERIOD_S)


def start() -> None:
    """Start the sampler when SOAK_PROBE_DIR is set (a no-op otherwise)."""
    directory = os.environ.get("SOAK_PROBE_DIR")
    if not directory:
        return
    frames = int(os.environ.get("SOAK_TRACEMALLOC", "0"))
    if frames:
        tracemalloc.start(frames)
    path = Path(directory) / f"{os.getpid()}.jsonl"
    trace_path = Path(directory) / f"{os.getpid()}.tracemalloc.txt" if frames else None
    types_path = Path(directory) / f"{os.getpid()}.types.txt" if os.environ.get("SOAK_TYPES") else None
    threading.Thread(target=_run, args=(path, trace_path, types_path), name="soak-probe", daemon=True).start()
