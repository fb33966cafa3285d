"""Batching: the queue, the batch-choice policy, the model threads, the scheduler and the batcher that ties them.

No grpc and no torch here (`grep -rnE "^(import|from) (grpc|torch)" service/batching` prints nothing):
the runner it feeds is injected (service/runner.py), and errors are service/errors.py's.
"""

from service.batching.batcher import Batcher
from service.batching.queue import BatchQueue
from service.batching.scheduler import Scheduler
from service.batching.threads import ModelThreads
from service.batching.types import (
    BatchLimits,
    BatchObserver,
    BatchRunner,
    BatchTracer,
    Done,
    InFlight,
    Item,
    Request,
)

__all__ = [
    "BatchLimits", "BatchObserver", "BatchQueue", "BatchRunner", "BatchTracer", "Batcher", "Done", "InFlight", "Item",
    "ModelThreads", "Request", "Scheduler",
]
