"""Channel construction shared by every client: targets, options, retry policy, TLS, credentials.

Defaults match the server (DESIGN.md, RELIABILITY.md rows 12, 17, 36):
- messages up to 64 MiB both ways (grpc's own receive default is 4 MiB, too small for attention);
- keepalive pings every 30 s, also when idle, with a 10 s timeout (the server permits one per 10 s);
- a retry policy on the AttentionService methods for UNAVAILABLE and RESOURCE_EXHAUSTED, with
  exponential backoff; health checks are not retried, so a probe answers fast;
- `round_robin` over every address a target resolves to (several targets, or a `dns:///` name, e.g.
  a headless Kubernetes Service), with gRPC's client-side health checking: each address is watched
  (`grpc.health.v1.Health/Watch`) on the readiness name `attention.v1.AttentionService`, and only
  SERVING ones get calls, so a warming or draining replica leaves the rotation before it refuses calls.
  A server that does not implement Watch (UNIMPLEMENTED) is treated as healthy. This is on for
  several addresses and `dns:` names, and off for one `host:port` (`wants_health_check`): behind a
  proxy such as Envoy, the proxy health-checks the replicas, and a Watch through it would report
  whichever replica it reached, taking the proxy itself out of rotation when that one drains. Health checks
  themselves go over a second channel without it (`HEALTH_PROBE_OPTIONS`), so that `health()` reaches
  a NOT_SERVING server and reports NOT_SERVING rather than failing with "backend unhealthy".
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from proto.attention.v1.codec import SERVICE_NAME

SERVICE = SERVICE_NAME
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the server's default --max-message-bytes

ChannelOptions = list[tuple[str, Any]]
# For the channel that asks servers their health: it must reach a NOT_SERVING server.
HEALTH_PROBE_OPTIONS: ChannelOptions = [("grpc.inhibit_health_checking", 1)]


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's transparent retries (the `retryPolicy` of the service config), per call.

    Requests bigger than the per-call retry buffer (256 KiB by default) are not retried. CANCELLED is
    retried too: a call that reaches a draining server in the instant its gRPC server stops is cancelled
    by grpcio's core before any handler sees it (it never ran; the server's ledger does not count it), and
    every AttentionService call is a pure function of its request. gRPC never retries a call that its
    caller cancelled.
    """

    max_attempts: int = 4  # the first try included; grpc caps this at 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED")

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts must be 2..5; got {self.max_attempts}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s <= 0 or self.backoff_multiplier <= 0:
            raise ValueError(f"backoffs and multiplier must be > 0; got {self}")


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True)
class TLS:
    """TLS settings: PEM bytes. No root certificate means the system's roots. A client certificate
    and key together turn on mutual TLS; `server_name` overrides the name checked in the server's
    certificate (for tests and IP targets)."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both a client certificate chain and its private key")

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None,
                   server_name: str | None = None) -> TLS:
        """Read PEM files: `ca` (roots), `cert` and `key` (client identity for mTLS)."""

        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def service_config(retry: RetryPolicy | None = DEFAULT_RETRY, *, health_check: bool = True) -> str:
    """The service config JSON: round_robin balancing, over the addresses whose readiness is SERVING
    with `health_check` (client-side health checking), and the retry policy on AttentionService."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE}
    if retry is not None:
        config["methodConfig"] = [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": retry.max_attempts,
                "initialBackoff": f"{retry.initial_backoff_s}s",
                "maxBackoff": f"{retry.max_backoff_s}s",
                "backoffMultiplier": retry.backoff_multiplier,
                "retryableStatusCodes": list(retry.codes),
            },
        }]
    return json.dumps(config)


def wants_health_check(target: str) -> bool:
    """Client-side health checking by default: for several addresses (`ipv4:a,b`) and `dns:` names,
    where the client itself balances over servers, not for one `host:port` (a server or a proxy)."""
    if target.startswith("dns:"):
        return True
    if target.startswith(("ipv4:", "ipv6:")):
        return "," in target
    return False


def channel_options(*, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, retry: RetryPolicy | None = DEFAULT_RETRY,
                    tls: TLS | None = None, health_check: bool = False,
                    extra: Sequence[tuple[str, Any]] = ()) -> ChannelOptions:
    """Channel arguments for `grpc.[aio.]{insecure,secure}_channel`; `extra` entries win. The clients
    pass `health_check=wants_health_check(target)`; off by default here, so a channel built from
    these options reaches a NOT_SERVING server unless asked otherwise."""
    options: ChannelOptions = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # RELIABILITY.md row 36: the server accepts a ping every 10 s, also without calls;
        # 30 s leaves room, and a dead peer is noticed within 40 s.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # grpc's default (2) stops the pings of an idle channel after two; keep them going.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1 if retry is not None else 0),
        ("grpc.service_config", service_config(retry, health_check=health_check)),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    overridden = {key for key, _ in extra}
    return [(k, v) for k, v in options if k not in overridden] + list(extra)


def resolve_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one or several servers.

    - `"host:port"`, `"dns:///name:port"` and any other gRPC URI pass through unchanged;
    - several addresses (a list, or one comma-separated string) become `ipv4:a:p,b:p` (or
      `ipv6:[a]:p,...`); host names among them are resolved here, once. Use a `dns:///` name for
      a set that changes while the client runs.
    """
    targets = [t.strip() for t in target.split(",")] if isinstance(target, str) else [t.strip() for t in target]
    targets = [t for t in targets if t]
    if not targets:
        raise ValueError("no target given")
    if len(targets) == 1:
        return targets[0]
    for t in targets:
        if "://" in t or t.startswith(("ipv4:", "ipv6:", "unix:")):
            raise ValueError(f"several targets must be plain host:port addresses; got {t!r}")
    addresses = [address for t in targets for address in _addresses(t)]
    families = {a.version for a, _ in addresses}
    if len(families) > 1:
        raise ValueError(f"cannot mix IPv4 and IPv6 addresses in one channel: {targets}")
    if families == {4}:
        return "ipv4:" + ",".join(f"{a}:{port}" for a, port in addresses)
    return "ipv6:" + ",".join(f"[{a}]:{port}" for a, port in addresses)


def _addresses(target: str) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    host, sep, port_text = target.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"target {target!r} must be host:port")
    port = int(port_text)
    host = host.strip("[]")
    try:
        return [(ipaddress.ip_address(host), port)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from None
    seen: dict[str, None] = {}
    for info in infos:
        seen.setdefault(str(info[4][0]), None)
    return [(ipaddress.ip_address(a), port) for a in seen]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata: `authorization: Bearer <token>` when a token is set (sent over plaintext
    too, so that a TLS-terminating proxy in front of the server can check it)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_aio_channel(target: str, tls: TLS | None, options: ChannelOptions) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def open_sync_channel(target: str, tls: TLS | None, options: ChannelOptions) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)
