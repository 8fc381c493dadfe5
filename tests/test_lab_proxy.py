"""JupyterLab on its own origin, past the hand-off (jobs/sessions/lab_proxy.py,
jobs/sessions/lab_relay.py): the owner's
requests and websockets reach the session's Jupyter server with its token added and come back
scrubbed of it; foreign origins, paths that walk out of a session and foreign host names are
refused before anything reaches the server.

portal.asgi runs under a real uvicorn at two host names as `make run` has it, and the "Jupyter
server" is FakeJupyter, which records every request it gets (tests/lab_fakes.py): an empty record
after a refusal is proof that nothing reached it. The owner's client went through the real
hand-off first (tests/test_lab_handoff.py says how it works).
"""
# ruff: noqa: F811 - the fixtures imported from tests.lab_fakes are the tests' arguments

from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import ExitStack

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from jobs.sessions.lab_proxy import Verdict, check
from jobs.sessions.lab_relay import Scrubber, close_code
from tests.asgi_server import serve
from tests.conftest import free_port
from tests.lab_client import browser, open_lab
from tests.lab_fakes import (  # noqa: F401 - fixtures
    KERNEL_PROTOCOL,
    TOKEN,
    FakeJupyter,
    get,
    grant_header,
    handed_over,
    jupyter,
    jupyter_server,
    lab,
    labs,
    make_lab,
    owner,
    portal,
    portal_cookie,
    raw_get,
    servers,
    ws_open,
    ws_refused,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


# --- the owner, on the labs' origin -------------------------------------------------------------------


def test_it_gives_the_owner_the_lab_with_the_token_added(labs, jupyter, lab, owner) -> None:
    headers = {
        **grant_header(owner, lab.pk, _xsrf="jupyters"),
        "Authorization": "token guessed",
        "Accept": "*/*",
    }
    response = get(labs, f"/sessions/{lab.pk}/lab/api/echo?a=1&token=guessed&b=2", headers)

    assert response.status_code == 200
    got = jupyter.seen[-1]["headers"]
    assert got["authorization"] == f"token {TOKEN}"
    assert got["cookie"] == "_xsrf=jupyters"  # the lab's grant stayed behind
    assert got["host"] == lab.address
    assert got["x-forwarded-host"] == labs.removeprefix("http://")
    assert (got["x-forwarded-proto"], got["x-forwarded-for"]) == ("http", "127.0.0.1")
    assert response.json()["query"] == "a=1&b=2"  # a client's ?token= would win over the header
    # The fake echoes the headers it got, token included: the proxy masks it on the way back.
    assert TOKEN not in response.text
    assert all(TOKEN not in value for value in response.headers.values())


def test_it_never_lets_the_token_a_jupyter_login_or_cors_reach_the_browser(labs, jupyter, lab, owner) -> None:
    response = get(labs, f"/sessions/{lab.pk}/lab/page", grant_header(owner, lab.pk))

    assert response.status_code == 200
    assert TOKEN not in response.text
    assert '"token": "' + "x" * len(TOKEN) + '"' in response.text  # same length: Content-Length holds
    assert all(TOKEN not in value for value in response.headers.values())
    # No cookie from Jupyter may stand in for the portal's or the lab's, nor log in to Jupyter.
    assert response.headers.get_list("set-cookie") == ["_xsrf=abc; Path=/"]
    assert not any(name.lower().startswith("access-control-") for name in response.headers)


def test_it_forwards_the_raw_path(labs, jupyter, lab, owner) -> None:
    status, body = raw_get(
        labs, f"/sessions/{lab.pk}/lab/api/contents/my%20notes%2Fa.ipynb", grant_header(owner, lab.pk)
    )

    assert status == 200
    assert f"/sessions/{lab.pk}/lab/api/contents/my%20notes%2Fa.ipynb" in body.decode()


def test_it_streams_large_bodies_both_ways(labs, jupyter, lab, owner) -> None:
    upload = bytes(range(256)) * (8 * 4096)  # 8 MiB
    headers = grant_header(owner, lab.pk)
    with httpx.Client(base_url=labs, timeout=30) as http:
        sent = http.put(f"/sessions/{lab.pk}/lab/api/echo", content=upload, headers=headers)
        with http.stream("GET", f"/sessions/{lab.pk}/lab/big?mb=16", headers=headers) as response:
            digest_, size = hashlib.sha256(), 0
            for chunk in response.iter_raw():
                digest_.update(chunk)
                size += len(chunk)

    assert sent.json()["size"] == len(upload)
    assert sent.json()["sha256"] == hashlib.sha256(upload).hexdigest()
    expected = hashlib.sha256(b"".join(bytes([n % 256]) * 65536 for n in range(16 * 16)))
    assert (size, digest_.hexdigest()) == (16 * 1024 * 1024, expected.hexdigest())


def test_it_relays_the_owners_websocket(labs, jupyter, lab, owner) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels?session_id=s1"
    with ws_open(labs, path, grant_header(owner, lab.pk), labs, subprotocols=[KERNEL_PROTOCOL]) as ws:
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
    assert "lab_grant" not in got["headers"].get("cookie", "")
    assert "origin" not in got["headers"]  # checked here; Jupyter would compare it with its own Host
    assert got["raw_path"] == f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"


def test_it_passes_close_codes_both_ways(labs, jupyter, lab, owner) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    with ws_open(labs, path, grant_header(owner, lab.pk), labs) as ws:
        ws.recv(timeout=10)
        ws.send("close 4321")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert (ws.close_code, ws.close_reason) == (4321, "kernel gone")

    with ws_open(labs, path, grant_header(owner, lab.pk), labs) as ws:
        ws.recv(timeout=10)
        ws.close(4000, "tab closed")
    wait_for(lambda: jupyter.closes, timeout=5, interval=0.01, what="the close to reach the server")
    assert jupyter.closes == [4000]


def test_an_open_websocket_ends_when_its_server_goes(portal, labs, alice, booking) -> None:
    with ExitStack() as server:
        fake = FakeJupyter()
        lab = make_lab(alice, booking, server.enter_context(serve(fake)))
        http = handed_over(portal, alice, lab, fake)
        path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
        with ws_open(labs, path, grant_header(http, lab.pk), labs) as ws:
            ws.recv(timeout=10)
            server.close()  # the session's server stops (uvicorn closes its websockets with 1012)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
    assert ws.close_code == 1012


def test_it_answers_502_when_the_server_is_down(portal, labs, alice, booking) -> None:
    down = make_lab(alice, booking, free_port())
    http = browser(portal, alice)
    open_lab(http, portal, down.pk)  # the hand-off works; the server does not answer
    headers = grant_header(http, down.pk)

    response = get(labs, f"/sessions/{down.pk}/lab/api/echo", headers)

    assert response.status_code == 502
    assert response.text == (
        f"the JupyterLab server of session {down.pk} is not answering; it may be starting or have ended\n"
    )
    assert ws_refused(labs, f"/sessions/{down.pk}/lab/api/kernels/k1/channels", headers, origin=labs) == 403


def test_websockets_must_come_from_the_lab_origin(portal, labs, jupyter, lab, owner) -> None:
    path = f"/sessions/{lab.pk}/lab/api/kernels/k1/channels"
    grant = grant_header(owner, lab.pk)

    for origin in (portal, "http://evil.example", None, "null", labs.replace("127.0.0.1", "localhost")):
        assert ws_refused(labs, path, grant, origin=origin) == 403, origin
    assert jupyter.seen == []
    with ws_open(labs, path, grant, labs) as ws:
        ws.recv(timeout=10)


def test_it_refuses_cross_site_changes(portal, labs, jupyter, lab, owner) -> None:
    path = f"/sessions/{lab.pk}/lab/api/echo"
    grant = grant_header(owner, lab.pk)
    with httpx.Client(base_url=labs, timeout=10) as http:
        from_portal = http.post(path, content=b"{}", headers={**grant, "Origin": portal})
        evil = http.post(path, content=b"{}", headers={**grant, "Origin": "http://evil.example"})
        assert jupyter.seen == []
        own = http.post(path, content=b"{}", headers={**grant, "Origin": labs})

    assert (from_portal.status_code, evil.status_code, own.status_code) == (403, 403, 200)


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
    portal, labs, jupyter, lab, bob, booking, jupyter_server, target
) -> None:
    mine = make_lab(bob, booking, jupyter_server[1])
    grant = grant_header(handed_over(portal, bob, mine, jupyter), mine.pk)
    path = target.format(mine=mine.pk, theirs=lab.pk, theirs_encoded=str(lab.pk))

    status, _ = raw_get(labs, path, grant)

    assert status in (400, 404)
    assert ws_refused(labs, path, grant, origin=labs) in (403, 404)
    assert jupyter.seen == []


