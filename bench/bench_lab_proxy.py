"""What the JupyterLab proxy (jobs/sessions/lab_proxy.py) adds: latency per websocket message and per small
HTTP request, and large-download throughput, through the portal vs straight to the server; and
what opening a lab costs: the hand-off from the portal to the labs' origin (four redirects, a
ticket issued and redeemed) before the first page.

The "Jupyter server" is the tests' FakeJupyter (tests/lab_fakes.py): an echo under uvicorn.
portal.asgi runs under another uvicorn; both in threads of this process, as the tests run them,
on a throw-away copy of the configured database (bench.common). One process means one GIL: the
client, the proxy and the server share it, so the figures are an upper bound on the added cost.

Websocket: WS_MESSAGES small text frames, one after another, each sent and its echo received.
HTTP: HTTP_REQUESTS GETs of a small JSON answer on one keep-alive connection; through the portal
each one checks the lab's cookie, its portal session and the lab in the database again (that is
the design). Then a page load: PAGE_FILES GETs at once over a browser's six connections (requests
that come while a check of the same cookie and lab is under way share it). Through the portal
means on the labs' origin (LAB_ORIGIN, http://127.0.0.1:PORT) with the lab's own cookie, as a
browser has it after the hand-off; HAND_OFFS fresh browsers time the hand-off itself.
Run: `.venv/bin/python -m bench.bench_lab_proxy`.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable

import httpx

from bench.common import report, setup_django_test_db

WS_MESSAGES, HTTP_REQUESTS, WARMUP = 2000, 500, 50
PAGE_FILES, PAGE_CONNECTIONS, PAGE_LOADS = 60, 6, 20  # a browser's six connections to one site
DOWNLOAD_MIB = 64
HAND_OFFS = 50


def pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def timed(fn: Callable[[], object], count: int) -> list[float]:
    """Milliseconds of each of `count` calls, after WARMUP untimed ones."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def websocket_round_trips(url: str, headers: dict[str, str], origin: str | None) -> list[float]:
    from websockets.sync.client import connect

    with connect(url, additional_headers=headers, origin=origin, compression=None) as ws:  # type: ignore[arg-type]
        ws.recv(timeout=10)  # the fake's report of its handshake

        def one() -> None:
            ws.send("ping 0123456789")
            ws.recv(timeout=10)

        return timed(one, WS_MESSAGES)


def http_round_trips(base: str, path: str, headers: dict[str, str]) -> list[float]:
    with httpx.Client(base_url=base, headers=headers, timeout=10) as http:

        def one() -> None:
            assert http.get(path).status_code == 200

        return timed(one, HTTP_REQUESTS)


def page_load_ms(base: str, path: str, headers: dict[str, str]) -> list[float]:
    """Milliseconds until PAGE_FILES requests sent at once are all answered, as a JupyterLab page
    asks for its files (PAGE_LOADS times)."""

    async def one_load(http: httpx.AsyncClient) -> float:
        start = time.perf_counter()
        answers = await asyncio.gather(*(http.get(path) for _ in range(PAGE_FILES)))
        assert all(answer.status_code == 200 for answer in answers)
        return (time.perf_counter() - start) * 1000

    async def loads() -> list[float]:
        limits = httpx.Limits(max_connections=PAGE_CONNECTIONS)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30, limits=limits) as http:
            await one_load(http)
            return [await one_load(http) for _ in range(PAGE_LOADS)]

    return asyncio.run(loads())


def download_mib_s(base: str, path: str, headers: dict[str, str]) -> float:
    with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
        start, size = time.perf_counter(), 0
        with http.stream("GET", path) as response:
            for chunk in response.iter_raw():
                size += len(chunk)
    assert size == DOWNLOAD_MIB * 1024 * 1024
    return size / (1024 * 1024) / (time.perf_counter() - start)


