"""Health probe: `python -m client.health --target HOST:PORT` exits 0 when SERVING, 1 otherwise.

Prints one line ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNAVAILABLE: ..."). The default
service is the AttentionService readiness name: SERVING only once the model is warm. Used by the
Docker HEALTHCHECK; no retries, one deadline.
"""

from __future__ import annotations

import argparse
import sys

from client._args import add_connection_arguments, tls_of, token_of
from client.channel import SERVICE, TLS
from client.client import SyncEncoderClient
from client.errors import ClientError


def probe(target: str, service: str = SERVICE, timeout: float = 2.0, tls: TLS | None = None,
          token: str | None = None) -> tuple[bool, str]:
    """(serving?, one-line status) of `service` at `target`; never raises for an RPC failure."""
    try:
        with SyncEncoderClient(target, timeout=timeout, tls=tls, token=token, retry=None) as client:
            status = client.health(service)
    except ClientError as exc:
        return False, f"{exc.code}: {exc.message}"
    return status == "SERVING", status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", default=SERVICE,
                        help=f"grpc.health.v1 service name ('' = the process) [default {SERVICE}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.health", description=__doc__.splitlines()[0])
    add_connection_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    serving, line = probe(args.target, args.service, args.timeout or 2.0, tls_of(args), token_of(args))
    print(line)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
