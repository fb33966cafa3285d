"""Transport security and caller authentication: TLS / mutual-TLS server credentials from the config,
and an optional bearer-token check that runs before anything else on the port.

Token rules (grpc doc/server_side_auth.md; RFC 6750): a call must carry exactly one `authorization`
metadata entry, `Bearer <token>` (scheme case-insensitive), whose token equals one of the configured
tokens. Every entry is looked at, wherever it sits in the metadata; two entries are refused rather
than picking one. Tokens are compared as SHA-256 digests with `hmac.compare_digest` against every
configured token (no early exit), so timing reveals neither a token nor how much of it matched.
Every refusal is UNAUTHENTICATED with one identical message; only the metric label tells why.
Health checks are exempt, so probes work without credentials. Tokens are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from service.config import ServiceConfig
from service.errors import Unauthenticated, status_of
from service.metrics import Metrics

log = logging.getLogger(__name__)

UNAUTHENTICATED = Unauthenticated("missing or invalid credentials")  # one message for every refusal
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
REASONS = ("missing", "invalid", "scheme", "duplicate")


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None for plaintext. With `tls_client_ca`, mutual TLS:
    a client without a certificate signed by that CA fails the handshake (no handler runs)."""
    if not config.tls:
        return None
    key = Path(config.tls_key).read_bytes()
    chain = Path(config.tls_cert).read_bytes()
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def load_tokens(config: ServiceConfig) -> list[str]:
    """The accepted bearer tokens: the environment's plus the file's. Empty = authentication off."""
    tokens = list(config.auth_token_list)
    if config.auth_tokens_file:
        lines = Path(config.auth_tokens_file).read_text(encoding="utf-8").splitlines()
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError("auth_tokens_file holds no tokens; refusing to start with authentication unset")
        for i, token in enumerate(from_file, 1):
            if not token.isascii() or not token.isprintable() or " " in token:
                raise ValueError(f"auth_tokens_file: token on non-comment line {i} must be printable ASCII, no spaces")
        tokens += from_file
    return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenChecker:
    """Decides whether a call's metadata carries one valid bearer token."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("TokenChecker needs at least one token")
        self._digests = [_digest(t) for t in tokens]

    def __len__(self) -> int:
        return len(self._digests)

    def refusal(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """None when the metadata authenticates the call, else the reason (a metric label)."""
        values = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if not values:
            return "missing"
        if len(values) > 1:
            return "duplicate"
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        scheme, _, token = str(value).strip().partition(" ")
        if scheme.lower() != "bearer":
            return "scheme"
        presented = _digest(token.strip())
        ok = False
        for digest in self._digests:  # all of them, every time
            ok |= hmac.compare_digest(digest, presented)
        return None if ok else "invalid"


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode[status_of(UNAUTHENTICATED)], UNAUTHENTICATED.message)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The outermost interceptor: an unauthenticated call is answered before any handler runs."""

    def __init__(self, checker: TokenChecker, metrics: Metrics) -> None:
        self._checker = checker
        self.failures = metrics.auth_failures
        for reason in REASONS:
            self.failures.labels(reason)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(EXEMPT_PREFIXES):
            return await continuation(details)
        reason = self._checker.refusal(details.invocation_metadata)
        if reason is None:
            return await continuation(details)
        self.failures.labels(reason).inc()
        # A stream-stream handler runs at once for every kind of call (it reads no request first),
        # and it is the same for known and unknown methods: nothing is revealed before authentication.
        return grpc.stream_stream_rpc_method_handler(_refuse)
