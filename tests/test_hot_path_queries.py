"""The hot paths take a fixed number of queries, whatever the lab's size (issue 40): the dashboard,
GET /api/v1/gpus/, a telemetry round and a watchdog round, each at two sizes, against the bounds
in tests/query_bounds.py (which the benches print beside their figures)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import connection, reset_queries
from django.test import Client
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo, Snapshot
from gpus.models import Violation, WatchdogPolicy
from gpus.services import servers_report_ingest
from jobs.host.watchdog import HostWatchdog
from tests import query_bounds
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db

SIZES = [(1, 1), (12, 8)]  # servers × cards: one card, and a lab of 96


def lab(servers: int, cards: int, *, processes: int = 2, util: int = 10) -> list:
    snapshots = [
        make_snapshot(f"s{servers}x{cards}-{s:02d}", gpus=cards, processes=processes, util=util)
        for s in range(servers)
    ]
    servers_report_ingest(snapshots=snapshots)
    return snapshots


def queries_of_page(path: str, user, bound: int, django_assert_max_num_queries) -> int:  # type: ignore[no-untyped-def]
    client = Client()
    client.force_login(user)
    client.get(path)  # the first request of a session warms what later ones find cached
    reset_queries()  # a request empties Django's query log as it starts: capture from an empty one
    with django_assert_max_num_queries(bound) as captured:
        assert client.get(path).status_code == 200
    return len(captured)


@pytest.mark.parametrize(
    "path, bound", [("/", query_bounds.DASHBOARD), ("/api/v1/gpus/", query_bounds.GPU_LIST)]
)
def test_the_dashboard_and_the_gpu_list_take_the_same_queries_for_one_card_or_many(
    alice, bob, path, bound, django_assert_max_num_queries
):
    counts = []
    for servers, cards in SIZES:
        snapshots = lab(servers, cards)
        # Some cards booked (one lent name, one not), so the bookings' names are read too.
        reservation_create(user=bob, gpus=[snapshots[0].gpus[0].uuid])
        counts.append(queries_of_page(path, alice, bound, django_assert_max_num_queries))
    assert counts[0] == counts[1], counts
    # The processes are alice's (make_snapshot): bob's page need not ask whose his username is.
    assert queries_of_page(path, bob, bound - 2, django_assert_max_num_queries) == counts[1] - 2


def test_a_telemetry_round_takes_the_same_queries_for_one_card_or_many(django_assert_max_num_queries):
    steady, changed = (
        query_bounds.INGEST_STEADY[connection.vendor],
        query_bounds.INGEST_CHANGED[connection.vendor],
    )
    counts = []
    for servers, cards in SIZES:
        lab(servers, cards, processes=3)
        moved = [
            make_snapshot(f"s{servers}x{cards}-{s:02d}", gpus=cards, processes=2) for s in range(servers)
        ]
        with django_assert_max_num_queries(changed) as every_list:
            servers_report_ingest(snapshots=moved)  # every card's process list changed
        again = [
            make_snapshot(f"s{servers}x{cards}-{s:02d}", gpus=cards, processes=2, util=50)
            for s in range(servers)
        ]
        with django_assert_max_num_queries(steady) as no_list:
            servers_report_ingest(snapshots=again)  # the figures moved, the lists did not
        counts.append((len(every_list), len(no_list)))
    assert counts[0] == counts[1], counts


def watched_host(name: str, cards: int, per_card: int) -> Snapshot:
    """A host whose every process is a stranger's on an unbooked card: each one a violation."""
    snapshot = make_snapshot(name, gpus=cards, processes=0)
    servers_report_ingest(snapshots=[snapshot])

    def strangers(card: int) -> tuple[ProcessInfo, ...]:
        pids = range(10_000 + 100 * card, 10_000 + 100 * card + per_card)
        return tuple(ProcessInfo(pid, f"user{pid % 7}", "python x.py", 100, pid, 1.7e9) for pid in pids)

    return replace(
        snapshot, gpus=tuple(replace(g, processes=strangers(n)) for n, g in enumerate(snapshot.gpus))
    )


def test_a_watchdog_round_takes_the_same_queries_for_a_few_processes_or_many(
    settings, django_assert_max_num_queries
):
    settings.WATCHDOG_DRY_RUN = True
    for kind in Violation.Kind.values:
        WatchdogPolicy.objects.update_or_create(kind=kind, defaults={"action": "observe", "grace_seconds": 0})
    counts = []
    for cards, per_card in [(1, 2), (8, 32)]:
        snapshot = watched_host(f"wd{cards}", cards, per_card)
        watchdog = HostWatchdog(snapshot.host.name, simulated=False)
        now = timezone.now()
        for step in range(3):  # the first round records the violations; then steady ones
            watchdog.round(snapshot, now=now + timedelta(seconds=2 * step))
        with django_assert_max_num_queries(query_bounds.WATCHDOG_ROUND) as steady:
            watchdog.round(snapshot, now=now + timedelta(seconds=8))
        assert (
            Violation.objects.filter(server__name=snapshot.host.name, ended_at=None).count()
            == cards * per_card
        )
        counts.append(len(steady))
    assert counts[0] == counts[1], counts
