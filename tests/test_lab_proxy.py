"""/sessions/<id>/lab/…: the portal's proxy to a JupyterLab session's server (jobs/lab_proxy.py).

portal.asgi runs under a real uvicorn (tests/asgi_server.py); the "Jupyter server" is FakeJupyter,
a tiny ASGI app under another uvicorn, which records every request it gets and echoes what it
was sent (the Authorization and Cookie headers above all). "Upstream never contacted" is read
from that record: the proxy answers a refusal before it connects, so an empty record after the
answer is proof, not a hope.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from django.test import Client
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from jobs.lab_proxy import Scrubber, Verdict, check, close_code
from jobs.models import InteractiveSession
from tests.asgi_server import asgi_server, serve
from tests.conftest import free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "secret-token-xyz"
KERNEL_PROTOCOL = "v1.kernel.websocket.jupyter.org"


class FakeJupyter:
    """A stand-in Jupyter server: HTTP under /sessions/<id>/lab/ and a websocket that echoes.

    - `…/echo`: JSON of what it got (method, raw path, query, headers, body length and hash);
    - `…/page`: a page with the token in it (as Jupyter's page config has), in a header too,
      and cookies, one named as the portal's session cookie;
    - `…/big?mb=N`: N MiB in 64 KiB chunks;
    - a websocket anywhere: first a JSON text frame of its handshake's headers, then each frame
      back as it came; the text "close 4321" closes it with that code.
    """

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []  # every request, websocket or not
        self.closes: list[int | None] = []  # close codes the websockets got from the proxy

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] not in ("http", "websocket"):
            return
        headers = {name.decode(): value.decode() for name, value in scope["headers"]}
        self.seen.append({"type": scope["type"], "raw_path": scope["raw_path"].decode(), "headers": headers})
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, headers)
        else:
            await self._http(scope, receive, send, headers)

    async def _http(self, scope: dict, receive, send, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
        digest, size = hashlib.sha256(), 0
        while True:
            message = await receive()
            digest.update(message.get("body", b""))
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path.endswith("/page"):
            body = f'<script id="jupyter-config-data">{{"token": "{TOKEN}", "baseUrl": "x"}}</script>'
            extra = [(b"x-leak", f"token={TOKEN}".encode()), (b"set-cookie", b"sessionid=evil; Path=/")]
            extra.append((b"set-cookie", b"_xsrf=abc; Path=/"))
            await _answer(send, 200, body.encode(), "text/html", extra)
        elif path.endswith("/big"):
            chunks = int(scope["query_string"].decode().split("=")[1]) * 16
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x/y")]})
            for n in range(chunks):
                await send(
                    {"type": "http.response.body", "body": bytes([n % 256]) * 65536, "more_body": True}
                )
            await send({"type": "http.response.body", "body": b""})
        else:
            seen = {
                "method": scope["method"],
                "raw_path": scope["raw_path"].decode(),
                "query": scope["query_string"].decode(),
                "headers": headers,
                "size": size,
                "sha256": digest.hexdigest(),
            }
            await _answer(send, 200, json.dumps(seen).encode(), "application/json", [])

    async def _websocket(self, scope: dict, receive, send, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
        await receive()  # websocket.connect
        offered = scope.get("subprotocols") or []
        chosen = KERNEL_PROTOCOL if KERNEL_PROTOCOL in offered else None
        await send({"type": "websocket.accept", "subprotocol": chosen})
        await send({"type": "websocket.send", "text": json.dumps(headers)})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self.closes.append(message.get("code"))
                return
            if message.get("text") == "close 4321":
                await send({"type": "websocket.close", "code": 4321, "reason": "kernel gone"})
                return
            if message.get("text") is not None:
                await send({"type": "websocket.send", "text": message["text"]})
            else:
                await send({"type": "websocket.send", "bytes": message["bytes"]})


async def _answer(send, status: int, body: bytes, content_type: str, extra: list) -> None:  # type: ignore[no-untyped-def]
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def portal() -> Iterator[str]:
    with asgi_server() as url:
        yield url


@pytest.fixture(scope="module")
def jupyter_server() -> Iterator[tuple[FakeJupyter, int]]:
    fake = FakeJupyter()
    with serve(fake) as port:
        yield fake, port


@pytest.fixture
def jupyter(jupyter_server) -> FakeJupyter:
    fake, _ = jupyter_server
    fake.seen.clear()
    fake.closes.clear()
    return fake


def make_lab(owner, booking, port: int, **fields: Any) -> InteractiveSession:
    values = {"kind": "jupyterlab", "status": "running", "address": f"127.0.0.1:{port}", "token": TOKEN}
    return InteractiveSession.objects.create(
        owner=owner,
        reservation=booking,
        server=booking.allocations.first().gpu.server,
        command=["jupyter", "lab"],
        **{**values, **fields},
    )


@pytest.fixture
def lab(alice, booking, jupyter_server) -> InteractiveSession:
    return make_lab(alice, booking, jupyter_server[1])


def signed_in(user) -> str:
    """The portal's session cookie for `user`, as a browser would hold it after signing in."""
    browser = Client()
    browser.force_login(user)
    return browser.cookies["sessionid"].value


def cookie_header(user, **more: str) -> dict[str, str]:
    cookies = {"sessionid": signed_in(user), "csrftoken": "portal-csrf", **more}
    return {"Cookie": "; ".join(f"{name}={value}" for name, value in cookies.items())}


def get(portal: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=portal, timeout=10) as http:
        return http.get(path, headers=headers or {}, **kwargs)


def ws_open(portal: str, path: str, headers: dict[str, str], origin: str | None = "own", **kwargs: Any):  # type: ignore[no-untyped-def]
    """A websocket to the portal; `origin` "own" is the portal's."""
    url = portal.replace("http://", "ws://") + path
    own = portal if origin == "own" else origin
    return connect(url, additional_headers=headers, origin=own, open_timeout=10, **kwargs)  # type: ignore[arg-type]


def ws_refused(portal: str, path: str, headers: dict[str, str], origin: str | None = "own") -> int:
    """The HTTP status a refused websocket got (fails if it was accepted)."""
    with pytest.raises(InvalidStatus) as refused:
        ws_open(portal, path, headers, origin).close()
    return refused.value.response.status_code


def raw_get(portal: str, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """GET with the request target exactly as given: httpx would resolve `..` itself."""
    host, port = portal.removeprefix("http://").split(":")
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest


# --- the owner --------------------------------------------------------------------------------------


def test_it_gives_the_owner_the_lab_with_the_token_added(portal, jupyter, lab, alice) -> None:
    headers = {**cookie_header(alice, _xsrf="jupyters"), "Authorization": "token guessed", "Accept": "*/*"}
    response = get(portal, f"/sessions/{lab.pk}/lab/api/echo?a=1&token=guessed&b=2", headers)

    assert response.status_code == 200
    got = jupyter.seen[-1]["headers"]
    assert got["authorization"] == f"token {TOKEN}"
    assert got["cookie"] == "_xsrf=jupyters"  # the portal's cookies stayed behind
    assert got["host"] == lab.address
    assert got["x-forwarded-host"] == portal.removeprefix("http://")
    assert (got["x-forwarded-proto"], got["x-forwarded-for"]) == ("http", "127.0.0.1")
    assert response.json()["query"] == "a=1&b=2"  # a client's ?token= would win over the header
    # The fake echoes the headers it got, token included: the proxy masks it on the way back.
    assert TOKEN not in response.text
    assert all(TOKEN not in value for value in response.headers.values())


def test_it_never_lets_the_token_reach_the_browser(portal, jupyter, lab, alice) -> None:
    response = get(portal, f"/sessions/{lab.pk}/lab/page", cookie_header(alice))

    assert response.status_code == 200
    assert TOKEN not in response.text
    assert '"token": "' + "x" * len(TOKEN) + '"' in response.text  # same length: Content-Length holds
    assert all(TOKEN not in value for value in response.headers.values())
    # A cookie the Jupyter server sets may not stand in for the portal's own.
    assert response.headers.get_list("set-cookie") == ["_xsrf=abc; Path=/"]


def test_it_forwards_the_raw_path(portal, jupyter, lab, alice) -> None:
    status, body = raw_get(
        portal, f"/sessions/{lab.pk}/lab/api/contents/my%20notes%2Fa.ipynb", cookie_header(alice)
    )

    assert status == 200
    assert f"/sessions/{lab.pk}/lab/api/contents/my%20notes%2Fa.ipynb" in body.decode()


def test_it_streams_large_bodies_both_ways(portal, jupyter, lab, alice) -> None:
    upload = bytes(range(256)) * (8 * 4096)  # 8 MiB
    with httpx.Client(base_url=portal, timeout=30) as http:
        sent = http.put(f"/sessions/{lab.pk}/lab/api/echo", content=upload, headers=cookie_header(alice))
        with http.stream(
            "GET", f"/sessions/{lab.pk}/lab/big?mb=16", headers=cookie_header(alice)
        ) as response:
            digest, size = hashlib.sha256(), 0
            for chunk in response.iter_raw():
                digest.update(chunk)
                size += len(chunk)

    assert sent.json()["size"] == len(upload)
    assert sent.json()["sha256"] == hashlib.sha256(upload).hexdigest()
    expected = hashlib.sha256(b"".join(bytes([n % 256]) * 65536 for n in range(16 * 16)))
    assert (size, digest.hexdigest()) == (16 * 1024 * 1024, expected.hexdigest())


def test_it_relays_the_owners_websocket(portal, jupyter, lab, alice) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels?session_id=s1"
    with ws_open(portal, path, cookie_header(alice), subprotocols=[KERNEL_PROTOCOL]) as ws:
        handshake = ws.recv(timeout=10)  # the fake's report of its headers: the token masked
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        ws.send(b"\x00\x01binary\xff")
        assert ws.recv(timeout=10) == b"\x00\x01binary\xff"
        ws.send(f"print {TOKEN}")
        assert ws.recv(timeout=10) == f"print {'x' * len(TOKEN)}"
        assert ws.subprotocol == KERNEL_PROTOCOL

    assert TOKEN not in handshake
    got = jupyter.seen[-1]
    assert got["headers"]["authorization"] == f"token {TOKEN}"
    assert "sessionid" not in got["headers"].get("cookie", "")
    assert "origin" not in got["headers"]  # checked here; Jupyter would compare it with its own Host
    assert got["raw_path"] == f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"


def test_it_passes_close_codes_both_ways(portal, jupyter, lab, alice) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    with ws_open(portal, path, cookie_header(alice)) as ws:
        ws.recv(timeout=10)
        ws.send("close 4321")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert (ws.close_code, ws.close_reason) == (4321, "kernel gone")

    with ws_open(portal, path, cookie_header(alice)) as ws:
        ws.recv(timeout=10)
        ws.close(4000, "tab closed")
    wait_for(lambda: jupyter.closes, timeout=5, interval=0.01, what="the close to reach the server")
    assert jupyter.closes == [4000]


def test_an_open_websocket_ends_when_its_server_goes(portal, alice, booking) -> None:
    with ExitStack() as server:
        lab = make_lab(alice, booking, server.enter_context(serve(FakeJupyter())))
        with ws_open(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", cookie_header(alice)) as ws:
            ws.recv(timeout=10)
            server.close()  # the session's server stops (uvicorn closes its websockets with 1012)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
    assert ws.close_code == 1012


# --- everyone else ----------------------------------------------------------------------------------


def test_it_sends_an_anonymous_page_view_to_sign_in(portal, jupyter, lab) -> None:
    path = f"/sessions/{lab.pk}/lab/tree?x=1"
    page = get(portal, path, {"Accept": "text/html,application/xhtml+xml"})
    api = get(portal, f"/sessions/{lab.pk}/lab/api/echo", {"Accept": "application/json"})

    assert page.status_code == 302
    assert page.headers["location"] == f"/login/?next=/sessions/{lab.pk}/lab/tree%3Fx%3D1"
    assert api.status_code == 401
    assert ws_refused(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", {}) == 403
    assert jupyter.seen == []


@pytest.mark.parametrize("who", ["bob", "leader", "charlie", "admin_user"])
def test_it_gives_no_one_else_the_lab(portal, jupyter, lab, who, request) -> None:
    user = request.getfixturevalue(who)
    headers = cookie_header(user)

    response = get(portal, f"/sessions/{lab.pk}/lab/api/echo", headers)

    assert response.status_code == 404
    assert ws_refused(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", headers) == 403
    assert jupyter.seen == []


@pytest.mark.parametrize(
    "fields", [{"status": "ended"}, {"status": "starting"}, {"status": "failed"}, {"kind": "exec"}]
)
def test_it_serves_only_running_labs(portal, jupyter, alice, booking, jupyter_server, fields) -> None:
    other = make_lab(alice, booking, jupyter_server[1], **fields)
    headers = cookie_header(alice)

    assert get(portal, f"/sessions/{other.pk}/lab/api/echo", headers).status_code == 404
    assert ws_refused(portal, f"/sessions/{other.pk}/lab/api/kernels/k1/channels", headers) == 403
    assert jupyter.seen == []


def test_it_refuses_a_signed_out_cookie(portal, jupyter, lab, alice) -> None:
    browser = Client()
    browser.force_login(alice)
    old = {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}
    assert get(portal, f"/sessions/{lab.pk}/lab/api/echo", old).status_code == 200
    browser.logout()
    jupyter.seen.clear()

    assert get(portal, f"/sessions/{lab.pk}/lab/api/echo", old).status_code == 401
    assert ws_refused(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", old) == 403
    assert jupyter.seen == []


def test_it_refuses_a_session_after_a_password_change(portal, jupyter, lab, alice) -> None:
    old = cookie_header(alice)
    alice.set_password("a new one")
    alice.save()

    assert get(portal, f"/sessions/{lab.pk}/lab/api/echo", old).status_code == 401
    assert ws_refused(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", old) == 403
    assert jupyter.seen == []


def test_it_refuses_a_deactivated_owner(portal, jupyter, lab, alice) -> None:
    headers = cookie_header(alice)
    alice.is_active = False
    alice.save()

    assert get(portal, f"/sessions/{lab.pk}/lab/api/echo", headers).status_code == 401
    assert ws_refused(portal, f"/sessions/{lab.pk}/lab/api/kernels/k1/channels", headers) == 403
    assert jupyter.seen == []


def test_it_refuses_websockets_from_other_origins(portal, jupyter, lab, alice) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    headers = cookie_header(alice)

    assert ws_refused(portal, path, headers, origin="http://evil.example") == 403
    assert ws_refused(portal, path, headers, origin=None) == 403
    assert ws_refused(portal, path, headers, origin="null") == 403
    assert jupyter.seen == []


def test_it_refuses_cross_site_changes(portal, jupyter, lab, alice) -> None:
    path = f"/sessions/{lab.pk}/lab/api/echo"
    with httpx.Client(base_url=portal, timeout=10) as http:
        evil = http.post(
            path, content=b"{}", headers={**cookie_header(alice), "Origin": "http://evil.example"}
        )
        assert jupyter.seen == []
        own = http.post(path, content=b"{}", headers={**cookie_header(alice), "Origin": portal})

    assert evil.status_code == 403
    assert own.status_code == 200


@pytest.mark.parametrize(
    "target",
    [
        "/sessions/{mine}/lab/../../{theirs}/lab/api/echo",
        "/sessions/{mine}/lab/%2e%2e/%2e%2e/{theirs}/lab/api/echo",
        "/sessions/{mine}/lab/%2E%2E%2F%2E%2E%2F{theirs}/lab/api/echo",
        "/sessions/{mine}/lab%2F..%2F..%2F{theirs}/lab/api/echo",
        "/sessions/{mine}/../{theirs}/lab/api/echo",
        "/sessions/%3{theirs_encoded}/lab/api/echo",
        "/sessions/0{theirs}/lab/api/echo",
        "/sessions/99999999999999999999999999/lab/api/echo",
    ],
)
def test_a_path_never_reaches_another_session(
    portal, jupyter, lab, bob, booking, jupyter_server, target
) -> None:
    mine = make_lab(bob, booking, jupyter_server[1])
    path = target.format(mine=mine.pk, theirs=lab.pk, theirs_encoded=str(lab.pk))

    status, _ = raw_get(portal, path, cookie_header(bob))

    assert status in (400, 404)
    assert jupyter.seen == []
    assert ws_refused(portal, path, cookie_header(bob)) in (403, 404)
    assert jupyter.seen == []


def test_it_serves_only_the_portals_own_host_names(portal, jupyter, lab, alice) -> None:
    """A Host outside ALLOWED_HOSTS (DNS rebinding) is no origin to compare a websocket's with."""
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    sock = socket.create_connection(("127.0.0.1", int(portal.rsplit(":", 1)[1])), timeout=10)

    assert get(portal, path, {**cookie_header(alice), "Host": "evil.example"}).status_code == 400
    with pytest.raises(InvalidStatus) as refused:
        connect(
            f"ws://evil.example{path}",
            sock=sock,
            origin="http://evil.example",
            additional_headers=cookie_header(alice),
        ).close()
    assert refused.value.response.status_code == 403
    assert jupyter.seen == []


def test_it_answers_502_when_the_server_is_down(portal, alice, booking) -> None:
    down = make_lab(alice, booking, free_port())

    response = get(portal, f"/sessions/{down.pk}/lab/api/echo", cookie_header(alice))

    assert response.status_code == 502
    assert response.text == (
        f"the JupyterLab server of session {down.pk} is not answering; it may be starting or have ended\n"
    )
    assert ws_refused(portal, f"/sessions/{down.pk}/lab/api/kernels/k1/channels", cookie_header(alice)) == 403


def test_other_paths_are_djangos(portal, jupyter, lab) -> None:
    assert get(portal, "/login/").status_code == 200
    assert get(portal, f"/sessions/{lab.pk}/other").status_code == 404
    assert jupyter.seen == []


def test_requests_at_once_share_one_check_and_later_ones_check_again(monkeypatch) -> None:
    reads: list[int] = []

    def slow_verdict(session_key: str | None, pk: int) -> Verdict:
        reads.append(pk)
        time.sleep(0.05)  # a database read under way while the other requests come
        return Verdict(lab=None, signed_in=False)

    monkeypatch.setattr("jobs.lab_proxy._verdict", slow_verdict)
    scope = {"headers": [(b"cookie", b"sessionid=abc")]}

    async def run() -> None:
        await asyncio.gather(*(check(scope, 7) for _ in range(10)))
        assert reads == [7]
        await check(scope, 7)
        await check({"headers": [(b"cookie", b"sessionid=other")]}, 7)

    asyncio.run(run())
    assert reads == [7, 7, 7]


def test_the_scrubber_masks_a_token_split_across_chunks() -> None:
    scrubber = Scrubber(TOKEN)
    chunks = [b"<p>se", b"cret-tok", b"en-xyz</p>secret-", b"no"]

    out = b"".join(scrubber.feed(chunk) for chunk in chunks) + scrubber.flush()

    assert out == b"<p>" + b"x" * len(TOKEN) + b"</p>secret-no"
    assert scrubber.feed(b"plain") == b"plain"  # nothing held that cannot begin the token


def test_close_codes_that_cannot_be_sent_are_translated() -> None:
    assert [close_code(code) for code in (None, 1000, 1005, 1006, 4321, 2000)] == [
        1000,
        1000,
        1000,
        1011,
        4321,
        1011,
    ]
