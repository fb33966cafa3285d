"""The client's exception tree, and the one table that maps gRPC status codes onto it.

    ClientError                 any failed call; `.code` is the grpc.StatusCode name
    ├── InvalidArgument         INVALID_ARGUMENT, OUT_OF_RANGE: fix the request (`.field` names the part)
    ├── FailedPrecondition      FAILED_PRECONDITION: valid, but this deployment does not serve it
    ├── Overloaded              RESOURCE_EXHAUSTED: queue full (`.retry_after`) or a message over a size limit
    ├── Unavailable             UNAVAILABLE: not ready, draining, or unreachable; retry (elsewhere)
    ├── DeadlineExceeded        DEADLINE_EXCEEDED: the call's deadline passed
    ├── Cancelled               CANCELLED
    ├── Unauthenticated         UNAUTHENTICATED, PERMISSION_DENIED: credentials missing or wrong
    └── ServerError             INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED, ...: the server failed

The channel already retries UNAVAILABLE and RESOURCE_EXHAUSTED (see `client.channel`); what reaches
the caller has used up those attempts.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class ClientError(Exception):
    """A call failed. `str(error)` is `"CODE: message"`.

    Attributes: `code` (a `grpc.StatusCode` name such as "INVALID_ARGUMENT"), `message` (the
    server's status message), `field` (the offending request field from a `google.rpc.BadRequest`
    detail, else None), `retry_after` (seconds, from a `google.rpc.RetryInfo` detail, else None) and
    `request_id` (set for a failed request of an `encode_stream`).
    """

    def __init__(self, code: str, message: str, *, field: str | None = None, retry_after: float | None = None,
                 request_id: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after
        self.request_id = request_id


class InvalidArgument(ClientError, ValueError):
    """The request is wrong whatever the server's state; `.field` says where. Also raised, before
    anything is sent, for requests the client can tell are malformed (hence also a ValueError)."""


class FailedPrecondition(ClientError):
    """Valid, but this deployment does not serve it (e.g. attention weights switched off)."""


class Overloaded(ClientError):
    """RESOURCE_EXHAUSTED: the server's queue is full (retry after `.retry_after`), or a message is
    over a size limit (see `max_message_bytes`)."""


class Unavailable(ClientError):
    """The server is loading, draining or unreachable."""


class DeadlineExceeded(ClientError):
    """The call's deadline passed (client `timeout`)."""


class Cancelled(ClientError):
    """The call was cancelled."""


class Unauthenticated(ClientError):
    """Credentials are missing or wrong (UNAUTHENTICATED or PERMISSION_DENIED)."""


class ServerError(ClientError):
    """The server failed (INTERNAL and the rest); the message carries a reference id for its log."""


ERROR_OF: dict[str, type[ClientError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument,
    "FAILED_PRECONDITION": FailedPrecondition,
    "RESOURCE_EXHAUSTED": Overloaded,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "CANCELLED": Cancelled,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": Unauthenticated,
}
"""Status code name -> exception class; any other code is a `ServerError`."""


def error_for(code: str, message: str, *, field: str | None = None, retry_after: float | None = None,
              request_id: str = "") -> ClientError:
    """The `ClientError` subclass instance for a status code name."""
    cls = ERROR_OF.get(code, ServerError)
    return cls(code, message, field=field, retry_after=retry_after, request_id=request_id)


def from_rpc_error(error: grpc.RpcError) -> ClientError:
    """Translate a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`), reading the
    `google.rpc.BadRequest` and `google.rpc.RetryInfo` details when the server sent them."""
    code_of = getattr(error, "code", None)
    code = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
    details_of = getattr(error, "details", None)
    message = (details_of() if callable(details_of) else None) or ""
    field: str | None = None
    retry_after: float | None = None
    try:
        status = rpc_status.from_call(error)
    except (ValueError, AttributeError):  # details that disagree with the status, or not a grpc.Call
        status = None
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(bad) and bad.field_violations:
            field = bad.field_violations[0].field
        elif detail.Unpack(retry):
            retry_after = retry.retry_delay.ToNanoseconds() / 1e9
    return error_for(code.name, message, field=field, retry_after=retry_after)
