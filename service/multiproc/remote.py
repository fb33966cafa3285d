"""The edge process's side of the model process's batcher: `submit` and `cancel` as `Calls.compute`
uses them (service/doors/calls.py `Admission`), over the Unix socket (service/multiproc/frames.py).

`submit` never waits: it sends the call's jobs and returns items whose futures the reader task
resolves as the model process answers, one RESULT or ERROR per job (or one ERROR for the whole call:
a refusal such as `Overloaded`, which then reaches the caller as the same error it would in one
process). `cancel` cancels the futures and, when any job is still unanswered, tells the model
process to drop the call's queued jobs. When the model process goes away every unanswered job fails
`ShuttingDown` (UNAVAILABLE) and so does every later `submit`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence

from service.batching import Done, Item, Request
from service.errors import ServiceError, ShuttingDown
from service.jobs import Job
from service.multiproc import frames
from service.tracing import packed

log = logging.getLogger(__name__)


class ModelClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int,
                 on_drain: Callable[[float], None], on_lost: Callable[[], None]) -> None:
        self._reader = reader
        self._writer = writer
        self._max_frame = max_frame
        self._on_drain = on_drain
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._calls: dict[int, list[Item[Job]]] = {}  # unanswered calls, by id
        self._call_of: dict[Item[Job], int] = {}  # a call's first item -> its id (what `cancel` is handed)
        self._unanswered: dict[int, int] = {}
        self.gone = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._read())

    def lane(self, model: int) -> Lane:
        """The admission of the model at `model` (its index in the HELLO's list), for the doors' registry."""
        return Lane(self, model)

    def submit(self, requests: Sequence[Request[Job]], deadline: float, model: int = 0) -> list[Item[Job]]:
        if self.gone:
            raise ShuttingDown("the model process is gone; retry on another replica")
        call = next(self._ids)
        now = time.monotonic()
        items = [Item(r, deadline, now, self._loop.create_future()) for r in requests]
        self._calls[call] = items
        self._call_of[items[0]] = call
        self._unanswered[call] = len(items)
        # The call's span context (one per call, on each of its requests; service/tracing.py), for the forwards.
        traced = packed(requests[0].trace) if requests else packed(None)
        self._writer.write(frames.submit(call, deadline, [r.payload for r in requests], model, traced))
        return items

    def cancel(self, items: Sequence[Item[Job]]) -> None:
        call = self._call_of.pop(items[0], None) if items else None
        for item in items:
            item.future.cancel()
        if call is not None and self._calls.pop(call, None) is not None:
            self._unanswered.pop(call, None)
            if not self.gone and not self._writer.is_closing():
                self._writer.write(frames.frame(frames.CANCEL, call))

    def send(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        if self._task is not None:
            self._task.cancel()

    # -- the reader --------------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                kind, call, body = await frames.read_frame(self._reader, self._max_frame)
                if kind == frames.RESULT:
                    index, done = frames.read_result(body)
                    self._settle(call, index, done)
                elif kind == frames.ERROR:
                    index, error = frames.read_error(body)
                    self._settle(call, index, error)
                elif kind == frames.DRAIN:
                    self._on_drain(frames.read_drain(body))
                else:
                    raise frames.FrameError(f"unexpected frame kind {kind} from the model process")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except frames.FrameError as exc:
            log.error("bad frame from the model process: %s", exc)
        self.gone = True
        for call in list(self._calls):
            self._settle(call, -1, ShuttingDown("request aborted: the model process is gone; retry on another "
                                                "replica"))
        self._on_lost()

    def _settle(self, call: int, index: int, outcome: Done | ServiceError) -> None:
        items = self._calls.get(call)
        if items is None:
            return  # cancelled: its answers may still be on the way
        for item in (items if index < 0 else items[index:index + 1]):
            if item.future.done():
                continue
            self._unanswered[call] -= 1
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
                item.future.exception()  # retrieved: a caller that left must not cause a log line
            else:
                item.future.set_result(outcome)
        if self._unanswered[call] <= 0:
            del self._calls[call], self._unanswered[call]
            self._call_of.pop(items[0], None)


class Lane:
    """One model's admission in the model process (service/doors/calls.py `Admission`), over the edge's one
    connection to it."""

    def __init__(self, client: ModelClient, model: int) -> None:
        self._client = client
        self._model = model

    def submit(self, requests: Sequence[Request[Job]], deadline: float) -> list[Item[Job]]:
        return self._client.submit(requests, deadline, self._model)

    def cancel(self, items: Sequence[Item[Job]]) -> None:
        self._client.cancel(items)
