"""What the lab's other tools cost the portal (docs/integrations.md): a Prometheus scrape of
`/metrics` on 64 servers × 8 cards with a booking on most of them and a year of loans to the queue
(jobs/lending.py: 40 a day, each with its borrower's run), and a calendar app reading a feed of 1,000
bookings (its first read, and the 304 of every read after it while nothing changed).

Both are served by the WSGI app alone, as gunicorn calls it, and timed with their queries counted:
the scrape's must not grow with the cards, the feed's not with its bookings.
"""

from __future__ import annotations

from datetime import timedelta

from bench.common import counted, lab, median_ms, report, setup_django_test_db

SERVERS, GPUS, USERS, TEAMS = 64, 8, 50, 5
FEED_BOOKINGS = 1000
LOAN_DAYS, LOANS_A_DAY = 365, 40
TOKEN = "bench-metrics-token-0123456789"


def _book(owner, uuid: str, start, end, memory_mb: int | None = None) -> None:  # type: ignore[no-untyped-def]
    """A booking row and its allocation, straight in (the service's checks are not what is timed)."""
    from gpus.models import Allocation, Reservation

    reservation = Reservation.objects.create(
        owner=owner, team_id=owner.memberships.get().team_id, start=start, end=end, booked_end=end
    )
    Allocation.objects.create(reservation=reservation, gpu_id=uuid, memory_mb=memory_mb, start=start, end=end)


