"""What the lab proxy's tests (tests/test_lab_proxy.py, tests/test_lab_handoff.py) and its benchmark
(bench/bench_lab_proxy.py) share: a stand-in Jupyter server, the portal under a real uvicorn at
two host names as `make run` has it (tests/asgi_server.py: the portal at http://localhost:PORT,
the labs at http://127.0.0.1:PORT), labs that point at the stand-in, and clients.

FakeJupyter records every request it gets and echoes what it was sent (the Authorization and
Cookie headers above all). "Upstream never contacted" is read from that record: the proxy answers
a refusal before it connects, so an empty record after the answer is proof, not a hope.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.utils import timezone
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from jobs.models import InteractiveSession
from tests.asgi_server import asgi_servers, serve
from tests.lab_client import browser, grant_cookie, open_lab, signed_in

TOKEN = "secret-token-xyz"
KERNEL_PROTOCOL = "v1.kernel.websocket.jupyter.org"


class FakeJupyter:
    """A stand-in Jupyter server: HTTP under /sessions/<id>/lab/ and a websocket that echoes.

    - `…/echo`: JSON of what it got (method, raw path, query, headers, body length and hash);
    - `…/page`: a page with the token in it (as Jupyter's page config has), in a header too,
      cookies (Jupyter's own, its login cookie, two named as the portal's and the proxy's) and a
      CORS grant to another site, as a lab owner's own Jupyter config could send;
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
            extra += [
                (b"set-cookie", b"lab_grant=evil; Path=/"),
                (b"set-cookie", b"username-x=jupyters; Path=/"),
            ]
            extra.append((b"set-cookie", b"_xsrf=abc; Path=/"))
            extra += [(b"access-control-allow-origin", b"http://evil.example")]
            extra += [(b"access-control-allow-credentials", b"true")]
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
def servers() -> Iterator[tuple[str, str]]:
    with asgi_servers() as both:
        yield both


@pytest.fixture
def portal(servers) -> str:
    return servers[0]


@pytest.fixture
def labs(servers) -> str:
    return servers[1]


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
    values = {
        **{"kind": "jupyterlab", "status": "running", "address": f"127.0.0.1:{port}", "token": TOKEN},
        "beat_at": timezone.now(),  # as its supervisor would (the relay needs a fresh beat)
    }
    return InteractiveSession.objects.create(
        owner=owner,
        reservation=booking,
        server=booking.allocations.first().gpu.server,
        command=["jupyter", "lab"],
        **{**values, **fields},
    )


@pytest.fixture
def lab(alice, booking, jupyter_server, settings) -> InteractiveSession:
    settings.LAB_RELAY_BEAT_SECONDS = 600  # no supervisor beats for a fake: its one beat must last the test
    return make_lab(alice, booking, jupyter_server[1])


def handed_over(portal: str, user, lab: InteractiveSession, jupyter: FakeJupyter) -> httpx.Client:
    """A browser of `user`'s that opened `lab` through the hand-off (the fake's record cleared)."""
    http = browser(portal, user)
    assert open_lab(http, portal, lab.pk).status_code == 200
    jupyter.seen.clear()
    return http


@pytest.fixture
def owner(portal, lab, alice, jupyter) -> Iterator[httpx.Client]:
    """alice's browser, her lab open."""
    http = handed_over(portal, alice, lab, jupyter)
    yield http
    http.close()


def grant_header(http: httpx.Client, pk: int, **more: str) -> dict[str, str]:
    """The Cookie header a browser sends to lab `pk`'s paths on LAB_ORIGIN."""
    cookies = {"lab_grant": grant_cookie(http, pk), **more}
    return {"Cookie": "; ".join(f"{name}={value}" for name, value in cookies.items())}


def portal_cookie(user) -> dict[str, str]:
    return {"Cookie": f"sessionid={signed_in(user)}; csrftoken=portal-csrf"}


def get(base: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=10) as http:
        return http.get(path, headers=headers or {}, **kwargs)


def ws_open(base: str, path: str, headers: dict[str, str], origin: str | None, **kwargs: Any):  # type: ignore[no-untyped-def]
    url = base.replace("http://", "ws://") + path
    return connect(url, additional_headers=headers, origin=origin, open_timeout=10, **kwargs)  # type: ignore[arg-type]


def ws_refused(base: str, path: str, headers: dict[str, str], origin: str | None) -> int:
    """The HTTP status a refused websocket got (fails if it was accepted)."""
    with pytest.raises(InvalidStatus) as refused:
        ws_open(base, path, headers, origin).close()
    return refused.value.response.status_code


def raw_get(base: str, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """GET with the request target exactly as given: httpx would resolve `..` itself."""
    host, port = base.removeprefix("http://").split(":")
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest
