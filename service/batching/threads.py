"""The model threads: they exist before the model, load and warm it (on the lead), then run the
batcher's loops. Nothing else runs a forward, and the event loop never does.

Thread 0 is the lead: the model is loaded and warmed up on it, and it runs every wide batch after
that, so setup and those batches share one OpenMP team (a second team slowed a lone forward: libgomp
stops spinning once its threads outnumber the cores; bench/RESULTS.md). The
other threads (`workers` > 1, for CPUs) only ever run narrow forwards (each a share of the threads).
At warm-up they may also run the measurement of the worker split (service/tuning.py); if fewer
workers are chosen, `shrink` ends the others before the batcher starts.

Each thread carries its Python name into the OS as well (Linux: /proc/<pid>/task/<tid>/comm, `top -H`,
py-spy), and threads it starts, OpenMP's among them, inherit it: bench/service_bench.py splits the
server's CPU into the model threads', the event loop's and the rest's by it.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_STOP = None
_PR_SET_NAME = 15  # prctl(2): name the calling thread; 15 bytes and a NUL at most


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) in the OS too. Best effort: only on Linux, and
    nothing happens where the C library has no prctl."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ModelThreads:
    """`workers` daemon threads, each running the functions handed to it, one at a time, in order."""

    def __init__(self, workers: int = 1, name: str = "model-runner") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        self._inboxes: list[queue.SimpleQueue[Callable[[], None] | None]] = [queue.SimpleQueue()
                                                                           for _ in range(workers)]
        self._threads = [
            threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                             name=name if workers == 1 else f"{name}-{i}")
            for i, inbox in enumerate(self._inboxes)
        ]
        self._ended: list[threading.Thread] = []  # shrunk away: they end on their own
        self._started = self._closed = False

    def __len__(self) -> int:
        return len(self._threads)

    def start(self) -> None:
        self._started = True
        for thread in self._threads:
            thread.start()

    def submit(self, worker: int, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on thread `worker` after what it was handed before; its result or exception lands
        on the returned future."""
        assert self._started and not self._closed, "ModelThreads not started, or closed. This is a bug."
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the submitter gets it
                    future.set_exception(exc)

        self._inboxes[worker].put(run)
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the lead thread and return what it returns (or raise what it raises)."""
        return await asyncio.wrap_future(self.submit(0, fn))

    def shrink(self, workers: int) -> None:
        """Keep the first `workers` threads; the others end once they have run what they were handed.
        Before the batcher starts (it runs one loop per thread)."""
        if not 1 <= workers <= len(self._threads):
            raise ValueError(f"workers must be 1..{len(self._threads)}; got {workers}")
        for inbox in self._inboxes[workers:]:
            inbox.put(_STOP)
        self._ended = [*self._ended, *self._threads[workers:]]
        del self._inboxes[workers:], self._threads[workers:]

    def close(self) -> None:
        """Let each thread end once it has run what it was handed (a thread stuck in a forward stays,
        a daemon, until that forward returns)."""
        self._closed = True
        for inbox in self._inboxes:
            inbox.put(_STOP)

    @property
    def alive(self) -> bool:
        """Whether any thread still runs."""
        return any(thread.is_alive() for thread in (*self._threads, *self._ended))

    @staticmethod
    def _serve(inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        _name_os_thread(threading.current_thread().name)
        while (fn := inbox.get()) is not _STOP:
            fn()

