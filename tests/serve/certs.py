"""A self-signed certificate for localhost made with the openssl command (TLS tests of both front ends)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command to make a certificate")


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """(key.pem, cert.pem) in `directory`, valid one day for DNS:localhost."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert
