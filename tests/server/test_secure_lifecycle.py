"""One server process through its whole life, with TLS and a bearer token: NOT_SERVING while
loading, auth rejected and accepted, a TLS round trip, the concurrency limit, then a graceful
shutdown that drains a stream in flight. Tests run in file order on the same process."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from espalier_client import (
    Client,
    DeadlineExceededError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model

TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A P-256 certificate for 127.0.0.1 / localhost, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "espalier-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secure(certs: tuple[Path, Path]) -> Iterator[ServerProcess]:
    cert, key = certs
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--auth-token", TOKEN]
    limits = ["--max-concurrent", "1", "--shutdown-grace", "300", "--compile-timeout", "0.001"]
    with ServerProcess(*args, *limits) as srv:
        yield srv


def health(srv: ServerProcess, cert: Path) -> int:
    """Health over TLS without a token (health checks are exempt from auth)."""
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(srv.address, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service="espalier.v1.Espalier"), timeout=60
        )
        return int(reply.status)


def client(srv: ServerProcess, cert: Path, token: str | None = TOKEN) -> Client:
    return Client(
        srv.address, token=token, root_certificates=cert.read_bytes(), timeout_s=600, max_retries=0
    )


def test_not_serving_while_the_model_loads(secure: ServerProcess, certs: tuple[Path, Path]) -> None:
    assert not secure.has_event("serving")  # the tokenizer alone takes many seconds
    assert health(secure, certs[0]) == NOT_SERVING


def test_plaintext_is_refused_on_the_tls_port(secure: ServerProcess) -> None:
    plain = Client(secure.address, token=TOKEN, timeout_s=20, max_retries=0)
    with plain, pytest.raises(UnavailableError):
        plain.model_info()


def test_auth_rejects_a_missing_or_wrong_token(
    secure: ServerProcess, certs: tuple[Path, Path]
) -> None:
    for token in (None, "wrong"):
        with client(secure, certs[0], token) as c, pytest.raises(UnauthenticatedError):
            c.model_info()
    with client(secure, certs[0]) as c:
        info = c.model_info()  # the model's context caps the limit once it is known
        context = info.max_context_tokens
        assert info.max_prompt_tokens == (min(8192, context - 1) if context else 8192)


def test_serving_after_load_and_a_tls_round_trip(
    secure: ServerProcess, certs: tuple[Path, Path]
) -> None:
    if not secure.wait_loaded():
        pytest.skip("the engine is not available")
    assert health(secure, certs[0]) == SERVING
    with client(secure, certs[0]) as c:
        result = c.generate("Hello", max_tokens=5, ignore_eos=True)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


def test_compile_timeout_is_deadline_exceeded(
    secure: ServerProcess, certs: tuple[Path, Path]
) -> None:
    # This server's compile limit is 1 ms: no compile of a fresh grammar finishes in time.
    with client(secure, certs[0]) as c, pytest.raises(DeadlineExceededError) as info:
        c.compile_grammar(regex="[0-9]{3}-[a-z]{2}", backend="llguidance")
    assert info.value.reason == "COMPILE_TIMEOUT"
    assert info.value.metadata["timeout_seconds"] == "0.001"


def test_the_concurrency_limit_is_resource_exhausted(
    secure: ServerProcess, certs: tuple[Path, Path]
) -> None:
    if not secure.wait_loaded():
        pytest.skip("the engine is not available")
    with client(secure, certs[0]) as c:
        stream = c.stream("Hello", max_tokens=4000, ignore_eos=True)
        assert not next(stream).finished  # the one allowed request is in flight
        with pytest.raises(ResourceExhaustedError) as info:
            c.generate("Hello", max_tokens=2)
        stream.close()
    assert info.value.reason == "QUEUE_FULL" and info.value.retry_delay_s is not None


def test_graceful_shutdown_drains_the_stream_in_flight(
    secure: ServerProcess, certs: tuple[Path, Path]
) -> None:
    if not secure.wait_loaded():
        pytest.skip("the engine is not available")
    with client(secure, certs[0]) as c:
        # The limit is 1: wait until the cancelled stream of the previous test has been released.
        for _ in range(600):
            try:
                c.generate("Hi", max_tokens=1)
                break
            except ResourceExhaustedError:
                continue
        stream = c.stream("Hello", max_tokens=2000, ignore_eos=True)
        chunks = [next(stream)]
        secure.proc.send_signal(15)  # SIGTERM
        secure.wait_event("draining")
        assert health(secure, certs[0]) == NOT_SERVING
        with pytest.raises(UnavailableError) as info:
            c.generate("Hello", max_tokens=2)
        assert info.value.reason == "DRAINING"
        chunks.extend(stream)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert sum(len(ch.token_ids) for ch in chunks) == 2000
    assert secure.proc.wait(timeout=300) == 0
    assert secure.has_event("stopped")
