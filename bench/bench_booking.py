"""Booking throughput and integrity: 16 concurrent clients on PostgreSQL, 512 GPUs, 10,000 bookings.

What is measured
    Checked bookings per second: calls of `gpus.booking.reservation_create` that completed with
    an answer, either a booking (accepted) or a refusal (Conflict / QuotaExceeded), summed over
    all clients and divided by the wall time of the phase. Goal: ≥ 150/s with every query through
    the ORM (a lab makes hundreds of bookings a day, not a second). Afterwards, the
    count of double bookings in the whole Allocation table, which must be 0.

How
    Set-up, in a throw-away PostgreSQL test database: 64 servers × 8 GPUs registered through
    `servers_report_ingest`; 16 users in 4 teams of 4 (no member quotas; one team has generous
    team limits so the quota path, with its team row lock and usage query, runs too); 10,000
    existing future bookings over the 512 cards (whole cards and memory quotas, never
    overlapping illegally), written with bulk_create rather than through the service.

    Load: 16 client processes (fork; each closes inherited connections and opens its own),
    released together by a barrier. Phase 1 ("spread"): for DURATION_S seconds each client books
    one random card for a random 1-8 h window in the next 7 days, whole or 2-12 GB, from a
    seeded RNG, so part of the attempts are refused. Phase 2 ("contention"): for CONTENTION_S
    seconds all 16 hammer the same 4 cards with windows inside one 24 h span, so checks of the
    same card really race on its row lock.

    Integrity: a SQL self-join counts pairs of live allocations on one card with overlapping
    windows where at least one is a whole card; a sweep per card counts the times the memory of
    overlapping shared allocations rises above the card's bookable memory. The number of new
    reservations must equal the number of accepted bookings. Then, in this process alone, a
    few bookings under CaptureQueriesContext give the queries and time per booking, for a team
    with limits and for teams without (the quota check reads the team's bookings of the week).

Exits 1 when a double booking is found or a client hit an error other than a refusal; a
missed throughput goal only prints MISSED.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import report, setup_django_test_db

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/test"
SERVERS, GPUS_PER_SERVER = 64, 8
USERS, TEAMS = 16, 4
EXISTING_BOOKINGS = 10_000
EXISTING_SPREAD_DAYS = 21  # existing bookings lie in the next 3 weeks
NEW_WITHIN_DAYS = 7  # new bookings start in the next week
CLIENTS = 16
DURATION_S = 10.0
CONTENTION_S = 4.0
CONTENTION_CARDS = 4
GOAL_PER_S = 150.0
SEED = 20240611
PROFILE_BOOKINGS = 40
STEP = timedelta(minutes=15)


def use_postgres() -> None:
    """Point Django at PostgreSQL unless DATABASE_URL already does (before django.setup())."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://", "pgsql://")):
        os.environ["DATABASE_URL"] = DEFAULT_DATABASE_URL


@dataclass
class Attempt:
    """One booking a client asks for."""

    gpu: str
    start: datetime
    end: datetime
    memory_mb: int | None


@dataclass
class ClientResult:
    phase: str
    started: float
    finished: float
    limited: bool = False  # the client's team has limits, so its bookings serialise on the team row
    cpu_s: float = 0.0  # CPU time of the client process in the phase
    db_cpu_s: float | None = None  # CPU time of its PostgreSQL backend, when that runs on this machine
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_sample: str = ""
    latencies_ms: list[float] = field(default_factory=list)


def random_attempt(rng: random.Random, cards: list[str], base: datetime, span: timedelta) -> Attempt:
    """A card, a start on a 15-minute step within `span` of `base`, 1-8 h, whole or 2-12 GB."""
    start = base + STEP * rng.randrange(int(span / STEP))
    end = start + timedelta(minutes=30) * rng.randint(2, 16)
    memory_mb = None if rng.random() < 0.5 else 1024 * rng.randint(2, 12)
    return Attempt(rng.choice(cards), start, end, memory_mb)


