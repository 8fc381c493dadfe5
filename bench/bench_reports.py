"""The Reports page's server time over a year of hourly usage rollups on 64 servers × 8 GPUs for a
50-user lab, and what the usage rollup costs the collector: its per-round work and its minute's write.

The year is written straight into UsageHour (4.5 million rows: one per card and hour, its booker's
or the unbooked time's), and its sums through the rollup's own `usage_sums_rebuild`. USAGE_BENCH_DAYS
shortens it for a quick run.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from bench.common import lab, median_ms, report, setup_django_test_db

SERVERS, GPUS, USERS, TEAMS, REQUESTS = 64, 8, 50, 5, 20
DAYS = int(os.environ.get("USAGE_BENCH_DAYS", "365"))


def _booker(card: int, day: int) -> int | None:
    """Who holds a card that day: users book four neighbouring cards for three days; 30 % are free."""
    if (card // 4 + day) % 10 >= 7:
        return None
    return ((card // 4) * 7 + day // 3) % USERS


def _seed_year(users, gpus, now) -> int:  # type: ignore[no-untyped-def]
    """A year of UsageHour rows, a day at a time, and their sums."""
    from django.db import connection, transaction

    from gpus.bulk import rows_insert
    from gpus.models import UsageFigures, UsageHour
    from gpus.usage import HOUR, hour_of, hour_of_week, usage_sums_rebuild

    fields = ["start", "hour_of_week", "gpu", "server", "team", "user", *UsageFigures.SUMMED[:5]]
    fields += ["peak_memory_mb", "jobs_succeeded", "jobs_failed", "jobs_other", "sessions"]
    teams = {u.pk: u.memberships.get().team_id for u in users}
    first = hour_of(now) - DAYS * 24 * HOUR
    written = 0
    for day in range(DAYS):
        rows = []
        for hour in range(24):
            moment = first + (day * 24 + hour) * HOUR
            # Raw rows: the moment as the ORM stores it (SQLite compares text).
            at = (connection.ops.adapt_datetimefield_value(moment), hour_of_week(moment))
            busy = 0.85 if 8 <= hour < 19 else 0.2
            for card, (uuid, server) in enumerate(gpus):
                who = _booker(card, day)
                if who is None:
                    rows.append((*at, uuid, server, None, None, 0.0, 0.02, 1.0, 0.0, 0.0, 500, 0, 0, 0, 0))
                    continue
                user = users[who].pk
                used = 0.0 if (card + day) % 5 == 0 else busy  # one booking in five sits idle
                idle = 1.0 if used == 0.0 else 0.0
                jobs = (1, int(card % 3 == 0), 0, 0) if hour == 17 else (0, 0, 0, 0)  # and no sessions
                rows.append((*at, uuid, server, teams[user], user, 1.0, used, 0.0, idle, 80.0, 60_000, *jobs))
        with transaction.atomic():  # one commit a day: SQLite's autocommit would sync every row
            rows_insert(UsageHour, fields, rows)
        written += len(rows)
    with transaction.atomic():
        usage_sums_rebuild(hours=[first + n * HOUR for n in range(DAYS * 24)])
    return written


def _book_now(users, gpus, now) -> None:  # type: ignore[no-untyped-def]
    """Today's bookings, for the rollup's cache: as the year's pattern has them, a few as shares."""
    from gpus.models import Allocation, Reservation

    start, end = now - timedelta(hours=6), now + timedelta(hours=6)
    for card, (uuid, _) in enumerate(gpus):
        who = _booker(card, DAYS)
        if who is None:
            continue
        user = users[who]
        reservation = Reservation.objects.create(
            owner=user, team_id=user.memberships.get().team_id, start=start, end=end, booked_end=end
        )
        Allocation.objects.create(
            reservation=reservation,
            gpu_id=uuid,
            memory_mb=8192 if card % 5 == 1 else None,
            start=start,
            end=end,
        )


