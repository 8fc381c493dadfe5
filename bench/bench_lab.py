"""JupyterLab sessions: request → lab usable, through the portal.

What is measured
    A real `celery -A portal worker` for a simulated GPU host (prefork, --concurrency 2) runs on
    the bench's test database and the configured Redis; the portal (portal.asgi, its lab proxy
    included) runs under uvicorn in this process, as `make run` has it: the portal on localhost,
    the labs' own origin (LAB_ORIGIN) on 127.0.0.1. A user with an active booking asks for a lab
    (`session_start(kind="jupyterlab")`, what the *Open JupyterLab* button and
    `POST /api/v1/sessions/` call; it dispatches when it commits). t0 is just before the call.
      - running: the row says RUNNING (the worker started JupyterLab and it answered);
      - lab page: GET /sessions/<id>/lab/lab on the portal, signed in with the portal's session
        cookie only, followed through the hand-off (tests/lab_client.py) to the lab page on
        LAB_ORIGIN, answers 200 (what the browser loads);
      - first cell: a kernel started through the proxy (POST …/api/kernels) has run `1 + 1` over
        its websocket channel, through the proxy, with the lab's own cookie, and answered `2`.
    6 labs one after the other (the first is a warm-up, not counted), each ended before the next.
    Goals: lab page median ≤ 5 s; first cell median ≤ 8 s (a 2-core machine, no GPU).

Runs on the configured database (SQLite under PORTAL_VAR_DIR by default; DATABASE_URL for
PostgreSQL). A missed goal prints MISSED; the exit code is non-zero only on errors.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import database_url_for_subprocess, report, setup_django_test_db, stop
from tests.waiting import wait_for

RUNS = 6


def one_lab(user, booking, portal: str, labs: str) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    from jobs.models import InteractiveSession
    from jobs.sessions.services import session_end_request, session_start
    from tests.lab_client import browser, grant_cookie, open_lab

    t0 = time.perf_counter()
    session, _ = session_start(user=user, reservation=booking.pk, kind="jupyterlab")
    wait_for(
        lambda: InteractiveSession.objects.values_list("status", flat=True).get(pk=session.pk) != "starting",
        60,
        what="the lab to run",
    )
    running = time.perf_counter() - t0
    lab = f"{labs}/sessions/{session.pk}/lab/"
    with browser(portal, user, timeout=30) as client:
        wait_for(
            lambda: open_lab(client, portal, session.pk, "lab").status_code == 200, 30, what="the lab page"
        )
        page = time.perf_counter() - t0
        kernel = client.post(lab + "api/kernels", headers={"Origin": labs}).json()["id"]
        cookie = {"lab_grant": grant_cookie(client, session.pk)}
        assert run_cell(labs, lab, kernel, cookie, "1 + 1") == "2"
        cell = time.perf_counter() - t0
    session_end_request(session=session, by=user)
    wait_for(
        lambda: InteractiveSession.objects.values_list("status", flat=True).get(pk=session.pk) == "ended",
        60,
        what="the lab to end",
    )
    return running, page, cell


def run_cell(base: str, lab: str, kernel: str, cookie: dict[str, str], code: str) -> str:
    from websockets.sync.client import connect

    url = lab.replace("http://", "ws://") + f"api/kernels/{kernel}/channels"
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "username": "bench", "session": msg_id, "msg_type": "execute_request"}
    request = {
        "header": {**header, "version": "5.3"},
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}},
        "channel": "shell",
    }
    cookies = "; ".join(f"{k}={v}" for k, v in cookie.items())
    with connect(url, additional_headers={"Cookie": cookies, "Origin": base}) as ws:
        ws.send(json.dumps(request))
        while True:
            message = json.loads(ws.recv(timeout=60))
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "execute_result":
                return message["content"]["data"]["text/plain"]
            if message["msg_type"] == "error":
                raise RuntimeError(message["content"]["evalue"])


def main() -> int:
    teardown = setup_django_test_db()
    scratch = Path(tempfile.mkdtemp(prefix="bench-lab-"))
    worker = None
    try:
        from django.contrib.auth import get_user_model
        from django.db import connection

        from bench.bench_jobs import start_worker
        from gpus.booking import reservation_create
        from gpus.services import server_report_ingest
        from gpus.simulated.inventory import server_names
        from portal.models import Membership, Team
        from tests.asgi_server import asgi_servers
        from tests.factories import make_snapshot

        print(f"JupyterLab sessions ({connection.vendor})")
        server = server_names()[0]
        server_report_ingest(snapshot=make_snapshot(server, gpus=4, simulated=True))
        user = get_user_model().objects.create_user("bench", password="bench-password")
        team = Team.objects.create(name="Bench Lab", slug="bench-lab")
        Membership.objects.create(team=team, user=user, role=Membership.Role.MEMBER)
        booking = reservation_create(user=user, gpus=[f"GPU-{server}-00"], memory_mb=8192)
        worker, _ = start_worker(server, database_url_for_subprocess(), scratch)
        with asgi_servers() as (portal, labs):
            figures = [one_lab(user, booking, portal, labs) for _ in range(RUNS)][1:]
        running, page, cell = (sorted(f[i] for f in figures) for i in range(3))
        print(f"  {len(figures)} labs after a warm-up; seconds from the request")
        print(f"  running   median {statistics.median(running):5.2f}  max {running[-1]:5.2f}")
        print(f"  lab page  median {statistics.median(page):5.2f}  max {page[-1]:5.2f}")
        print(f"  1st cell  median {statistics.median(cell):5.2f}  max {cell[-1]:5.2f}")
        report(
            "request → lab page through the portal (median)",
            statistics.median(page),
            "s",
            "≤ 5",
            statistics.median(page) <= 5,
        )
        report(
            "request → first cell's answer (median)",
            statistics.median(cell),
            "s",
            "≤ 8",
            statistics.median(cell) <= 8,
        )
    finally:
        stop(worker)
        teardown()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
