"""Lending idle bookings to the queue: booked cards nobody uses run preemptible queued jobs, and
come back the moment their owner does.

**Lent.** A booking idle for LEND_AFTER_MINUTES (gpus/idle.py's clock: every card known unused,
a share's card with no process at all; and no process on its cards in the last telemetry round,
which is fresher than the clock), of a team that lends (`Team.lend_idle`, on by default),
with no job or session of its own running and no loan already, may take a preemptible pending
job (`loans_place`, called by each scheduler pass after the plan's own starts). The job gets a
booking of its own, a *loan* (`Reservation.lent_from`), on whole cards of that booking (or a share
of them for a share job), for its time limit, or until the lent booking ends if that is sooner (at
least LOAN_MIN_MINUTES away): a loan never outlives what it borrows. A borrower still there as
its loan reaches the lent booking's end is preempted LEND_GRACE_SECONDS and a little before
(`loans_expire`, each scheduler pass): it goes back to the queue and resumes elsewhere from its
checkpoint, as when the owner comes back. The loan is a booking like any other:
the booking service checks it (beside the lent booking alone), quotas count it, the audit log has
it, and the job's end releases it.

**Taken back.** The owner comes first (`loans_take_back`): their job or `gpu exec` on the
booking, their first process on a lent card (seen in the telemetry, `loans_watch`), or *Take it
back* on the booking's page preempts the borrower at once, with LEND_GRACE_SECONDS between
SIGTERM and SIGKILL (jobs.preemption). The borrower goes back to the queue at its old place and
resumes elsewhere from its checkpoint. The owner's job on the booking is sent to its host only once
the borrower has left the cards (`JobQuerySet.borrowers_gone`, in jobs.services.dispatch): the
scheduler's pass that the borrower's leaving wakes sends it, so it never starts beside a borrower
still saving its checkpoint, and waits no longer than that. The owner's processes are never
intruders meanwhile: the card is still theirs (jobs.watchdog.rules sees their booking on it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from gpus.booking import reservation_create, reservation_locked
from gpus.idle import idle_clock_restart
from gpus.inventory import GPUInfo, ProcessInfo
from gpus.models import Allocation, GPUProcess, Reservation
from gpus.noshow import reservation_mark_used
from jobs.models import InteractiveSession, Job
from jobs.preemption import job_preempt
from jobs.queue.rules import Entry
from portal.access import can_manage
from portal.accounts import users_by_unix_name
from portal.errors import Forbidden, ServiceError

log = logging.getLogger(__name__)

# A pending job's reasons that lending can help: it waits for cards, not for a time or a limit.
LENDING_HELPS = ("resources", "priority")
# A loan shorter than this costs its borrower more (its start-up, the work since its last
# checkpoint) than it gives: an idle booking ending sooner is not lent.
LOAN_MIN_MINUTES = 30
# A borrower whose loan ends with its lent booking is asked to leave this long before its grace
# (LEND_GRACE_SECONDS): the scheduler's next passes (every QUEUE_SCHEDULE_SECONDS) and its
# supervisor's poll must fit before the end, or its time would run out as a timeout, not a leave.
EXPIRE_MARGIN = timedelta(seconds=15)


@dataclass(frozen=True)
class Lendable:
    """An idle booking that may be lent now: its cards (uuid → booked MiB, None: whole), where."""

    booking: Reservation
    cards: dict[str, int | None]
    server_id: int


def lendable(now: datetime) -> list[Lendable]:
    """The bookings that may be lent now (see the module's text), oldest idle first."""
    bookings = list(_lendable_bookings(now).order_by("idle_since", "pk"))
    cards: dict[int, dict[str, int | None]] = {}
    servers: dict[int, int] = {}
    rows = Allocation.objects.filter(reservation__in=bookings).values_list(
        "reservation_id", "gpu_id", "memory_mb", "gpu__server_id"
    )  # one read for every candidate's cards
    for booking, uuid, mb, server in rows:
        cards.setdefault(booking, {})[uuid] = mb
        servers[booking] = server
    return [Lendable(b, cards[b.pk], servers[b.pk]) for b in bookings if b.pk in cards]


def _lendable_bookings(now: datetime) -> QuerySet[Reservation]:
    """The one rule of what may be lent now: `lendable`'s read, and `_lend`'s check again."""
    cutoff = now - timedelta(minutes=settings.LEND_AFTER_MINUTES)
    busy_jobs = Job.objects.filter(reservation=OuterRef("pk"), status__in=Job.ACTIVE)
    busy_sessions = InteractiveSession.objects.filter(
        reservation=OuterRef("pk"), status__in=InteractiveSession.ACTIVE
    )
    lent = Reservation.objects.loans_live(now).filter(lent_from=OuterRef("pk"))
    # The idle clock moves once a round (IDLE_CHECK_SECONDS); the last telemetry round is fresher:
    # an owner whose process just took a borrower's place must not see the card lent again.
    in_use = GPUProcess.objects.filter(gpu__allocations__reservation=OuterRef("pk"))
    return (
        Reservation.objects.with_status("active", now)
        .filter(lent_from=None, team__lend_idle=True, idle_since__lte=cutoff)
        .exclude(Exists(busy_jobs))
        .exclude(Exists(busy_sessions))
        .exclude(Exists(lent))
        .exclude(Exists(in_use))
    )


def _fits(entry: Entry, lent: Lendable) -> list[str]:
    """The lent cards the waiting job takes, or []: enough of them on a server it may use, each
    whole or with the memory it asks, for a loan that ends within the lent booking."""
    r = entry.request
    if r.server_id is not None and r.server_id != lent.server_id:
        return []
    if r.servers is not None and lent.server_id not in r.servers:
        return []
    if r.gpu_count > len(lent.cards):
        return []
    fitting = [
        uuid
        for uuid, held in sorted(lent.cards.items())
        if held is None or (r.memory_mb is not None and r.memory_mb <= held)
    ]
    return fitting[: r.gpu_count] if len(fitting) >= r.gpu_count else []


Bind = Callable[[Job, Reservation, datetime], None]


Rooms = Callable[[], dict[int, int]]


def loans_place(entries: Sequence[Entry], now: datetime, *, bind: Bind, slots: Rooms, arrays: Rooms) -> int:
    """Start preemptible jobs that still wait, in plan order, on idle bookings lent to the queue
    (one loan per booking); how many started. `bind`: the scheduler's start of a job on a booking
    (PENDING → QUEUED, then sent to its host), as it starts every job; it calls here. `slots`:
    each server's free job slots now, of the servers whose worker said so lately (the scheduler's
    `_free_slots`), read only where a booking may be lent: a loan is a start like any, so a
    silent worker's or a full one's cards are not lent. `arrays`: how many more tasks each array
    may run now, so a loan keeps an array's limit as a start does. A refusal of the booking
    service is that job's alone, as in the scheduler's own starts."""
    placed = _matches(entries, now, (slots, arrays), partial(_lend, now=now, bind=bind))
    return sum(1 for _ in placed)


def loans_preview(
    entries: Sequence[Entry], now: datetime, *, slots: dict[int, int], arrays: dict[int, int]
) -> list[int]:
    """The jobs `loans_place` would place now, booking nothing (the queue's estimated start)."""
    rooms = (lambda: slots, lambda: arrays)
    return [entry.request.job_id for entry in _matches(entries, now, rooms, lambda *_: True)]


def _matches(
    entries: Sequence[Entry],
    now: datetime,
    rooms: tuple[Rooms, Rooms],
    take: Callable[[Entry, Lendable, list[str]], bool],
) -> Iterable[Entry]:
    """Each waiting preemptible job, in plan order, with the first lent booking it fits on a
    server with a free job slot, while its array may run one more task (`rooms`: the servers'
    free slots and the arrays' room, read only when something is lendable and counted down here);
    `take` books it (or not: a refusal leaves the booking for the next job)."""
    preemptible = _preemptible(entries)  # one read for the whole plan
    waiting = [e for e in entries if e.request.job_id in preemptible and e.reason in LENDING_HELPS]
    free = lendable(now) if waiting else []
    if not free:
        return  # a steady pass with nothing to lend reads no slots
    room, arrays = dict(rooms[0]()), dict(rooms[1]())
    for entry in waiting:
        array = entry.request.array_id
        if array is not None and arrays.get(array, 1) < 1:
            continue  # its array runs all the tasks it may at once
        for lent in free:
            if room.get(lent.server_id, 0) < 1:
                continue
            cards = _fits(entry, lent)
            if not cards or lent.booking.end - now < timedelta(minutes=LOAN_MIN_MINUTES):
                continue
            if take(entry, lent, cards):
                free.remove(lent)
                room[lent.server_id] -= 1
                if array is not None:
                    arrays[array] = arrays.get(array, 1) - 1
                yield entry
            break


def _preemptible(entries: Sequence[Entry]) -> set[int]:
    """The plan's waiting jobs that may be preempted: read as the few pending preemptible jobs,
    not by the thousand ids of the plan."""
    ids = {e.request.job_id for e in entries if not e.start_now}
    pending = (
        Job.objects.filter(status=Job.Status.PENDING, preemptible=True)
        .order_by()
        .values_list("pk", flat=True)
    )
    return ids.intersection(pending)


def _lend(entry: Entry, lent: Lendable, cards: list[str], now: datetime, bind: Bind) -> bool:
    """Book the loan and dispatch the job on it, as the scheduler starts any job."""
    r = entry.request
    try:
        with transaction.atomic():
            # The lent booking's row: the loan and its owner's return (`loans_take_back`) take turns on it.
            reservation_locked(lent.booking.pk)
            if not _lendable_bookings(now).filter(pk=lent.booking.pk).exists():
                return False  # its owner came back (or it ended) since `lendable` read it
            job = Job.objects.select_related("owner", "team").get(pk=r.job_id)
            if job.status != Job.Status.PENDING or not job.owner.is_active:
                return False
            loan = reservation_create(
                user=job.owner,
                team=job.team,
                gpus=cards,
                memory_mb=job.memory_mb,
                start=now,
                end=min(now + r.booked, lent.booking.end),  # preempted at its end (`loans_expire`)
                note=f"Queued job {job.pk} ({job.name}), on booking {lent.booking.pk} lent to the queue",
                now=now,
                lent_from=lent.booking,
            )
            bind(job, loan, now)
    except ServiceError as refusal:
        log.info("Job %s could not borrow booking %s: %s", r.job_id, lent.booking.pk, refusal.message)
        return False
    log.info("Lent booking %s to queued job %s on %s", lent.booking.pk, r.job_id, ", ".join(cards))
    return True


# --- the owner comes back ----------------------------------------------------------------------------


def loans_take_back(
    *, booking: Reservation | int, why: str, now: datetime | None = None, owner_back: bool = True
) -> list[int]:
    """Every borrower on `booking`'s cards is preempted at once, with LEND_GRACE_SECONDS as its
    grace; the jobs asked. `owner_back`: the owner's own work is why, which counts as their use of
    the booking (never a no-show). Safe to repeat: a job asked already is not asked again."""
    now = now or timezone.now()
    pk = booking if isinstance(booking, int) else booking.pk
    with transaction.atomic():  # within the owner's start, the lock lasts until that commits
        reservation_locked(pk)  # as `_lend` takes it: either sees the other
        idle_clock_restart(pk)  # lent again only after a new idle stretch, not by the next pass
        if owner_back:
            reservation_mark_used(pk, now)
        loans = Reservation.objects.loans_live(now).filter(lent_from_id=pk)
        jobs = Job.objects.filter(
            reservation__in=loans, status__in=(Job.Status.QUEUED, Job.Status.STARTING, Job.Status.RUNNING)
        )
        asked = [
            job
            for job in jobs.values_list("pk", flat=True)
            if job_preempt(job=job, reason=why, grace_seconds=settings.LEND_GRACE_SECONDS, now=now)
        ]
    if asked:
        log.info("Booking %s taken back from jobs %s: %s", pk, asked, why)
    return asked


def loans_expire(now: datetime) -> list[int]:
    """Each scheduler pass: the borrowers whose loan ends within their grace (and EXPIRE_MARGIN)
    before their own time limit would are asked to leave now, back to the queue, rather than run
    into the loan's end and time out. The loan was cut to its lent booking's end, which may have
    moved since (extended, released, cancelled): the loan's own end is what binds the job. The
    jobs asked; safe to repeat (a job asked already is not asked again)."""
    soon = now + timedelta(seconds=settings.LEND_GRACE_SECONDS) + EXPIRE_MARGIN
    ending = Reservation.objects.loans_live(now).filter(end__lte=soon)
    jobs = Job.objects.filter(reservation__in=ending, status__in=Job.ON_CARDS, preempt_requested_at=None)
    asked = []
    for job in jobs.select_related("reservation").only(
        "pk", "started_at", "time_limit_minutes", "reservation__end", "reservation__lent_from_id"
    ):
        loan = job.reservation
        if job.deadline(loan.end) < loan.end:
            continue  # its own time limit ends it first: a time-out of its own, not a leave
        why = f"its loan of booking {loan.lent_from_id} ends at {timezone.localtime(loan.end):%H:%M}"
        if job_preempt(job=job.pk, reason=why, grace_seconds=settings.LEND_GRACE_SECONDS, now=now):
            asked.append(job.pk)
    return asked


def loan_take_back(*, user: AbstractBaseUser, booking: Reservation, now: datetime | None = None) -> list[int]:
    """*Take it back* on the booking's page: its owner (or a leader of its team, an admin)."""
    if not can_manage(user, booking):
        raise Forbidden("Only the booking's owner, its team's leaders and admins can take it back.")
    now = now or timezone.now()
    why = f"{user} took booking {booking.pk} back"
    with transaction.atomic():
        reservation_locked(booking.pk)  # as `_lend` takes it: a loan being made now is seen, not missed
        if not Reservation.objects.loans_live(now).filter(lent_from=booking).exists():
            # Nothing lent (a stale page, between two loans): no use recorded, but she is back, so
            # the next pass must not lend the cards again at once (gpus.idle.idle_clock_restart).
            if booking.status_at(now) == Reservation.Status.ACTIVE:
                idle_clock_restart(booking.pk)
            return []
        return loans_take_back(booking=booking, why=why, now=now, owner_back=user.pk == booking.owner_id)


def taken_back_words(asked: Sequence[int]) -> str:
    """What *Take it back* tells the owner of the jobs `loan_take_back` asked to leave: a job no
    worker had taken went back to the queue at once; one that runs gets its grace."""
    back = set(Job.objects.filter(pk__in=asked, status=Job.Status.PENDING).values_list("pk", flat=True))
    words = []
    if gone := [pk for pk in asked if pk in back]:
        words.append(f"{_jobs(gone)} had not started and went back to the queue")
    if leaving := [pk for pk in asked if pk not in back]:
        words.append(f"{_jobs(leaving)} gets SIGTERM now and leaves within {settings.LEND_GRACE_SECONDS} s")
    return f"Taken back: {'; '.join(words)}."


def _jobs(pks: Sequence[int]) -> str:
    return ", ".join(f"job {pk}" for pk in pks)


def loans_watch(cards: Iterable[GPUInfo], *, now: datetime | None = None) -> list[int]:
    """Each telemetry round: a process on a lent card that is not its borrower's is the owner
    coming back, so the borrower leaves at once. One whose account is another person's is not:
    an intruder, the watchdog's, never a way to push a borrower off; one whose account is
    nobody's known (unreadable, a service account) may be the owner's, so it is taken as theirs."""
    now = now or timezone.now()
    by_card = {c.uuid: c for c in cards if c.processes}
    if not by_card:
        return []
    # Every live loan's cards, kept to the cards reported: the lab's few loans are fewer values
    # than the round's 512 cards would be as a list in the query (issue 40).
    loans = [
        loan
        for loan in Allocation.objects.filter(
            reservation__in=Reservation.objects.loans_live(now)
        ).values_list(
            "gpu_id", "reservation_id", "reservation__lent_from_id", "reservation__lent_from__owner_id"
        )
        if loan[0] in by_card
    ]
    if not loans:
        return []  # no lent card shows a process: no read of who runs them
    people = users_by_unix_name({p.username for card in by_card.values() for p in card.processes or ()})
    borrowers: dict[int, set[int]] = {}
    for loan, job in Job.objects.filter(reservation_id__in={loan for _, loan, _, _ in loans}).values_list(
        "reservation_id", "pk"
    ):  # every loan's jobs in one read
        borrowers.setdefault(loan, set()).add(job)
    # A process that names its job is that job's owner's, whatever account it runs as: under a
    # service account (JOB_USER=gpujob) every job's process has the same unknown name, and a
    # share-holder's own job on their share of the card must not push the borrower off.
    named = {p.job_id for uuid, *_ in loans for p in by_card[uuid].processes or () if p.job_id is not None}
    job_owners = dict(Job.objects.filter(pk__in=named).values_list("pk", "owner_id")) if named else {}

    def whose(process: ProcessInfo, owner: int) -> int | None:
        if process.job_id in job_owners:
            return job_owners[process.job_id]
        return people.get(process.username, owner)

    back: dict[int, str] = {}  # lender → why: each taken back once, however many of its cards
    for uuid, loan, lender, owner in loans:
        others = [
            p
            for p in by_card[uuid].processes or ()
            if p.job_id not in borrowers.get(loan, set()) and whose(p, owner) == owner
        ]
        if others and lender not in back:
            pid = others[0].pid
            back[lender] = f"the owner of booking {lender} started using it (process {pid} on its card)"
    asked: list[int] = []
    for lender, why in back.items():
        asked += loans_take_back(booking=lender, why=why, now=now)
    return asked


def loan_words(loan_ids: Iterable[int]) -> dict[int, str]:
    """{loan id: "lent to the queue since 14:02: job 812"} (gpus.hooks.loan_words: the
    dashboard's lent cards). Two queries."""
    ids = list(loan_ids)
    jobs: dict[int, list[int]] = {}
    rows = Job.objects.filter(reservation_id__in=ids).order_by("pk").values_list("reservation_id", "pk")
    for loan, job in rows:
        jobs.setdefault(loan, []).append(job)
    starts = Reservation.objects.filter(pk__in=ids).values_list("pk", "start")
    return {loan: lent_since(start, jobs.get(loan, [])) for loan, start in starts}


def lent_context(context: Any) -> dict[str, Any]:
    """The booking page's words on a lent booking `r` (portal.hooks.RESERVATION_SESSIONS), and
    whether the viewer may take it back."""
    booking, viewer = context["r"], context["request"].user
    words = lent_words(booking) if booking.lent_from_id is None else ""
    return {"lent_words": words, "may_take_back": bool(words) and can_manage(viewer, booking)}


def lent_words(booking: Reservation, now: datetime | None = None) -> str:
    """What the booking's page and the dashboard say of a lent booking; "" when it is not lent."""
    now = now or timezone.now()
    loans = list(Reservation.objects.loans_live(now).filter(lent_from=booking).order_by("start"))
    if not loans:
        return ""
    jobs = Job.objects.filter(reservation__in=loans).values_list("pk", flat=True)
    return f"{lent_since(loans[0].start, list(jobs))}; it leaves as soon as you start something"


def lent_since(start: datetime, jobs: Sequence[int]) -> str:
    """ "lent to the queue since 14:02: job 812": the booking page's and the dashboard's words."""
    names = ", ".join(f"job {pk}" for pk in jobs) or "a queued job"
    return f"lent to the queue since {timezone.localtime(start):%H:%M}: {names}"
