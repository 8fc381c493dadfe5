"""DNS rebinding against channels (issue 30, item 3), performed against the real sender.

A member's name answers a public address to the portal's check and 127.0.0.1 to the lookup that
connects; `socket.getaddrinfo` is patched to be that name's DNS server (every other name resolves
as usual), and a real HTTP server on 127.0.0.1 plays the service inside the portal's network.
apprise, requests and urllib3 run unchanged: only where the name resolves is made up.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import apprise.apprise
import pytest
import requests
import urllib3.util.connection
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from rest_framework.test import APIClient

from portal import channel_hosts
from portal.channels import channel_create, channel_deliver, channel_test
from portal.errors import Invalid
from portal.models import ChannelDelivery, Notification, NotificationChannel
from portal.notifications import notification_send

pytestmark = pytest.mark.django_db

NAME = "hooks.rebind.test"  # the member's name (.test: never a real one)
KEY = "s3cretKey0123"  # a webhook's path: its secret, masked in what the portal keeps
PUBLIC = "1.2.3.4"  # what it answers the check: public, and nothing of ours listens there


class Dns:
    """The member's DNS server for the names in `answers`: each lookup takes the next answer (the
    last one stays); None answers "no such name". Every other name resolves as usual."""

    def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.answers: dict[str, list[str | None]] = {}
        self.lookups: list[str] = []

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):  # type: ignore[no-untyped-def]
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.answers:
            return self.real(host, port, family, type, proto, flags)
        self.lookups.append(name)
        queue = self.answers[name]
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        if address is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        port = int(port or 0)
        if ipaddress.ip_address(address).version == 4:
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port, 0, 0))]


@pytest.fixture
def dns(monkeypatch) -> Dns:
    resolver = Dns(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    return resolver


class Inside(ThreadingHTTPServer):
    """A service only the portal's host can reach: keeps every request's path and Host header."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        super().__init__((address, 0), _InsideHandler)
        self.requests: list[dict] = []
        self.server_names: list[str | None] = []  # TLS: the SNI each handshake carried

    @property
    def port(self) -> int:
        return self.server_address[1]


class _InsideHandler(BaseHTTPRequestHandler):
    server: Inside

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append({"path": self.path, "host": self.headers["Host"], "body": body})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _serving(server: Inside) -> Iterator[Inside]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def inside() -> Iterator[Inside]:
    with _serving(Inside()) as server:
        yield server


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch) -> None:
    """The public address the check is answered is never really connected to: no packet of these
    tests leaves the machine. A connection there is refused as an unreachable host would be."""
    real = socket.socket.connect

    def connect(sock, address):  # type: ignore[no-untyped-def]
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            raise ConnectionRefusedError(f"tests connect to loopback only, not {host}")
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture(autouse=True)
def _fast(settings, monkeypatch) -> None:
    settings.CHANNEL_TIMEOUT_SECONDS = 1
    settings.CHANNEL_RETRIES = 0
    settings.CHANNEL_TEST_EVERY_SECONDS = 0
    settings.CHANNEL_ALLOWED_HOSTS = []
    settings.PORTAL_URL = "https://gpus.lab.example"
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
        monkeypatch.delenv(proxy.lower(), raising=False)


def _api(user) -> APIClient:  # type: ignore[no-untyped-def]
    client = APIClient()
    client.force_authenticate(user)
    return client


# --- the attack -----------------------------------------------------------------------------------


def test_send_a_test_never_reaches_inside_when_the_name_answers_inside_next(alice, dns, inside):
    dns.answers[NAME] = [PUBLIC]
    answer = _api(alice).post(
        "/api/v1/notification-channels/", {"url": f"json://{NAME}:{inside.port}/{KEY}"}, format="json"
    )
    assert answer.status_code == 201  # public, when it was added
    dns.answers[NAME] = [PUBLIC, "127.0.0.1"]  # public to the check, loopback to whoever asks next
    dns.lookups.clear()

    tested = _api(alice).post(f"/api/v1/notification-channels/{answer.json()['id']}/test/").json()

    assert inside.requests == []
    assert dns.lookups == [NAME]  # once: no second lookup for apprise to get 127.0.0.1 from
    assert tested["ok"] is False
    assert f"{NAME} was looked up once, and sent to only as it answered then: {PUBLIC}" in tested["detail"]