def main() -> None:
    teardown = setup_django_test_db()
    try:
        from django.contrib.auth import get_user_model
        from django.core.handlers.wsgi import WSGIHandler
        from django.db import connection
        from django.test import Client, RequestFactory
        from django.utils import timezone

        from gpus.usage import UsageRollup
        from tests.factories import make_snapshot

        now = timezone.now()
        users, gpus = lab(servers=SERVERS, gpus=GPUS, users=USERS, teams=TEAMS)
        began = time.perf_counter()
        rows = _seed_year(users, gpus, now)
        seeded_s = time.perf_counter() - began
        _book_now(users, gpus, now)
        admin = get_user_model().objects.create_user("admin", is_staff=True)
        handler = WSGIHandler()
        factory = RequestFactory()

        def cookie_of(user) -> str:  # type: ignore[no-untyped-def]
            client = Client()
            client.force_login(user)
            return "; ".join(f"{k}={v.value}" for k, v in client.cookies.items())

        def serve(path: str, cookie: str) -> None:
            """The WSGI app alone, as gunicorn calls it: no test-client instrumentation."""
            environ = factory.get(path, HTTP_COOKIE=cookie).environ
            statuses = []
            body = b"".join(handler(environ, lambda status, headers: statuses.append(status)))
            assert statuses[0].startswith("200") and body, (path, statuses)

        today = timezone.localdate()
        month, year = (today - timedelta(days=29)).isoformat(), (today - timedelta(days=364)).isoformat()
        leader, member, boss = cookie_of(users[0]), cookie_of(users[TEAMS]), cookie_of(admin)
        pages = [
            ("reports page, leader, this month (default)", "/reports/", leader, True),
            ("reports page, leader, last 30 days", f"/reports/?since={month}", leader, True),
            ("reports page, leader, last 365 days", f"/reports/?since={year}", leader, True),
            ("reports page, member, last 365 days", f"/reports/?since={year}", member, True),
            ("reports page, admin, last 30 days", f"/reports/?since={month}", boss, True),
            ("reports page, admin, last 365 days", f"/reports/?since={year}", boss, True),
            (
                "reports page, admin, one server, 365 days",
                f"/reports/?since={year}&server=bench07",
                boss,
                True,
            ),
            ("usage API by card, admin, 30 days", f"/api/v1/usage/?group_by=gpu&since={month}", boss, False),
        ]
        print(
            f"Reports ({USERS} users, {SERVERS} servers × {GPUS} GPUs, {DAYS} days of hourly rollups = "
            f"{rows:,} hour rows, seeded in {seeded_s:.0f} s; {connection.vendor}, median of {REQUESTS})"
        )
        for name, path, cookie, goal in pages:
            ms = median_ms(lambda path=path, cookie=cookie: serve(path, cookie), repeat=REQUESTS, warmup=2)
            report(name, ms, "ms", "<= 200 ms" if goal else "(none)", ms <= 200 or not goal)

        # The collector: every card of every server reports each round, 3 s apart; a write a minute.
        rollup = UsageRollup()
        rollup.flush(now)
        cards = []
        for s in range(SERVERS):
            snapshot = make_snapshot(f"bench{s:02d}", gpus=GPUS, util=(s * 13) % 100, processes=s % 2)
            server_id = gpus[s * GPUS][1]
            cards += [(server_id, card) for card in snapshot.gpus]
        clock = {"now": now}

        def round_() -> None:
            clock["now"] += timedelta(seconds=3)
            rollup.observe(cards, clock["now"])

        round_ms = median_ms(round_, repeat=15, warmup=2)
        report(
            f"rollup per collector round, {SERVERS * GPUS} cards", round_ms, "ms", "<= 5 ms", round_ms <= 5
        )
        flush_ms = median_ms(lambda: rollup.flush(clock["now"]), repeat=5, warmup=1)
        report("rollup write (once a minute)", flush_ms, "ms", "(none)", True)
    finally:
        teardown()


if __name__ == "__main__":
    main()
