"""Typed service errors and the one table that maps each to a gRPC status code.

    ServiceError
    ├── InvalidInput        INVALID_ARGUMENT    the request is wrong whatever the server's state
    │   ├── NonFiniteInput  INVALID_ARGUMENT    NaN/Inf in input embeddings (counted apart)
    │   ├── OutputOverflow  INVALID_ARGUMENT    a finite result the asked output dtype cannot hold
    │   ├── EmptyInput      INVALID_ARGUMENT    (HTTP 400) a call with nothing in it (TEI's `Empty`)
    │   ├── TooLarge        INVALID_ARGUMENT    (HTTP 413) a body or a count in it over the limits
    │   ├── ReadTimeout     INVALID_ARGUMENT    (HTTP 408) a body that did not arrive in time
    │   ├── NotAcceptable   INVALID_ARGUMENT    (HTTP 404/405/400) no such route or method, a malformed request
    │   └── TaskUnavailable INVALID_ARGUMENT    a task (classify, rerank) the served model has no head for
    ├── FailedPrecondition  FAILED_PRECONDITION valid, but this deployment does not serve it
    ├── NotFound            NOT_FOUND           no such model or version (the KServe v2 front door)
    ├── Overloaded          RESOURCE_EXHAUSTED  queue full; retry after a backoff
    ├── OutOfMemory         RESOURCE_EXHAUSTED  one sequence does not fit in device memory
    ├── DeadlineExceeded    DEADLINE_EXCEEDED   the deadline passed before the work could be done
    │   └── DeadlineUnmeetable DEADLINE_EXCEEDED too little time left on arrival (`min_deadline_ms`)
    ├── NotReady            UNAVAILABLE         loading or warming up
    ├── ShuttingDown        UNAVAILABLE         draining for shutdown
    ├── Unauthenticated     UNAUTHENTICATED     missing or wrong credentials (service/doors/security.py)
    └── ModelFailure        INTERNAL            the model raised; the message carries only a reference id
        └── NonFiniteOutput INTERNAL            NaN/Inf output that no fp32 re-run could mend

Codes are names (`grpc.StatusCode[name]` at the edge) so that this module, and the batcher that
raises these errors, import no grpc. Messages are public: they never hold internals. `status_of`
and `reason_of` walk an error's classes, so a subclass without its own row gets its parent's. A
caller that goes away is not an error of ours: grpcio ends that call CANCELLED (service/doors/calls.py).
"""

from __future__ import annotations

import re
import uuid
from typing import Any


class ServiceError(Exception):
    """Base of every error a caller may see. `str(error)` is the public message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(ServiceError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class NonFiniteInput(InvalidInput):
    pass


class OutputOverflow(InvalidInput):
    """The result is finite, but not in the dtype asked for (FLOAT16 past 65504): service/output_range.py."""


class EmptyInput(InvalidInput):
    """A call with nothing in it (no inputs, no texts): HTTP 400, TEI's error_type `Empty`."""


class TooLarge(InvalidInput):
    """An HTTP body, or a count in it, is over this service's limits: HTTP 413 (service/doors/http/)."""


class ReadTimeout(InvalidInput):
    """An HTTP body did not arrive within `http_read_timeout_s`: HTTP 408."""


class NotAcceptable(InvalidInput):
    """A route or method the HTTP door has not (404, 405), or a malformed HTTP request, as an error of ours."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__("request", message)
        self.status = status


class TaskUnavailable(InvalidInput):
    """A call for a task the served bundle has no head for (manifest tasks: model/heads.py); names the task."""


class FailedPrecondition(ServiceError):
    pass


class NotFound(ServiceError):
    pass


class Overloaded(ServiceError):
    def __init__(self, message: str, retry_after_s: float = 0.1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutOfMemory(ServiceError):
    pass


class DeadlineExceeded(ServiceError):
    pass


class DeadlineUnmeetable(DeadlineExceeded):
    """Refused at the door: the call arrived with less time left than the service needs (counted apart
    from deadlines that pass while the work is queued or running)."""


class NotReady(ServiceError):
    pass


class ShuttingDown(ServiceError):
    pass


class Unauthenticated(ServiceError):
    pass


class ModelFailure(ServiceError):
    """The model failed. `ref` is logged with the traceback; the caller sees only the ref."""

    def __init__(self, what: str = "inference failed", ref: str | None = None) -> None:
        self.ref = ref or uuid.uuid4().hex[:12]
        super().__init__(f"{what} (ref={self.ref})")


class NonFiniteOutput(ModelFailure):
    def __init__(self, ref: str | None = None) -> None:
        super().__init__("non-finite model output", ref)


# The gRPC code of each error type (subclasses not listed take their parent's).
STATUS_OF: dict[type[ServiceError], str] = {
    InvalidInput: "INVALID_ARGUMENT",
    FailedPrecondition: "FAILED_PRECONDITION",
    NotFound: "NOT_FOUND",
    Overloaded: "RESOURCE_EXHAUSTED",
    OutOfMemory: "RESOURCE_EXHAUSTED",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    NotReady: "UNAVAILABLE",
    ShuttingDown: "UNAVAILABLE",
    Unauthenticated: "UNAUTHENTICATED",
    ModelFailure: "INTERNAL",
}

# The `reason` label of attention_failures_total for each error type.
REASON_OF: dict[type[ServiceError], str] = {
    InvalidInput: "invalid_argument",
    NonFiniteInput: "nonfinite_input",
    OutputOverflow: "output_overflow",
    EmptyInput: "empty_input",
    TooLarge: "too_large",
    ReadTimeout: "read_timeout",
    NotAcceptable: "not_acceptable",
    TaskUnavailable: "task_unavailable",
    FailedPrecondition: "failed_precondition",
    NotFound: "not_found",
    Overloaded: "queue_full",
    OutOfMemory: "oom",
    DeadlineExceeded: "deadline",
    DeadlineUnmeetable: "deadline_unmeetable",
    NotReady: "not_ready",
    ShuttingDown: "shutting_down",
    Unauthenticated: "unauthenticated",
    ModelFailure: "model_error",
    NonFiniteOutput: "nonfinite_output",
}


def status_of(error: ServiceError) -> str:
    """The gRPC status code name for `error`."""
    return _lookup(STATUS_OF, error)


def reason_of(error: ServiceError) -> str:
    """The `reason` label of attention_failures_total for `error`."""
    return _lookup(REASON_OF, error)


def _lookup(table: dict[type[ServiceError], str], error: ServiceError) -> str:
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    raise AssertionError(f"{type(error).__name__} is not in the error table. This is a bug.")


_PLAIN = re.compile(r"[A-Za-z0-9_.,:+-]{1,64}")


def shown(value: Any, quote: bool = True) -> str:
    """A caller's value in a message: only when short and plain, so that no request data (a long
    string, a path, control characters) is echoed back."""
    text = str(value)
    if not _PLAIN.fullmatch(text):
        return "(not shown)"
    return repr(text) if quote and isinstance(value, str) else text
