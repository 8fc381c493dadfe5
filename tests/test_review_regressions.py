"""A hostile review of the day's changes (2026-12-01): each test shows one thing they broke, since mended."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading

import httpx
import pytest
from click.testing import CliRunner
from rest_framework.test import APIClient

from gpu_cli import api, config
from gpu_cli.main import cli
from tests.conftest import Clock

# --- gpu CLI: a TLS port that drops a connection is a portal away, not a bad certificate ------------


class DroppingTlsPortal:
    """A TLS portal behind a proxy that passes TLS through (nginx's stream with ssl_preread, an
    ingress): while the portal restarts, the proxy reads the ClientHello and closes the connection.
    The first `drops` connections are dropped so; the next ones answer every GET with `[]`."""

    def __init__(self, tmp_path, drops: int) -> None:
        self.cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
                *("-keyout", str(key), "-out", str(self.cert)),
            ],
            check=True,
            capture_output=True,
        )
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.cert, key)
        self.drops, self.accepted = drops, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drops:
                conn.recv(4096)  # the ClientHello, then gone: no backend to pass it to
                conn.close()
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += tls.recv(4096)
                    tls.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                        b"Connection: close\r\n\r\n[]"
                    )
            except (OSError, ssl.SSLError):
                pass

    def close(self) -> None:
        self.server.close()


def test_gpu_retries_a_tls_connection_dropped_while_the_portal_restarts(tmp_path, monkeypatch):
    """`gpu` tries again for a minute while the portal is away; a TLS connection closed before
    the handshake's answer (SSLEOFError, a passthrough proxy with no portal behind it) is the
    portal away, as a refused connection is. The TLS change gave up on it at once (exit 3)."""
    portal = DroppingTlsPortal(tmp_path, drops=1)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("SSL_CERT_FILE", str(portal.cert))
    # The tests' one cached default context (tests/conftest.py) would not read SSL_CERT_FILE.
    monkeypatch.setattr(httpx._transports.default, "create_ssl_context", httpx._config.create_ssl_context)
    monkeypatch.setenv(config.URL_ENV, portal.url)
    monkeypatch.setenv(config.TOKEN_ENV, "a-token")
    monkeypatch.delenv(api.RETRY_ENV, raising=False)
    clock = Clock()
    monkeypatch.setattr("gpu_cli.api.monotonic", clock)
    monkeypatch.setattr("gpu_cli.api.sleep", lambda s: setattr(clock, "now", clock.now + s))
    try:
        result = CliRunner().invoke(cli, ["status", "--json"], prog_name="gpu")
    finally:
        portal.close()
    assert result.exit_code == 0, result.output


# --- the OpenAPI schema ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_schema_does_not_describe_request_bodies_with_knownfieldsonly_internals(alice):
    """drf-spectacular describes a serializer by its class's docstring, inherited: every body made
    a KnownFieldsOnly (Extend, SessionStart, ChannelCreate …) was described to users, and to the
    clients they generate, as "An input serializer that names a key it has no field for…"."""
    client = APIClient()
    client.force_authenticate(alice)
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    described = {
        name: schema.get("description", "")
        for name, schema in response.json()["components"]["schemas"].items()
        if "An input serializer" in schema.get("description", "")
    }
    assert not described, sorted(described)
