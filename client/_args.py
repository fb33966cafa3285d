"""Command-line flags shared by `python -m client` and `python -m client.health`."""

from __future__ import annotations

import argparse

from client.channel import TLS


class UsageError(Exception):
    """Bad flags or input file; exit code 2."""


def add_connection_arguments(parser: argparse.ArgumentParser, *, default: object = None) -> None:
    """--target, --timeout and the TLS/token flags; `default=argparse.SUPPRESS` on sub-parsers."""

    def d(value: object) -> object:
        return value if default is None else default

    parser.add_argument("--target", default=d("127.0.0.1:50051"),
                        help="host:port, several comma-separated, or a gRPC URI such as dns:///name:port "
                             "[default 127.0.0.1:50051]")
    parser.add_argument("--timeout", type=float, default=d(None),
                        help="deadline of each call, seconds [default 30; health 2]")
    parser.add_argument("--tls", action="store_true", default=d(False), help="use TLS (system roots unless --ca)")
    parser.add_argument("--ca", default=d(None), help="PEM file of root certificates (implies --tls)")
    parser.add_argument("--cert", default=d(None), help="client certificate chain PEM, for mutual TLS")
    parser.add_argument("--key", default=d(None), help="client private key PEM, for mutual TLS")
    parser.add_argument("--server-name", default=d(None), help="TLS server name to verify instead of the host")
    parser.add_argument("--token-file", default=d(None),
                        help="file holding a bearer token, sent as 'authorization: Bearer <token>'")


def tls_of(args: argparse.Namespace) -> TLS | None:
    if not (args.tls or args.ca or args.cert or args.key):
        return None
    return TLS.from_files(args.ca, args.cert, args.key, args.server_name)


def token_of(args: argparse.Namespace) -> str | None:
    if not args.token_file:
        return None
    with open(args.token_file) as f:
        return f.read().strip() or None
