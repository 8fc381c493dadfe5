"""Dashboard and /api/v1/gpus/ server time, and telemetry ingest, for 64 servers × 8 GPUs; with the
queries each takes, against the bounds tests/test_hot_path_queries.py holds (tests/query_bounds.py)."""

from __future__ import annotations

from collections.abc import Callable

from bench.common import counted, median_ms, report, setup_django_test_db

SERVERS, GPUS, REQUESTS = 64, 8, 60


def ingest_figures(rounds: list[list], changing: list[list]) -> None:
    """One collector round (the figures move, the process lists do not: a steady lab), and one
    whose every card's process list changed, with their queries."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from gpus.services import servers_report_ingest
    from tests import query_bounds

    state = {"round": 0}

    def ingest(snapshots: list[list]) -> Callable[[], None]:
        def one_round() -> None:
            servers_report_ingest(snapshots=snapshots[state["round"] % len(snapshots)])
            state["round"] += 1

        return one_round

    ingest(rounds)()  # registers everything
    steady_ms = median_ms(ingest(rounds), repeat=20)
    changed_ms = median_ms(ingest(changing), repeat=20)
    with CaptureQueriesContext(connection) as changed:
        ingest(changing)()
    ingest(rounds)()
    with CaptureQueriesContext(connection) as steady:
        ingest(rounds)()
    steady_bound = query_bounds.INGEST_STEADY[connection.vendor]
    changed_bound = query_bounds.INGEST_CHANGED[connection.vendor]
    report(
        f"ingest one round: {SERVERS} reports, {SERVERS * GPUS} GPUs",
        steady_ms,
        "ms",
        "<= 15 ms",
        steady_ms <= 15,
    )
    report("ingest one round, queries", len(steady), "", f"<= {steady_bound}", len(steady) <= steady_bound)
    report("ingest, every process list changed", changed_ms, "ms", "(none)", True)
    report(
        "ingest, every list changed, queries",
        len(changed),
        "",
        f"<= {changed_bound}",
        len(changed) <= changed_bound,
    )


def main() -> None:
    teardown = setup_django_test_db()
    try:
        from django.contrib.auth import get_user_model
        from django.core.handlers.wsgi import WSGIHandler
        from django.db import connection
        from django.test import Client, RequestFactory

        from tests import query_bounds
        from tests.factories import make_snapshot

        rounds = [
            [make_snapshot(f"bench{s:02d}", gpus=GPUS, util=u, processes=2) for s in range(SERVERS)]
            for u in (10, 50, 90)
        ]
        changing = [
            [make_snapshot(f"bench{s:02d}", gpus=GPUS, util=u, processes=p) for s in range(SERVERS)]
            for u, p in ((20, 1), (60, 3))
        ]
        print(f"Inventory ({SERVERS} servers × {GPUS} GPUs, {connection.vendor})")
        ingest_figures(rounds, changing)
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

        pages = [("dashboard page", "/", 15, query_bounds.DASHBOARD)]
        pages.append(("GET /api/v1/gpus/", "/api/v1/gpus/", 30, query_bounds.GPU_LIST))
        print(f"  pages: the WSGI app's time, median of {REQUESTS} requests")
        for name, path, goal_ms, bound in pages:
            took = median_ms(lambda path=path: serve(path), repeat=REQUESTS)
            with counted() as queries:
                serve(path)
            report(f"{name}, server time", took, "ms", f"<= {goal_ms} ms", took <= goal_ms)
            report(f"{name}, queries", len(queries), "", f"<= {bound}", len(queries) <= bound)
        report("dashboard page, every row rendered anew", cold_dashboard(serve), "ms", "(none)", True)
    finally:
        teardown()


def cold_dashboard(serve: Callable[[str], None]) -> float:
    """The dashboard's server time when none of its rows was rendered before (gpus/card_rows.py):
    the first viewer after a telemetry round that moved every card's figures."""
    from gpus import card_rows

    def cold() -> None:
        card_rows.forget()
        serve("/")

    return median_ms(cold, repeat=REQUESTS)


if __name__ == "__main__":
    main()