# --- set-up ---------------------------------------------------------------------------


def existing_windows(rng: random.Random, count: int, base: datetime) -> list[tuple[datetime, datetime, list]]:
    """`count` bookings on one card as disjoint slots: one whole card, or one or two memory
    quotas (≤ 10 GB each, so any two fit on a 24 GB card) whose windows may overlap."""
    bookings: list[tuple[datetime, datetime, list]] = []
    span = timedelta(days=EXISTING_SPREAD_DAYS)
    mean_gap = span / max(1, count) * 0.8  # leaves room for the slots themselves
    at = base
    while len(bookings) < count:
        at += STEP * rng.randrange(1, max(2, int(2 * mean_gap / STEP)))
        length = timedelta(minutes=30) * rng.randint(2, 16)
        if rng.random() < 0.6:
            bookings.append((at, at + length, [None]))
        else:
            bookings.append((at, at + length, [1024 * rng.randint(2, 10)]))
            if len(bookings) < count and rng.random() < 0.5:
                offset = STEP * rng.randrange(1, int(length / STEP))
                bookings.append((at + offset, at + offset + length, [1024 * rng.randint(2, 10)]))
                length += offset
        at += length
    return bookings


def set_up(base: datetime) -> tuple[list[Any], list[str]]:
    """Servers, users and teams, and the existing bookings; returns (users, card UUIDs)."""
    from django.contrib.auth import get_user_model
    from django.db import connection

    from gpus.models import GPU, Allocation, Reservation
    from gpus.services import servers_report_ingest
    from portal.models import Membership, Team
    from tests.factories import make_snapshot

    servers_report_ingest(
        snapshots=[make_snapshot(f"bench{s:02d}", gpus=GPUS_PER_SERVER) for s in range(SERVERS)]
    )
    cards = sorted(GPU.objects.values_list("uuid", flat=True))
    assert len(cards) == SERVERS * GPUS_PER_SERVER, len(cards)

    teams = [Team.objects.create(name=f"Bench team {t}", slug=f"bench-team-{t}") for t in range(TEAMS)]
    # Generous team limits: never refuse here, but run the quota code (team lock, usage query).
    Team.objects.filter(pk=teams[0].pk).update(max_cards=100_000, max_gb=10_000_000, gpu_hours_per_week=10**8)
    users = [get_user_model().objects.create_user(f"bench{u:02d}") for u in range(USERS)]
    team_of = {u.pk: teams[i % TEAMS] for i, u in enumerate(users)}
    Membership.objects.bulk_create(Membership(team=team_of[u.pk], user=u) for u in users)

    rng = random.Random(SEED)
    per_card, extra = divmod(EXISTING_BOOKINGS, len(cards))
    planned: list[tuple[Reservation, str, int | None]] = []
    for i, card in enumerate(cards):
        for start, end, memories in existing_windows(rng, per_card + (i < extra), base):
            owner = rng.choice(users)
            reservation = Reservation(
                owner=owner, team=team_of[owner.pk], start=start, end=end, booked_end=end, note="existing"
            )
            planned.extend((reservation, card, memory_mb) for memory_mb in memories)
    Reservation.objects.bulk_create([r for r, _, _ in planned], batch_size=2000)
    Allocation.objects.bulk_create(
        (
            Allocation(reservation=r, gpu_id=card, memory_mb=mb, start=r.start, end=r.end, live=True)
            for r, card, mb in planned
        ),
        batch_size=2000,
    )
    assert Reservation.objects.count() == EXISTING_BOOKINGS
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # planner statistics, as autovacuum would have them on a live database
    return users, cards


# --- load -------------------------------------------------------------------------------