def test_a_notification_never_reaches_inside_when_the_name_answers_inside_next(
    alice, dns, inside, monkeypatch, django_capture_on_commit_callbacks
):
    dns.answers[NAME] = [PUBLIC]
    channel = channel_create(by=alice, url=f"json://{NAME}:{inside.port}/{KEY}")
    queued: list[int] = []
    monkeypatch.setattr("portal.channels.channel_deliver.apply_async", lambda args: queued.append(args[0]))
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Notification.Kind.INTRUDER, subject="a", body="b")
    dns.answers[NAME] = [PUBLIC, "127.0.0.1"]
    dns.lookups.clear()

    assert channel_deliver.apply(args=queued).get() == ChannelDelivery.Status.FAILED

    assert inside.requests == [] and dns.lookups == [NAME]
    delivery = ChannelDelivery.objects.get()
    assert f"sent to only as it answered then: {PUBLIC}" in delivery.last_error
    channel.refresh_from_db()
    assert channel.last_error == delivery.last_error


def test_a_name_that_is_not_found_at_the_send_and_answers_inside_next_reaches_nothing(
    alice, dns, inside, settings, monkeypatch, django_capture_on_commit_callbacks
):
    """ntfy and Matrix once went ahead when their host could not be found (a token in the host's
    place): apprise then looked the name up itself, and got what the member's DNS answered then."""
    dns.answers[NAME] = [PUBLIC]
    channel = channel_create(by=alice, url=f"ntfy://{NAME}:{inside.port}/topic")
    dns.answers[NAME] = [None, "127.0.0.1"]
    dns.lookups.clear()

    ok, reason = channel_test(channel=channel, by=alice)

    assert not ok and inside.requests == [] and dns.lookups == [NAME]
    assert reason == f"The host {NAME} cannot be found; check its name."
    # A delivery tries a name not found again later (DNS may be down), and checks it again then.
    settings.CHANNEL_RETRIES = 2
    queued: list[int] = []
    monkeypatch.setattr("portal.channels.channel_deliver.apply_async", lambda args: queued.append(args[0]))
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Notification.Kind.INTRUDER, subject="a", body="b")
    dns.answers[NAME] = [None, "127.0.0.1"]
    assert channel_deliver.apply(args=queued).get() == ChannelDelivery.Status.FAILED  # retries at once
    delivery = ChannelDelivery.objects.get()
    assert delivery.attempts == 2 and "inside the portal's own network (127.0.0.1)" in delivery.last_error
    assert inside.requests == []


def test_a_host_that_cannot_be_found_is_refused_when_added(alice, dns):
    dns.answers[NAME] = [None]
    with pytest.raises(Invalid, match=f"The host {NAME} cannot be found; check its name.") as refused:
        channel_create(by=alice, url=f"ntfys://{NAME}/topic")
    assert refused.value.field == "url" and not NotificationChannel.objects.exists()


# --- the pin ------------------------------------------------------------------------------------------


def test_the_send_connects_to_the_address_checked_with_the_name_as_host(alice, dns, inside, settings):
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.0/8"]  # in-house: the receiver is on loopback
    dns.answers[NAME] = ["127.0.0.1"]
    channel = channel_create(by=alice, url=f"json://{NAME}:{inside.port}/{KEY}")
    dns.answers[NAME] = ["127.0.0.1", "127.0.0.2"]  # a second lookup would go elsewhere (no one there)
    dns.lookups.clear()

    assert channel_test(channel=channel, by=alice) == (True, "")

    (request,) = inside.requests
    assert request["host"] == f"{NAME}:{inside.port}" and request["path"] == f"/{KEY}"
    assert json.loads(request["body"])["title"] == "Test from the GPU lab portal"
    assert dns.lookups == [NAME]  # the whole send: one lookup


