"""Fault hooks: delays at named points of the request path, to widen race windows in tests.

Every delay is 0 (off) unless the config sets it, and the config refuses any delay unless
`allow_fault_hooks` is on, so a production process cannot be slowed by a stray variable. The hooks
wrap what they delay; nothing else in the service knows of them. Points:

  after_admit     a queued sequence becomes batchable only this long after admission (`DelayedQueue`)
  after_dequeue   the model thread holds a chosen batch this long before its forward (`DelayedRunner`)
  before_scatter  ... and this long after the forward, before resolving the callers' futures
  in_shutdown     shutdown waits this long after refusing new calls, before closing the listener
  before_ready    start-up waits this long before loading the model (readiness stays NOT_SERVING)
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.batching import BatchLimits, BatchQueue, BatchRunner, InFlight, Item
from service.config import ServiceConfig

P = TypeVar("P")

POINTS = ("after_admit", "after_dequeue", "before_scatter", "in_shutdown", "before_ready")


@dataclass(frozen=True)
class FaultHooks:
    """Delays in seconds, by point; all 0 when no hook is armed."""

    after_admit: float = 0.0
    after_dequeue: float = 0.0
    before_scatter: float = 0.0
    in_shutdown: float = 0.0
    before_ready: float = 0.0

    @classmethod
    def from_config(cls, config: ServiceConfig) -> FaultHooks:
        if config.hooks_armed and not config.allow_fault_hooks:  # ServiceConfig already refuses this
            raise ValueError("fault hooks are armed but allow_fault_hooks is off")
        return cls(**{point: getattr(config, f"fault_delay_{point}_ms") / 1e3 for point in POINTS})

    @property
    def armed(self) -> dict[str, float]:
        return {point: getattr(self, point) for point in POINTS if getattr(self, point) > 0}

    async def pause(self, point: str) -> None:
        """Suspend this task (on the event loop) for the point's delay."""
        seconds: float = getattr(self, point)
        if seconds > 0:
            await asyncio.sleep(seconds)

    def runner(self, runner: BatchRunner[P]) -> BatchRunner[P]:
        """`runner`, or one that delays around its forwards when those hooks are armed."""
        return DelayedRunner(runner, self.after_dequeue, self.before_scatter) if (
            self.after_dequeue or self.before_scatter) else runner

    def queue(self) -> Callable[[BatchLimits], BatchQueue[Any]]:
        """How the batcher makes its queue: plain, or one whose items ripen `after_admit` first."""
        return functools.partial(DelayedQueue, delay_s=self.after_admit) if self.after_admit else BatchQueue


class DelayedRunner(Generic[P]):
    """A runner whose model thread sleeps before each forward (after_dequeue) and after it (before_scatter)."""

    def __init__(self, runner: BatchRunner[P], before_s: float, after_s: float) -> None:
        self._runner = runner
        self._before = before_s
        self._after = after_s

    @property
    def pipelined(self) -> bool:
        return self._runner.pipelined

    def set_wide(self, wide: bool) -> None:
        self._runner.set_wide(wide)

    def execute(self, payloads: list[P]) -> tuple[Sequence[Any], float]:
        _sleep(self._before)
        result = self._runner.execute(payloads)
        _sleep(self._after)
        return result

    def launch(self, payloads: list[P]) -> InFlight:
        _sleep(self._before)
        return self._runner.launch(payloads)

    def finish(self, in_flight: Any) -> tuple[Sequence[Any], float]:
        result = self._runner.finish(in_flight)
        _sleep(self._after)
        return result


class DelayedQueue(BatchQueue[P]):
    """A batch queue whose items become batchable only `delay_s` after their admission."""

    def __init__(self, limits: BatchLimits, delay_s: float) -> None:
        super().__init__(limits)
        self._delay = delay_s

    def choose(self, now: float) -> tuple[list[Item[P]], float]:
        ripe = now - self._delay
        queues = list(self._queues.values())
        first = min(q[0].enqueued_at for q in queues)  # each queue is in admission order
        if first > ripe:
            return [], first - ripe
        return self._choose([ready for q in queues if (ready := [i for i in q if i.enqueued_at <= ripe])], now)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
