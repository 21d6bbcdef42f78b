"""Test certificates made with `openssl`: a CA, a server certificate for loopback, client certificates.

Every key is written private (0600), as `tessera-data serve` and the client demand of key files.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its private key."""

    cert: Path
    key: Path


def make_ca(folder: Path, name: str) -> Pair:
    """A self-signed CA `name` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = Pair(folder / f"{name}.pem", folder / f"{name}.key")
    _openssl("req", "-x509", *_EC, "-keyout", ca.key, "-out", ca.cert, "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    os.chmod(ca.key, 0o600)
    return ca


def issue(ca: Pair, folder: Path, name: str, usage: str) -> Pair:
    """A certificate `name` signed by `ca`; usage `serverAuth` (for 127.0.0.1 and localhost) or `clientAuth`."""
    pair, csr, ext = Pair(folder / f"{name}.pem", folder / f"{name}.key"), folder / f"{name}.csr", folder / f"{name}.ext"
    _openssl("req", *_EC, "-keyout", pair.key, "-out", csr, "-subj", f"/CN={name}")
    lines = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if usage == "serverAuth":
        lines.append("subjectAltName=IP:127.0.0.1,DNS:localhost")
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial", "-out", pair.cert,
             "-days", "2", "-extfile", ext)
    os.chmod(pair.key, 0o600)
    return pair