def line(name: str, direct: list[float], proxied: list[float]) -> None:
    print(f"  {name}")
    for label, samples in (("direct", direct), ("through the portal", proxied)):
        print(
            f"    {label:<20} p50 {pct(samples, 50):7.3f} ms   p95 {pct(samples, 95):7.3f} ms"
            f"   max {max(samples):7.3f} ms   mean {statistics.fmean(samples):7.3f} ms"
        )
    added50, added95 = pct(proxied, 50) - pct(direct, 50), pct(proxied, 95) - pct(direct, 95)
    print(f"    {'added':<20} p50 {added50:7.3f} ms   p95 {added95:7.3f} ms")


def main() -> None:
    teardown = setup_django_test_db()
    try:
        from django.conf import settings
        from django.db import connection
        from django.utils import timezone

        from gpus.booking import reservation_create
        from gpus.services import server_report_ingest
        from jobs.models import InteractiveSession
        from tests.asgi_server import asgi_servers, serve
        from tests.factories import MembershipFactory, UserFactory, make_snapshot
        from tests.lab_client import browser, grant_cookie, open_lab
        from tests.lab_fakes import TOKEN, FakeJupyter

        settings.LAB_RELAY_BEAT_SECONDS = 600  # a fake lab: no supervisor beats for it
        server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
        owner = MembershipFactory(user=UserFactory(username="alice")).user
        booking = reservation_create(user=owner, gpus=[make_snapshot("box1", gpus=1).gpus[0].uuid])
        with serve(FakeJupyter()) as port, asgi_servers() as (portal, labs):
            lab = InteractiveSession.objects.create(
                owner=owner,
                reservation=booking,
                server=booking.allocations.first().gpu.server,
                kind="jupyterlab",
                status="running",
                address=f"127.0.0.1:{port}",
                token=TOKEN,
                command=["jupyter", "lab"],
                beat_at=timezone.now(),
            )
            direct = f"http://127.0.0.1:{port}"
            base = f"/sessions/{lab.pk}/lab"
            hand_offs = []
            for _ in range(HAND_OFFS):
                with browser(portal, owner) as http:
                    start = time.perf_counter()
                    assert open_lab(http, portal, lab.pk, "api/echo").status_code == 200
                    hand_offs.append((time.perf_counter() - start) * 1000)
                    cookie = {"Cookie": f"lab_grant={grant_cookie(http, lab.pk)}"}
            print(
                f"JupyterLab proxy ({connection.vendor}; client, proxy and server in one process:"
                f" {threading.active_count()} threads)"
            )
            ws_path = f"{base}/api/kernels/k1/channels"
            ws_direct = websocket_round_trips(direct.replace("http", "ws") + ws_path, {}, None)
            ws_proxied = websocket_round_trips(labs.replace("http", "ws") + ws_path, cookie, labs)
            line(
                f"websocket round trip, {WS_MESSAGES} small text frames one after another",
                ws_direct,
                ws_proxied,
            )
            http_direct = http_round_trips(direct, f"{base}/api/echo", {})
            http_proxied = http_round_trips(labs, f"{base}/api/echo", cookie)
            line(
                f"HTTP GET, small answer, {HTTP_REQUESTS} on one keep-alive connection",
                http_direct,
                http_proxied,
            )
            page_direct = page_load_ms(direct, f"{base}/api/echo", {})
            page_proxied = page_load_ms(labs, f"{base}/api/echo", cookie)
            line(
                f"{PAGE_FILES} GETs at once on {PAGE_CONNECTIONS} connections (a page load)",
                page_direct,
                page_proxied,
            )
            big = f"{base}/big?mb={DOWNLOAD_MIB}"
            fast, slow = download_mib_s(direct, big, {}), download_mib_s(labs, big, cookie)
            print(f"  download of {DOWNLOAD_MIB} MiB: direct {fast:.0f} MiB/s, through the portal {slow:.0f}")
            print(
                f"  opening the lab from the portal, {HAND_OFFS} fresh browsers (portal path, labs' origin,"
                f" ticket, redeemed, first answer): p50 {pct(hand_offs, 50):.1f} ms,"
                f" p95 {pct(hand_offs, 95):.1f} ms"
            )
            added = pct(ws_proxied, 50) - pct(ws_direct, 50)
            report("websocket message, added p50", added, "ms", "<= 1 ms", added <= 1)
    finally:
        teardown()


if __name__ == "__main__":
    main()