def test_a_name_the_admin_lists_is_resolved_as_usual(alice, dns, inside, settings):
    settings.CHANNEL_ALLOWED_HOSTS = [NAME]
    dns.answers[NAME] = ["127.0.0.1"]
    channel = channel_create(by=alice, url=f"json://{NAME}:{inside.port}/{KEY}")
    assert dns.lookups == []  # allowed by name: not even looked up to be added
    assert channel_test(channel=channel, by=alice) == (True, "")
    assert inside.requests[0]["host"] == f"{NAME}:{inside.port}"


def test_a_proxy_from_the_environment_is_refused_not_asked(alice, dns, inside, settings, monkeypatch):
    """A proxy would look the name up again on its side: a pinned send connects to nothing else."""
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.1"]
    dns.answers[NAME] = ["127.0.0.1"]
    channel = channel_create(by=alice, url=f"json://{NAME}:{inside.port}/{KEY}")
    monkeypatch.setenv("HTTP_PROXY", f"http://localhost:{inside.port}")

    ok, reason = channel_test(channel=channel, by=alice)

    assert not ok and inside.requests == []
    assert f"Refused to connect to localhost: this channel connects to {NAME} only" in reason
    assert f"add {NAME} to NO_PROXY" in reason


def test_the_pin_holds_in_the_sending_context_only(alice, dns, inside, settings):
    dns.answers[NAME] = ["127.0.0.1"]
    pin = channel_hosts.Pin("other.rebind.test", ((socket.AF_INET, (PUBLIC, 0)),))
    reached: list[int] = []

    def post_from_another_thread() -> None:
        reached.append(requests.post(f"http://{NAME}:{inside.port}/other", timeout=5).status_code)

    with channel_hosts.sending_to(pin):
        with pytest.raises(OSError, match=f"Refused to connect to {NAME}"):
            urllib3.util.connection.create_connection((NAME, inside.port), timeout=1)
        thread = threading.Thread(target=post_from_another_thread)  # started while pinned
        thread.start()
        thread.join(10)
    assert reached == [200] and dns.lookups == [NAME]  # it looked the name up itself, as usual
    assert [r["path"] for r in inside.requests] == ["/other"]

    # After a real pinned send, apprise's pool threads (which ran it) keep no pin either.
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.1"]
    channel = channel_create(by=alice, url=f"json://127.0.0.1:{inside.port}/{KEY}")
    assert channel_test(channel=channel, by=alice) == (True, "")
    pool = apprise.apprise.get_shared_executor()
    futures = [pool.submit(post_from_another_thread) for _ in range(4)]
    for future in futures:
        future.result(timeout=10)
    assert reached == [200] * 5
    with pytest.raises(OSError, match="Refused"), channel_hosts.sending_to(pin):
        urllib3.util.connection.create_connection((NAME, inside.port), timeout=1)
    urllib3.util.connection.create_connection((NAME, inside.port), timeout=1).close()  # and reset


# --- https: the name stays the TLS name ------------------------------------------------------------


