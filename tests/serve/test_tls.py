"""The TLS pair is loaded and checked before the port is bound; each fault names the file and the fix."""

import dataclasses
import shutil
import subprocess

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.errors import StartupError
from appliance.serve.tls import TlsError, load_tls_pair

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make keys")


def make_pair(directory, name):
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    a, b = make_pair(d, "a"), make_pair(d, "b")
    encrypted = d / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(a[1]), "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
                   check=True, capture_output=True)
    der = d / "a.der"
    subprocess.run(["openssl", "x509", "-in", str(a[0]), "-outform", "DER", "-out", str(der)], check=True,
                   capture_output=True)
    return {"a": a, "b": b, "encrypted": encrypted, "der": der, "dir": d}


def server(cert, key):
    rc = load_runtime_config([])
    return dataclasses.replace(rc.server, tls_cert_file=str(cert), tls_key_file=str(key))


def test_a_matching_pair_loads_and_no_tls_is_none(pairs):
    cert, key = pairs["a"]
    assert load_tls_pair(server(cert, key)) == (key.read_bytes(), cert.read_bytes())
    assert load_tls_pair(load_runtime_config([]).server) is None


def fault(cert, key) -> str:
    with pytest.raises(TlsError) as err:
        load_tls_pair(server(cert, key))
    assert isinstance(err.value, StartupError) and "Fix:" in str(err.value)
    return str(err.value)


def test_missing_files_are_named(pairs):
    cert, key = pairs["a"]
    assert f"server.tls_cert_file='{pairs['dir'] / 'nope.crt'}' does not exist" in fault(pairs["dir"] / "nope.crt", key)
    assert f"server.tls_key_file='{pairs['dir'] / 'nope.key'}' does not exist" in fault(cert, pairs["dir"] / "nope.key")


def test_a_key_of_another_certificate_is_a_mismatch(pairs):
    msg = fault(pairs["a"][0], pairs["b"][1])
    assert f"server.tls_key_file='{pairs['b'][1]}' is not the private key of server.tls_cert_file='{pairs['a'][0]}'" \
        in msg


def test_files_that_are_not_pem_are_named(pairs):
    cert, key = pairs["a"]
    assert f"server.tls_cert_file='{pairs['der']}' holds no PEM certificate" in fault(pairs["der"], key)
    assert f"server.tls_cert_file='{key}' holds no PEM certificate" in fault(key, key)         # key given as cert
    assert f"server.tls_key_file='{cert}' holds no usable PEM private key" in fault(cert, cert)  # cert given as key


def test_an_encrypted_key_is_refused_without_prompting(pairs):
    msg = fault(pairs["a"][0], pairs["encrypted"])
    assert f"server.tls_key_file='{pairs['encrypted']}' is an encrypted private key" in msg
