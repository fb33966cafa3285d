"""The event loop a serving process runs on (`--event-loop`): uvloop (libuv's loop, in C) where it is
installed, else asyncio's own.

Every call's network work, gRPC's completion queue and aiohttp's transport, runs on this loop, and on a CPU it
is the largest cost of a short call outside the model: uvloop took 13% off the server's CPU a call at 1 and at
64 callers of the doors' edge model and answered 8-14% more calls (bench/RESULTS.md, "No regression": the event
loop). grpc.aio runs on any asyncio loop. `auto` is uvloop whenever it can be imported (it is a pinned dependency
on Linux and macOS); `asyncio` keeps the standard library's loop (the in-process tests run on it, so both are
tested).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def uvloop_installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(choice: str) -> str:
    """The loop `choice` (auto | uvloop | asyncio) runs on here: "uvloop" or "asyncio"."""
    if choice == "auto":
        return "uvloop" if uvloop_installed() else "asyncio"
    return choice


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """`asyncio.run(main)` on the loop `choice` names; logs which."""
    name = resolve(choice)
    if name == "uvloop":
        log.info("event loop: uvloop %s (%s)", importlib.metadata.version("uvloop"),
                 "configured" if choice == name else choice)
    else:
        log.info("event loop: asyncio (%s)", "configured" if choice == name else "auto: uvloop is not installed")
    with asyncio.Runner(loop_factory=_loop_factory(name)) as runner:
        return runner.run(main)
