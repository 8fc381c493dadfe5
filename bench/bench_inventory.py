"""Dashboard and /api/v1/gpus/ server time, and telemetry ingest, for 64 servers × 8 GPUs."""

from __future__ import annotations

from bench.common import median_ms, report, setup_django_test_db

SERVERS, GPUS, REQUESTS = 64, 8, 60


def main() -> None:
    teardown = setup_django_test_db()
    try:
        from django.contrib.auth import get_user_model
        from django.core.handlers.wsgi import WSGIHandler
        from django.db import connection
        from django.test import Client, RequestFactory

        from gpus.services import servers_report_ingest
        from tests.factories import make_snapshot

        rounds = [
            [make_snapshot(f"bench{s:02d}", gpus=GPUS, util=u, processes=2) for s in range(SERVERS)]
            for u in (10, 50, 90)
        ]
        state = {"round": 0}

        def ingest_round() -> None:
            servers_report_ingest(snapshots=rounds[state["round"] % 3])
            state["round"] += 1

        ingest_round()  # registers everything
        ingest_ms = median_ms(ingest_round, repeat=20)
        user = get_user_model().objects.create_user("bench", password="bench-password")
        client = Client()
        client.force_login(user)
        cookie = "; ".join(f"{k}={v.value}" for k, v in client.cookies.items())
        handler = WSGIHandler()
        factory = RequestFactory()

        def serve(path: str) -> None:
            """The WSGI app alone, as gunicorn calls it: no test-client instrumentation."""
            environ = factory.get(path, HTTP_COOKIE=cookie).environ
            statuses = []
            body = b"".join(handler(environ, lambda status, headers: statuses.append(status)))
            assert statuses[0].startswith("200") and body, (path, statuses)

        dashboard_ms = median_ms(lambda: serve("/"), repeat=REQUESTS)
        api_ms = median_ms(lambda: serve("/api/v1/gpus/"), repeat=REQUESTS)
        print(
            f"Inventory ({SERVERS} servers × {GPUS} GPUs, {connection.vendor}, median of {REQUESTS} requests)"
        )
        report("dashboard page, server time", dashboard_ms, "ms", "<= 25 ms", dashboard_ms <= 25)
        report("GET /api/v1/gpus/, server time", api_ms, "ms", "(none)", True)
        report(
            f"ingest one round: {SERVERS} reports, {SERVERS * GPUS} GPUs",
            ingest_ms,
            "ms",
            "<= 50 ms",
            ingest_ms <= 50,
        )
    finally:
        teardown()


if __name__ == "__main__":
    main()
