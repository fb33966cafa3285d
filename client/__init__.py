"""Client library for the attention encoder service (numpy in, numpy out; no torch needed).

    from client import EncoderClient, SyncEncoderClient, ClientError

`attention-client --help` (or `python -m client --help`) is the command-line tool; `python -m client.health`
the probe. Installed alone with `pip install ./client` (docs/client.md).
"""

from client.channel import TLS, RetryPolicy, channel_options, resolve_target, service_config
from client.client import EncoderClient, SyncEncoderClient
from client.errors import (
    Cancelled,
    ClientError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Overloaded,
    ServerError,
    Unauthenticated,
    Unavailable,
)
from client.messages import (
    BatchBudget,
    Classification,
    EncodeOptions,
    EncodeResult,
    Limits,
    ModelInfo,
    RankedText,
    ResponseMetadata,
    SparseOptions,
    SparseVector,
    StreamRequest,
    TextInfo,
    Tokenized,
)

__all__ = [
    "TLS",
    "BatchBudget",
    "Cancelled",
    "Classification",
    "ClientError",
    "DeadlineExceeded",
    "EncodeOptions",
    "EncodeResult",
    "EncoderClient",
    "FailedPrecondition",
    "InvalidArgument",
    "Limits",
    "ModelInfo",
    "Overloaded",
    "RankedText",
    "ResponseMetadata",
    "RetryPolicy",
    "ServerError",
    "StreamRequest",
    "SparseOptions",
    "SparseVector",
    "SyncEncoderClient",
    "TextInfo",
    "Tokenized",
    "Unauthenticated",
    "Unavailable",
    "channel_options",
    "resolve_target",
    "service_config",
]
