"""Awaiting a grpc.aio unary call so that cancelling the caller does not leak grpcio's native memory.

When the task awaiting a grpc.aio unary call is cancelled while the call is in flight, grpc.aio cancels its
own invocation task, which drops the call's batch of operations without freeing it: about 1 KB of native
memory per such call, held for the life of the process, closing the channel or not (grpcio 1.70.0 to
1.85.3, measured with bench/grpc_client_leak.py; grpc/grpc#43360, fixes proposed upstream in #43361 and
#43409). A call that times out is freed. `unary(call)` awaits the call through `asyncio.shield`: on
cancellation it cancels the RPC itself (the server sees it cancelled at once, as before) and leaves grpc's
invocation task to finish the batch, which then frees it; the caller still gets `CancelledError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

R = TypeVar("R")

try:  # grpc.aio's call class, whose _cancel() cancels the RPC alone, without grpc's invocation task
    from grpc.aio._call import _LOCAL_CANCELLATION_DETAILS
    from grpc.aio._call import Call as _AioCall
except ImportError:  # another grpcio layout: the public cancel (which leaks as described) still cancels
    _AioCall = None


def cancel_rpc(call: Any) -> None:
    """Cancel the RPC of a grpc.aio call without cancelling grpc's invocation task (see the module)."""
    if _AioCall is not None and isinstance(call, _AioCall) and hasattr(call, "_cancel"):
        call._cancel(_LOCAL_CANCELLATION_DETAILS)
    else:
        call.cancel()


async def unary(call: Awaitable[R]) -> R:
    """The response of a grpc.aio unary call (its errors raised as `grpc.aio.AioRpcError`, as awaiting it
    raises them); when the awaiting task is cancelled, the RPC is cancelled without leaking (see the module)."""
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        if isinstance(call, grpc.aio.Call) and not call.done():
            cancel_rpc(call)
        raise