def book(user: Any, attempt: Attempt, result: ClientResult) -> None:
    from gpus.booking import reservation_create
    from portal.errors import Conflict, QuotaExceeded, ServiceError

    began = time.perf_counter()
    try:
        reservation_create(
            user=user, gpus=[attempt.gpu], start=attempt.start, end=attempt.end, memory_mb=attempt.memory_mb
        )
        result.accepted += 1
    except (Conflict, QuotaExceeded) as refusal:
        result.refused[type(refusal).__name__] += 1
    except ServiceError as error:  # Invalid or Forbidden: the bench asked for something wrong
        result.errors[type(error).__name__] += 1
        result.error_sample = result.error_sample or error.message
    except Exception as error:  # e.g. a deadlock or serialisation failure: a real finding
        result.errors[type(error).__name__] += 1
        result.error_sample = result.error_sample or f"{type(error).__name__}: {error}"
    result.latencies_ms.append((time.perf_counter() - began) * 1000)


def backend_cpu_s() -> float | None:
    """CPU time so far of this connection's PostgreSQL backend process, if the server is local."""
    from django.db import connection

    if connection.settings_dict["HOST"] not in ("", "localhost", "127.0.0.1", "::1"):
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def client(
    index: int,
    user_id: int,
    cards: list[str],
    hot_cards: list[str],
    base: datetime,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: phase 1 over all cards, then phase 2 on the hot cards."""
    import django
    from django.db import connections

    connections.close_all()  # never reuse a connection of the parent (it closed its own first)
    django.setup()  # a no-op after fork; keeps the function valid under "spawn" too
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(pk=user_id)  # also opens this process's connection
    rng = random.Random(SEED * 100 + index)
    phases = [
        ("spread", DURATION_S, cards, base, timedelta(days=NEW_WITHIN_DAYS)),
        ("contention", CONTENTION_S, hot_cards, base + timedelta(days=2), timedelta(hours=24)),
    ]
    try:
        for phase, duration, pool, window_base, span in phases:
            barrier.wait(timeout=120)
            db_cpu, cpu = backend_cpu_s(), time.process_time()
            result = ClientResult(phase, started=time.monotonic(), finished=0.0, limited=index % TEAMS == 0)
            deadline = result.started + duration
            while time.monotonic() < deadline:
                book(user, random_attempt(rng, pool, window_base, span), result)
            result.finished = time.monotonic()
            result.cpu_s = time.process_time() - cpu
            db_cpu_after = backend_cpu_s()
            if db_cpu is not None and db_cpu_after is not None:
                result.db_cpu_s = db_cpu_after - db_cpu
            results.put(result)
    finally:
        connections.close_all()


def run_clients(
    users: list[Any], cards: list[str], hot_cards: list[str], base: datetime
) -> list[ClientResult]:
    from django.db import connections

    connections.close_all()  # forked children must not share the parent's socket
    context = mp.get_context("fork")
    barrier = context.Barrier(CLIENTS)
    results = context.Queue()
    processes = [
        context.Process(
            target=client, args=(i, users[i % len(users)].pk, cards, hot_cards, base, barrier, results)
        )
        for i in range(CLIENTS)
    ]
    for process in processes:
        process.start()
    collected: list[ClientResult] = []
    try:
        while len(collected) < 2 * CLIENTS:
            try:
                collected.append(results.get(timeout=1))
            except queue.Empty:
                crashed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if crashed:
                    raise RuntimeError(f"client processes exited with {crashed}") from None
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:  # only after a failure: they have all exited otherwise
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    assert not failed, f"client processes exited with {failed}"
    return collected


def summarise(phase: str, results: list[ClientResult], goal: bool) -> tuple[int, Counter[str], str]:
    """Print one phase's figures; returns (errors, error kinds, an error message)."""
    mine = [r for r in results if r.phase == phase]
    wall = max(r.finished for r in mine) - min(r.started for r in mine)
    accepted = sum(r.accepted for r in mine)
    refused = sum(sum(r.refused.values()) for r in mine)
    checked = accepted + refused
    latencies = sorted(x for r in mine for x in r.latencies_ms)
    p95 = latencies[int(0.95 * (len(latencies) - 1))] if latencies else 0.0
    errors: Counter[str] = sum((r.errors for r in mine), Counter())
    kinds = sum((r.refused for r in mine), Counter())
    limited = sum(r.accepted + sum(r.refused.values()) for r in mine if r.limited)
    print(
        f" {phase}: {checked} checked bookings in {wall:.1f} s: {accepted} accepted, "
        f"{refused} refused ({dict(kinds)}), {sum(errors.values())} errors; "
        f"{limited / wall:.0f}/s from the {sum(r.limited for r in mine)} clients of the team with limits"
    )
    rate = checked / wall
    if goal:
        report(
            f"{phase}: checked bookings/s, {CLIENTS} clients",
            rate,
            "/s",
            f">= {GOAL_PER_S:.0f}/s",
            rate >= GOAL_PER_S,
        )
    else:
        report(f"{phase}: checked bookings/s, {CLIENTS} clients", rate, "/s", "(none)", True)
    report(f"{phase}: accepted bookings/s", accepted / wall, "/s", "(none)", True)
    report(f"{phase}: refused share", 100 * refused / max(1, checked), "%", "(none)", True)
    report(f"{phase}: latency per booking, median", statistics.median(latencies or [0]), "ms", "(none)", True)
    report(f"{phase}: latency per booking, 95th percentile", p95, "ms", "(none)", True)
    # CPU per booking does not depend on what else the machine runs: capacity = cores / CPU per booking.
    client_ms = 1000 * sum(r.cpu_s for r in mine) / max(1, checked)
    report(f"{phase}: client CPU per checked booking", client_ms, "ms", "(none)", True)
    if all(r.db_cpu_s is not None for r in mine):
        db_ms = 1000 * sum(r.db_cpu_s or 0.0 for r in mine) / max(1, checked)
        report(f"{phase}: PostgreSQL CPU per checked booking", db_ms, "ms", "(none)", True)
        ceiling = 1000 * (os.cpu_count() or 1) / (client_ms + db_ms)
        report(f"{phase}: CPU ceiling on {os.cpu_count()} cores, nothing else", ceiling, "/s", "(none)", True)
    return sum(errors.values()), errors, next((r.error_sample for r in mine if r.error_sample), "")


# --- integrity ----------------------------------------------------------------------------


def whole_card_overlaps() -> int:
    """Pairs of live allocations on one card, overlapping in time, at least one a whole card."""
    from django.db import connection

    from gpus.models import Allocation

    table = connection.ops.quote_name(Allocation._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT count(*) FROM {table} a JOIN {table} b
              ON a.gpu_id = b.gpu_id AND a.id < b.id
             AND a.start < b."end" AND b.start < a."end"
             WHERE a.live AND b.live AND (a.memory_mb IS NULL OR b.memory_mb IS NULL)
            """
        )
        return cursor.fetchone()[0]


def memory_overflows() -> int:
    """Times the memory of overlapping shared allocations on a card rises above its bookable memory."""
    from gpus.models import GPU, Allocation

    bookable = {g.uuid: g.memory_bookable_mb for g in GPU.objects.all()}
    events: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    shared = Allocation.objects.filter(live=True, memory_mb__isnull=False)
    for gpu_id, start, end, memory_mb in shared.values_list("gpu_id", "start", "end", "memory_mb").iterator():
        events[gpu_id] += [(start, memory_mb), (end, -memory_mb)]
    overflows = 0
    for gpu_id, edges in events.items():
        edges.sort()  # at one instant the ends (negative) come first: windows are half-open
        in_use = 0
        for _, delta in edges:
            before, in_use = in_use, in_use + delta
            if in_use > bookable[gpu_id] >= before:
                overflows += 1
    return overflows


# --- one process: queries and time per booking ------------------------------------------------


def profile_single(users: list[Any], cards: list[str], base: datetime) -> None:
    """Queries and time per booking, accepted or refused, for a team with limits and one without."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    rng = random.Random(SEED - 1)
    with_limits = users[::TEAMS]  # team 0: users 0, 4, 8, 12
    without = [u for u in users if u not in with_limits]
    print(f" one client alone, {PROFILE_BOOKINGS} bookings per kind of team (queries captured):")
    for kind, group in (("limited team", with_limits), ("unlimited teams", without)):
        queries: dict[bool, list[int]] = {True: [], False: []}
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(PROFILE_BOOKINGS):
            attempt = random_attempt(rng, cards, base, timedelta(days=NEW_WITHIN_DAYS))
            result = ClientResult("profile", 0.0, 0.0)
            with CaptureQueriesContext(connection) as captured:
                book(group[i % len(group)], attempt, result)
            queries[result.accepted == 1].append(len(captured.captured_queries))
            times[result.accepted == 1].append(result.latencies_ms[0])
        for accepted, label in ((True, "accepted"), (False, "refused")):
            if queries[accepted]:
                mean_queries = statistics.mean(queries[accepted])
                report(f"{kind}: queries per {label}", mean_queries, "", "(none)", True)
                median_ms = statistics.median(times[accepted])
                report(f"{kind}: time per {label}, median", median_ms, "ms", "(none)", True)


# --- main -----------------------------------------------------------------------------------


def main() -> int:
    use_postgres()
    from django.conf import settings

    database = settings.DATABASES["default"]
    # Not test_<name> itself: a test run on the same server may be using that one right now.
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_bench_booking"
    teardown = setup_django_test_db()
    try:
        from django.db import connection
        from django.utils import timezone

        from gpus.models import Allocation, Reservation

        assert connection.vendor == "postgresql", connection.vendor
        base = timezone.now().replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        began = time.perf_counter()
        users, cards = set_up(base)
        setup_s = time.perf_counter() - began
        hot_cards = random.Random(SEED + 1).sample(cards, CONTENTION_CARDS)
        allocations_before = Allocation.objects.count()
        print(
            f"Booking ({len(cards)} GPUs on {SERVERS} servers, {EXISTING_BOOKINGS} existing bookings, "
            f"{CLIENTS} client processes, {DURATION_S:.0f} s spread + {CONTENTION_S:.0f} s on "
            f"{CONTENTION_CARDS} cards, PostgreSQL {connection.pg_version // 10000} "
            f"{settings.DATABASES['default']['NAME']}, set-up {setup_s:.1f} s, {os.cpu_count()} CPUs)"
        )

        results = run_clients(users, cards, hot_cards, base)
        errors = 0
        for phase in ("spread", "contention"):
            count, kinds, sample = summarise(phase, results, goal=phase == "spread")
            if count:
                errors += count
                print(f"  ! {phase}: {count} errors {dict(kinds)}; first: {sample}")

        accepted = sum(r.accepted for r in results)
        new_reservations = Reservation.objects.count() - EXISTING_BOOKINGS
        new_allocations = Allocation.objects.count() - allocations_before
        overlaps, overflows = whole_card_overlaps(), memory_overflows()
        double = overlaps + overflows
        print(
            f" integrity over {Allocation.objects.count()} allocations: {overlaps} whole-card overlaps, "
            f"{overflows} memory overflows; {new_reservations} new reservations and {new_allocations} "
            f"allocations for {accepted} accepted bookings"
        )
        report("double bookings", double, "", "= 0", double == 0)
        consistent = new_reservations == new_allocations == accepted
        if not consistent:
            print("  ! the rows written do not match the bookings accepted")

        profile_single(users, cards, base)
        return 1 if double or errors or not consistent else 0
    finally:
        from django.db import connections

        connections.close_all()
        teardown()


if __name__ == "__main__":
    sys.exit(main())