def test_the_portal_answers_only_its_own_host_names(portal, jupyter, lab, alice) -> None:
    """A Host outside ALLOWED_HOSTS (DNS rebinding) gets nothing of the portal's lab paths."""
    answer = get(portal, f"/sessions/{lab.pk}/lab/", {**portal_cookie(alice), "Host": "evil.example"})

    assert answer.status_code == 400
    assert jupyter.seen == []


def test_other_portal_paths_are_djangos(portal, jupyter, lab) -> None:
    assert get(portal, "/login/").status_code == 200
    assert get(portal, f"/sessions/{lab.pk}/other").status_code == 404
    assert jupyter.seen == []


def test_requests_at_once_share_one_check_and_later_ones_check_again(monkeypatch) -> None:
    reads: list[tuple[str | None, int]] = []

    def slow_verdict(secret: str | None, pk: int) -> Verdict:
        reads.append((secret, pk))
        time.sleep(0.05)  # a database read under way while the other requests come
        return Verdict(lab=None, signed_in=False)

    monkeypatch.setattr("jobs.sessions.lab_proxy._grant_verdict", slow_verdict)
    scope = {"headers": [(b"cookie", b"lab_grant=abc; sessionid=never-read")]}

    async def run() -> None:
        await asyncio.gather(*(check(scope, 7, lab_origin=True) for _ in range(10)))
        assert reads == [("abc", 7)]
        await check(scope, 7, lab_origin=True)
        await check({"headers": [(b"cookie", b"lab_grant=other")]}, 7, lab_origin=True)

    asyncio.run(run())
    assert reads == [("abc", 7), ("abc", 7), ("other", 7)]


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
