"""The server's TLS pair (server.tls_cert_file, server.tls_key_file), loaded and checked before the port is bound.

gRPC only reports a bad pair when the port is added, as a failed bind ("port in use"). Python's ssl module
loads the same PEM files and says which one is wrong: a missing file, a certificate or key that is not PEM,
an encrypted key, or a key that does not belong to the certificate.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from appliance.core.config import ServerSettings
from appliance.core.errors import StartupError

MAKE_A_PAIR = ("Fix: point server.tls_cert_file and server.tls_key_file at a PEM certificate and its unencrypted PEM "
               "private key (e.g. openssl req -x509 -newkey rsa:2048 -nodes -keyout key.pem -out cert.pem "
               "-subj /CN=localhost)")


class TlsError(StartupError):
    """The TLS certificate or key cannot be used."""


def load_tls_pair(server: ServerSettings) -> tuple[bytes, bytes] | None:
    """(private key PEM, certificate chain PEM) for grpc.ssl_server_credentials, or None without TLS."""
    if server.tls_cert_file is None or server.tls_key_file is None:
        return None
    cert, key = Path(server.tls_cert_file), Path(server.tls_key_file)
    for setting, path in (("server.tls_cert_file", cert), ("server.tls_key_file", key)):
        if not path.is_file():
            raise TlsError(f"{setting}={str(path)!r} does not exist or is not a file. {MAKE_A_PAIR}")
    try:
        ssl.create_default_context(cafile=str(cert))
    except ssl.SSLError as exc:
        raise TlsError(f"server.tls_cert_file={str(cert)!r} holds no PEM certificate ({exc.reason or exc}). "
                       f"{MAKE_A_PAIR}") from None

    def refuse_passphrase() -> bytes:   # ssl asks only for an encrypted key (and would prompt on the terminal)
        raise TlsError(f"server.tls_key_file={str(key)!r} is an encrypted private key; gRPC needs an unencrypted "
                       f"one. Fix: decrypt it (openssl pkey -in {key} -out key.pem) and point "
                       f"server.tls_key_file at the result")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key), password=refuse_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"server.tls_key_file={str(key)!r} is not the private key of server.tls_cert_file="
                           f"{str(cert)!r}. Fix: use the key the certificate was issued for") from None
        raise TlsError(f"server.tls_key_file={str(key)!r} holds no usable PEM private key ({exc.reason or exc}). "
                       f"{MAKE_A_PAIR}") from None
    return key.read_bytes(), cert.read_bytes()
