"""A batch run in two phases on a pipelined device: `launch` now, `finish` later, with the model thread
free in between to choose and launch the next batch (service/batcher.py decides when).

If either phase raises, the batch is run again through `execute`, which splits it on OOM and bisects
to the one bad sequence on a model error: a pipelined failure ends exactly as an unpipelined one,
every item with its own outcome. Imports neither grpc nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.batch_types import Item, Pipeline

log = logging.getLogger(__name__)

P = TypeVar("P")


@dataclass(eq=False)
class Flight(Generic[P]):
    """A launched batch, until it is finished and delivered."""

    batch: list[Item[P]]
    started: float
    handle: Any = None
    error: Exception | None = None  # launch raised: `finish` runs it through `execute` instead


class TwoPhase(Generic[P]):
    def __init__(self, pipeline: Pipeline[P], execute: Callable[[list[P]], tuple[Sequence[Any], float]]) -> None:
        self._pipeline = pipeline
        self._execute = execute

    @property
    def pipelined(self) -> bool:
        return self._pipeline.pipelined

    def launch(self, batch: list[Item[P]], started: float) -> Flight[P]:
        try:
            return Flight(batch, started, self._pipeline.launch(_payloads(batch)))
        except Exception as exc:  # noqa: BLE001 - the batch is run through `execute` when finished
            return Flight(batch, started, error=exc)

    def finish(self, flight: Flight[P]) -> tuple[Sequence[Any], float]:
        """`(outputs, compute_s)`, as `execute` returns them."""
        error = flight.error
        if error is None:
            try:
                return self._pipeline.finish(flight.handle)
            except Exception as exc:  # noqa: BLE001 - handled below
                error = exc
        log.warning("pipelined batch of %d failed (%s: %s); running it through execute",
                    len(flight.batch), type(error).__name__, error)
        return self._execute(_payloads(flight.batch))


def _payloads(batch: list[Item[P]]) -> list[P]:
    return [item.request.payload for item in batch]
