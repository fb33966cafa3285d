"""Fault hooks: delays at named points of the request path, to widen race windows in tests.

Every delay is 0 (off) unless the config sets it, and the config refuses any delay unless
`allow_fault_hooks` is on, so a production process cannot be slowed by a stray variable. Points:

  after_admit     a queued sequence becomes batchable only this long after admission (batcher)
  after_dequeue   the model thread holds a chosen batch this long before its forward
  before_scatter  ... and this long after the forward, before resolving the callers' futures
  in_shutdown     shutdown waits this long after refusing new calls, before closing the listener
  before_ready    start-up waits this long before loading the model (readiness stays NOT_SERVING)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from service.config import ServiceConfig

POINTS = ("after_admit", "after_dequeue", "before_scatter", "in_shutdown", "before_ready")


@dataclass(frozen=True)
class Hooks:
    """Delays in seconds, by point; all 0 when no hook is armed."""

    after_admit: float = 0.0
    after_dequeue: float = 0.0
    before_scatter: float = 0.0
    in_shutdown: float = 0.0
    before_ready: float = 0.0

    @classmethod
    def from_config(cls, config: ServiceConfig) -> Hooks:
        if config.hooks_armed and not config.allow_fault_hooks:  # ServiceConfig already refuses this
            raise ValueError("fault hooks are armed but allow_fault_hooks is off")
        return cls(**{point: getattr(config, f"fault_delay_{point}_ms") / 1e3 for point in POINTS})

    @property
    def armed(self) -> dict[str, float]:
        return {point: getattr(self, point) for point in POINTS if getattr(self, point) > 0}

    def pause(self, point: str) -> None:
        """Block this thread (the model thread) for the point's delay."""
        seconds: float = getattr(self, point)
        if seconds > 0:
            time.sleep(seconds)

    async def apause(self, point: str) -> None:
        """Suspend this task (on the event loop) for the point's delay."""
        seconds: float = getattr(self, point)
        if seconds > 0:
            await asyncio.sleep(seconds)