def _loans(users, cards: list[str], now) -> int:  # type: ignore[no-untyped-def]
    """A year of loans, straight in: each a card of a booking lent for 2 h to a borrower's job that
    ran 1.5 h of it (the scrape's lending counters run from the first loan ever made)."""
    from django.db import connection

    from gpus.models import Allocation, Reservation
    from jobs.models import Job

    teams = {user.pk: user.memberships.get().team_id for user in users}
    hours = timedelta(hours=1)
    for day in range(LOAN_DAYS, -1, -1):  # the last day's loans too: a scrape reads those
        plan = [
            # (lending owner, borrower, the loan's start, its card)
            (
                users[n % len(users)],
                users[(n + 7) % len(users)],
                now - timedelta(days=day, hours=2 + n % 20),
                cards[(day * LOANS_A_DAY + n) % len(cards)],
            )
            for n in range(LOANS_A_DAY)
        ]
        lent = Reservation.objects.bulk_create(
            Reservation(
                owner=owner,
                team_id=teams[owner.pk],
                start=start - hours,
                end=start + 4 * hours,
                booked_end=start + 4 * hours,
            )
            for owner, _, start, _ in plan
        )
        loans = Reservation.objects.bulk_create(
            Reservation(
                owner=borrower,
                team_id=teams[borrower.pk],
                start=start,
                end=start + 2 * hours,
                booked_end=start + 2 * hours,
                lent_from=booking,
            )
            for booking, (_, borrower, start, _) in zip(lent, plan, strict=True)
        )
        Allocation.objects.bulk_create(
            Allocation(reservation=one, gpu_id=card, start=one.start, end=one.end)
            for booking, loan, (*_, card) in zip(lent, loans, plan, strict=True)
            for one in (booking, loan)
        )
        Job.objects.bulk_create(
            Job(
                owner=loan.owner,
                team_id=loan.team_id,
                reservation=loan,
                name="train.py",
                queued=True,
                preemptible=True,
                gpu_count=1,
                status=Job.Status.SUCCEEDED,
                started_at=loan.start,
                finished_at=loan.start + 1.5 * hours,
            )
            for loan in loans
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # planner statistics, as autovacuum would have them on a live database
    return (LOAN_DAYS + 1) * LOANS_A_DAY


def _serve(handler, factory, path: str, expect: str, **headers: str) -> bytes:  # type: ignore[no-untyped-def]
    environ = factory.get(path, **{f"HTTP_{k.upper()}": v for k, v in headers.items()}).environ
    statuses: list[str] = []
    body = b"".join(handler(environ, lambda status, _headers: statuses.append(status)))
    assert statuses[0].startswith(expect), (path, statuses)
    return body


def main() -> None:
    teardown = setup_django_test_db()
    try:
        from django.conf import settings
        from django.core.handlers.wsgi import WSGIHandler
        from django.test import RequestFactory
        from django.utils import timezone
        from prometheus_client.parser import text_string_to_metric_families

        from gpus.calendars import calendar_feed_get
        from jobs.lending_report import lending_settle

        settings.METRICS_TOKEN = TOKEN
        settings.ALLOWED_HOSTS = ["*"]
        now = timezone.now()
        users, lab_cards = lab(servers=SERVERS, gpus=GPUS, users=USERS, teams=TEAMS)
        cards = [uuid for uuid, _ in lab_cards]
        for n, uuid in enumerate(cards):  # 7 cards in 10 booked now, every fifth of those a share
            if n % 10 < 7:
                _book(
                    users[n % USERS],
                    uuid,
                    now - timedelta(hours=2),
                    now + timedelta(hours=6),
                    8192 if n % 5 == 1 else None,
                )
        owner = users[-1]  # a heavy booker: a booking every 3 h over 60 days back and 65 ahead
        for n in range(FEED_BOOKINGS):
            start = now - timedelta(days=60) + timedelta(hours=3 * n)
            _book(owner, cards[-1], start, start + timedelta(hours=2))
        handler, factory = WSGIHandler(), RequestFactory()

        auth = {"authorization": f"Bearer {TOKEN}"}
        with counted() as scrape_queries:
            text = _serve(handler, factory, "/metrics", "200", **auth).decode()
        series = sum(len(family.samples) for family in text_string_to_metric_families(text))
        scrape_ms = median_ms(lambda: _serve(handler, factory, "/metrics", "200", **auth), repeat=15)
        print(f"  /metrics: {len(cards)} cards, {series} series, {len(text) / 1024:.0f} KiB")
        report("/metrics scrape, median", scrape_ms, "ms", "< 500", scrape_ms < 500)
        report("/metrics queries", len(scrape_queries), "", "<= 12", len(scrape_queries) <= 12)
        made = _loans(users, cards, now)
        unsettled_ms = median_ms(lambda: _serve(handler, factory, "/metrics", "200", **auth), repeat=3)
        counters = _lent(_serve(handler, factory, "/metrics", "200", **auth))
        print(f"  /metrics after a year of loans ({made:,}): {unsettled_ms:.0f} ms before beat settles them")
        settled = lending_settle(now)
        with counted() as lent_queries:
            assert _lent(_serve(handler, factory, "/metrics", "200", **auth)) == counters
        lent_ms = median_ms(lambda: _serve(handler, factory, "/metrics", "200", **auth), repeat=15)
        print(f"  settled: {settled:,} loans, the last day's {made - settled} read")
        report("/metrics scrape, a year of loans, median", lent_ms, "ms", "< 500", lent_ms < 500)
        report("/metrics queries, a year of loans", len(lent_queries), "", "<= 17", len(lent_queries) <= 17)

        path = f"/calendar/{calendar_feed_get(user=owner).secret}.ics"
        with counted() as feed_queries:
            ics = _serve(handler, factory, path, "200")
        events = ics.count(b"BEGIN:VEVENT")
        feed_ms = median_ms(lambda: _serve(handler, factory, path, "200"), repeat=7, warmup=1)
        etag = _etag(handler, factory, path)
        again_ms = median_ms(lambda: _serve(handler, factory, path, "304", if_none_match=etag), repeat=7)
        print(f"  calendar feed: {events} events, {len(ics) / 1024:.0f} KiB")
        report(f"calendar feed of {events} bookings, median", feed_ms, "ms", "< 1500", feed_ms < 1500)
        report("calendar feed re-read (304), median", again_ms, "ms", "< 1500", again_ms < 1500)
        report("calendar feed queries", len(feed_queries), "", "<= 8", len(feed_queries) <= 8)
    finally:
        teardown()


def _lent(body: bytes) -> list[tuple[str, float]]:
    """The lending counters' samples, as Prometheus reads them."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(body.decode())
    lending = [f for f in families if f.name.startswith("gpu_portal_lent_")]
    return sorted((s.name + str(sorted(s.labels.items())), s.value) for f in lending for s in f.samples)


def _etag(handler, factory, path: str) -> str:  # type: ignore[no-untyped-def]
    environ = factory.get(path).environ
    headers: list = []
    b"".join(handler(environ, lambda status, response_headers: headers.extend(response_headers)))
    return dict(headers)["ETag"]


if __name__ == "__main__":
    main()
