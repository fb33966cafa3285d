"""A throw-away PKI for the TLS tests, made per test run with the `openssl` command-line tool.

Two CAs (ours and a foreign one), a server certificate for localhost / 127.0.0.1, client
certificates signed by each CA, and expired client and server certificates. EC P-256 keys: fast.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    directory: Path

    def path(self, name: str) -> Path:
        """`name` is one of ca, foreign-ca, server, client, foreign-client, expired-client, expired-server;
        add `.pem` (certificate) or `.key` (private key)."""
        return self.directory / name

    def read(self, name: str) -> bytes:
        return self.path(name).read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr[-1000:]}")


def _key_and_csr(name: str, subject: str, cwd: Path) -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)


def _ca(name: str, cn: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={cn}", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=cwd)


def _sign(name: str, ca: str, extensions: str, days: int, serial: int, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    # -days -1 makes notAfter precede now: an expired certificate.
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-out", f"{name}.pem", "-days", str(days), "-extfile", f"{name}.ext",
             cwd=cwd)


SERVER_EXT = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"
CLIENT_EXT = "extendedKeyUsage=clientAuth"


def make_pki(directory: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    _ca("ca", "attention-test-ca", directory)
    _ca("foreign-ca", "someone-elses-ca", directory)
    for serial, (name, cn, ca, ext, days) in enumerate((
        ("server", "localhost", "ca", SERVER_EXT, 2),
        ("client", "client-a", "ca", CLIENT_EXT, 2),
        ("foreign-client", "client-a", "foreign-ca", CLIENT_EXT, 2),
        ("expired-client", "client-a", "ca", CLIENT_EXT, -1),
        ("expired-server", "localhost", "ca", SERVER_EXT, -1),
    ), start=2):
        _key_and_csr(name, f"/CN={cn}", directory)
        _sign(name, ca, ext, days, serial, directory)
    return Pki(directory)