def _certificate(subject: x509.Name, issuer: x509.Name, key, signer, *, ca: bool, names=()):  # type: ignore[no-untyped-def]
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, Path]:
    """A test CA (its PEM is what requests trusts here) and two server certificates it signed: one
    for NAME, one for 127.0.0.1 only (the address a send connects to)."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rebinding test CA")])
    ca = _certificate(ca_name, ca_name, ca_key, ca_key, ca=True)
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths = {"ca": folder / "ca.pem"}
    for label, san in (
        ("name", x509.DNSName(NAME)),
        ("address", x509.IPAddress(ipaddress.ip_address("127.0.0.1"))),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
        cert = _certificate(subject, ca_name, key, ca_key, ca=False, names=[san])
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        (folder / f"{label}.pem").write_bytes(pem)
        paths[label] = folder / f"{label}.pem"
    return paths


def _tls_inside(certificate: Path) -> Inside:
    server = Inside()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificate)
    context.sni_callback = lambda sock, name, ctx: server.server_names.append(name)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


@pytest.mark.parametrize("certificate, delivered", [("name", True), ("address", False)])
def test_an_https_send_keeps_the_name_for_sni_and_the_certificate(
    alice, dns, settings, monkeypatch, tls, certificate, delivered
):
    """Connected to 127.0.0.1, the TLS name is still NAME: its certificate is accepted, and one
    for 127.0.0.1 alone is refused (the address never stands in for the name)."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls["ca"]))
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.1"]
    dns.answers[NAME] = ["127.0.0.1"]
    with _serving(_tls_inside(tls[certificate])) as server:
        channel = channel_create(by=alice, url=f"jsons://{NAME}:{server.port}/{KEY}")
        ok, _ = channel_test(channel=channel, by=alice)
        assert server.server_names == [NAME] and dns.lookups == [NAME, NAME]  # added, sent
        if delivered:
            assert ok and [r["host"] for r in server.requests] == [f"{NAME}:{server.port}"]
        else:
            assert not ok and server.requests == []


# --- IPv6 forms that carry an inside IPv4 address ------------------------------------------------


INSIDE_V6 = [
    ("::7f00:1", "an IPv4-compatible IPv6 address of 127.0.0.1"),
    ("::a9fe:a9fe", "an IPv4-compatible IPv6 address of 169.254.169.254"),
    ("64:ff9b::7f00:1", "a NAT64 address of 127.0.0.1"),
    ("64:ff9b::a01:203", "a NAT64 address of 10.1.2.3"),
    ("64:ff9b:1::808:808", "a local-use NAT64 address"),
    ("2002:7f00:1::1", "a 6to4 address of 127.0.0.1"),
    ("2002:c0a8:105::1", "a 6to4 address of 192.168.1.5"),
    ("::ffff:127.0.0.1", "an IPv4-mapped address of 127.0.0.1"),
    ("::ffff:a9fe:a9fe", "an IPv4-mapped address of 169.254.169.254"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "a Teredo address of 192.0.2.45"),
]


@pytest.mark.parametrize("address, form", INSIDE_V6)
def test_an_ipv6_form_carrying_an_inside_address_is_refused(alice, dns, address, form):
    dns.answers[NAME] = [address]
    for url in (f"json://{NAME}/{KEY}", f"json://[{address}]/{KEY}"):
        answer = _api(alice).post("/api/v1/notification-channels/", {"url": url}, format="json")
        assert answer.status_code == 400
        (message,) = answer.json()["errors"]["url"]
        assert f", {form})" in message and "CHANNEL_ALLOWED_HOSTS" in message
    assert not NotificationChannel.objects.exists()


def test_an_ipv6_form_that_turns_up_at_the_send_is_refused_there(alice, dns, inside):
    dns.answers[NAME] = [PUBLIC]
    channel = channel_create(by=alice, url=f"json://{NAME}:{inside.port}/{KEY}")
    dns.answers[NAME] = ["::ffff:127.0.0.1"]
    ok, reason = channel_test(channel=channel, by=alice)
    assert not ok and inside.requests == [] and "an IPv4-mapped address of 127.0.0.1" in reason


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "2606:4700::1111", "64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8"]
)
def test_a_public_address_in_any_form_is_public(address):
    assert channel_hosts.address_is_public(address)


@pytest.mark.parametrize(
    "address", ["::1", "::", "fe80::1%eth0", "fc00::1", "224.0.0.1", "ff0e::1", "100.64.0.1"]
)
def test_other_inside_addresses_are_not_public(address):
    assert not channel_hosts.address_is_public(address)
