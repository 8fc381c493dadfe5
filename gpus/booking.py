"""Booking services: every reservation rule is checked here, for the web forms and the API alike.

Concurrency: each service is one transaction that first locks what it is about to check,
always in the same order (reservation, membership, team when it has limits, then GPU rows
by UUID), so on PostgreSQL two bookings touching the same card serialise and can never
deadlock; re-reads after the lock see the other's committed rows (READ COMMITTED). On
SQLite every transaction is BEGIN IMMEDIATE (portal/env.py), which serialises all writers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from gpus.booking_defaults import default_length
from gpus.booking_ends import owner_told_of_cancel
from gpus.conflicts import Blocked, check_free, explain_conflicts, fitting_cards, gpu_label, held_on
from gpus.conflicts import Held as Held  # older callers import these from here (tests/test_faults.py)
from gpus.conflicts import blockers as blockers
from gpus.inventory import CardState
from gpus.models import GPU, Allocation, Reservation, Server, format_mb
from gpus.quotas import (
    QuotaAsk,
    Use,
    length_check,
    membership_locked,
    memberships_for,
    peak,
    quota_check,
    refusals_told,
)
from portal.access import owner_reason_check
from portal.changes import BOOKINGS, change_publish
from portal.errors import Conflict, Errors, Forbidden, Invalid
from portal.models import AuditEntry, Membership, Team
from portal.timefmt import format_time
from portal.wakeups import QUEUE_SCHEDULER, wake_on_commit

PICK_ATTEMPTS = 3
# Who may act on a booking; the API's permission classes answer with the same words.
ONLY_OWNER_EXTENDS = "Only the owner can extend a booking."
ONLY_OWNER_RELEASES = "Only the owner can release a booking; leaders and admins cancel it with a reason."
ONLY_OWNER_OR_MANAGER_CANCELS = "Only the owner, leaders of the booking's team and admins can cancel it."
# Only what the rules read is loaded from the locked card rows.
_LOCKED_GPU_FIELDS = (
    "uuid",
    "index",
    "name",
    "memory_total_mb",
    "memory_reserved_mb",
    "state",
    "server__id",
    "server__name",
    "server__draining",
    "server__kind",
)


_UNBOOKABLE = {
    CardState.LOST: "has fallen off the bus (NVML: GPU is lost): it takes no bookings until an admin "
    "resets it and it reports again. Pick another card.",
    CardState.UNRESPONSIVE: "did not answer its host's last reading (NVML hung): it takes no bookings "
    "until it answers again. Pick another card, or try again in a minute.",
}


class PortalActor:
    """The portal itself acting on a rule, not on anyone's request: the auto-release of an idle
    booking (gpus/idle.py), a deactivated user's bookings ended (reservations_cancel_for_leaver).
    Only code passes it, never a view; it is audited with no actor."""

    pk = None

    def __str__(self) -> str:
        return "The portal"


PORTAL = PortalActor()


# --- checks shared by create and extend ---------------------------------------------


def _utc(at: datetime | None) -> datetime | None:
    """A requested time in UTC. A form or the API hands times over in the person's zone, and Python
    subtracts and adds two times of one zone by the wall clock: a booking across the night the
    clocks go back would measure 24 h where it holds 25 (and its quotas count 24)."""
    return at.astimezone(UTC) if at is not None else None


def _check_request(gpus: Sequence[str] | None, count: int | None, memory_mb: int | None, note: str) -> None:
    """What a booking request must say, before anything is read or locked: every problem at once."""
    found = Errors()
    if memory_mb is not None and memory_mb <= 0:
        found.add("memory_mb", "Memory must be more than 0; leave it empty to book whole cards.")
    if len(note) > 500:
        found.add("note", f"The note is {len(note)} characters; keep it to 500.")
    if gpus and count:
        found.add("gpus", "Give either GPUs to book or a count of cards to pick, not both.")
    elif not gpus and count is None:
        found.add("gpus", "Pick at least one GPU, or give a count of cards for the portal to pick.")
    if gpus and len(set(gpus)) != len(gpus):
        found.add("gpus", "A GPU is listed twice; list each card once.")
    if count is not None and count < 1:
        found.add("count", "The count must be at least 1.")
    found.raise_any()


def _check_window_limits(start: datetime, end: datetime, now: datetime, *, new_start: bool = True) -> None:
    """The portal's own limits on a booking's window (not a member's quota), every one at once."""
    found = Errors()
    if end <= start:
        found.add("end", f"The end ({format_time(end)}) must be after the start ({format_time(start)}).")
    if new_start and start < now - timedelta(minutes=settings.BOOKING_PAST_GRACE_MINUTES):
        found.add("start", f"The start ({format_time(start)}) is in the past; start now or later.")
    horizon = now + timedelta(days=settings.BOOKING_HORIZON_DAYS)
    if end > horizon:
        found.add(
            "end",
            f"Bookings can reach at most {settings.BOOKING_HORIZON_DAYS} days ahead "
            f"(until {format_time(horizon)}); pick an earlier end.",
        )
    if end > start:
        found.check(length_check, QuotaAsk((), start, end, fields={"length": "end"}))
    found.raise_any()


def request_problems(
    *,
    gpus: Sequence[str] | None,
    count: int | None,
    memory_mb: int | None,
    note: str,
    start: datetime | None,
    end: datetime | None,
    unread: Collection[str] = (),
    now: datetime | None = None,
) -> dict[str, list[str]]:
    """What `reservation_create` would refuse before it reads a card or a quota, by field: the
    booking form and the API show these beside their own parsing errors, so one request names
    every problem. `unread`: the fields that did not parse (None here), judged by nothing else:
    an unread start stood in as "now", so the end is not judged against it; an unread count was
    given all the same, so "give cards or a count" would be wrong."""
    now = now or timezone.now()
    start = _utc(start) or now
    end = _utc(end) or start + default_length(None)
    errors = Errors()
    errors.check(_check_request, gpus, count, memory_mb, note)
    errors.check(_check_window_limits, start, end, now)
    skip = {*unread, *(["end"] if "start" in unread else []), *(["gpus"] if "count" in unread else [])}
    return {field: messages for field, messages in errors.found.items() if field not in skip}


def _locked_gpus(uuids: Sequence[str], memory_mb: int | None, *, whole_nodes: bool = False) -> list[GPU]:
    """The cards, row-locked in UUID order: the one lock order every booking uses. A Slurm
    cluster's only as `whole_nodes` (gpus/slurm_booking.py: every card of the nodes booked).
    NO KEY, as every booking lock here: two bookings still take turns, while a commit that only
    refers to a card (a telemetry round's processes) is not held up (tests/test_lock_modes.py)."""
    gpus = list(
        GPU.objects.select_for_update(of=("self",), no_key=True)
        .select_related("server")
        .only(*_LOCKED_GPU_FIELDS)
        .filter(uuid__in=uuids)
        .order_by("uuid")
    )
    missing = sorted(set(uuids) - {g.uuid for g in gpus})
    if missing:
        raise Invalid(
            f"There is no GPU {missing[0]}; pick cards from the dashboard or GET /api/v1/gpus/.", field="gpus"
        )
    servers = sorted({g.server.name for g in gpus})
    if len(servers) > 1:
        raise Invalid(
            f"These cards are on {len(servers)} servers ({', '.join(servers)}); a booking's cards must "
            "share one server, because a job runs on one host. Make one booking per server.",
            field="gpus",
        )
    for gpu in gpus:
        if gpu.server.kind == Server.Kind.SLURM and not whole_nodes:
            raise Invalid(
                f"{gpu_label(gpu)} is on {gpu.server.name}, a Slurm cluster: Slurm schedules its cards. "
                "Submit a job to it with a GPU count, or book whole nodes of it (docs/slurm.md).",
                field="gpus",
            )
        if gpu.server.draining:
            raise Invalid(
                f"{gpu_label(gpu)} is on {gpu.server.name}, which is draining: "
                "pick a card on another server.",
                field="gpus",
            )
        if not gpu.bookable:
            raise Conflict(f"{gpu_label(gpu)} {_UNBOOKABLE[gpu.state]}", field="gpus")
        if memory_mb is not None and memory_mb > gpu.memory_bookable_mb:
            raise Invalid(
                f"{format_mb(memory_mb)} is more than the {format_mb(gpu.memory_bookable_mb)} "
                f"bookable on {gpu_label(gpu)}; "
                f"ask for at most {gpu.memory_bookable_mb}M, or book the whole card.",
                field="memory_mb",
            )
    return gpus


def _check_free(
    gpus: Sequence[GPU],
    start: datetime,
    end: datetime,
    memory_mb: int | None,
    *,
    exclude: int | None = None,
    queue_start: bool = False,
) -> None:
    held = held_on([g.uuid for g in gpus], start, end, exclude=exclude)  # under the cards' row locks
    check_free(gpus, held, start, end, memory_mb, exclude=exclude, queue_start=queue_start)


def _check_quota(
    membership: Membership,
    gpus: Sequence[GPU],
    memory_mb: int | None,
    start: datetime,
    end: datetime,
    *,
    fields: dict[str, str],
    exclude: int | None = None,
) -> None:
    new = [Use.of(start, end, memory_mb, g.memory_total_mb) for g in gpus]
    ask = QuotaAsk(new, start, end, fields=fields, exclude_reservation=exclude)
    quota_check(membership, ask)


def _quota_fields(gpus: Sequence[str] | None, memory_mb: int | None) -> dict[str, str]:
    """A new booking's fields for a quota refusal: the cards as it named them, its memory, its end."""
    cards = "gpus" if gpus else "count"
    return {
        "length": "end",
        "cards": cards,
        "memory": cards if memory_mb is None else "memory_mb",
        "hours": "end",
    }


def _pick(count: int, server: str | None, memory_mb: int | None, start: datetime, end: datetime) -> list[str]:
    """Choose `count` cards on one server: the least loaded that fit, on the least loaded server.

    Load of a card = share of its bookable memory booked in the window, then its current
    utilisation and used memory. Unlocked reads: the caller locks the pick and re-checks.
    """
    gpus = _candidates(server)
    if memory_mb is not None and gpus and memory_mb > max(g.memory_bookable_mb for g in gpus):
        largest = max(g.memory_bookable_mb for g in gpus)
        raise Invalid(
            f"{format_mb(memory_mb)} is more than any card offers (at most {format_mb(largest)} bookable); "
            f"ask for at most {largest}M, or whole cards.",
            field="memory_mb",
        )
    fitting = _fitting_by_server(gpus, memory_mb, start, end)
    options = []
    for name, cards in fitting.items():
        if len(cards) >= count:
            chosen = sorted(cards)[:count]
            total = tuple(sum(load[i] for load, _ in chosen) for i in range(3))
            options.append((total, name, [uuid for _, uuid in chosen]))
    if options:
        return min(options)[2]
    what = (
        f"{count} whole card(s)" if memory_mb is None else f"{count} card(s) with {format_mb(memory_mb)} free"
    )
    where = f"Server {server} does not have" if server else "No online server has"
    best = max(fitting.items(), key=lambda item: len(item[1]), default=None)
    most = f" (the most on one server is {len(best[1])}, on {best[0]})" if best else ""
    raise Conflict(
        f"{where} {what} from {format_time(start)} to {format_time(end)}{most}. "
        "Try fewer cards, less memory or a later time; the server timelines show what is free.",
        field="count",
    )


def _candidates(server: str | None) -> list[GPU]:
    """The bookable cards of `server`, or of every online server; refused when there are none to
    pick from (no such server, draining, nothing online)."""
    candidates = (
        GPU.objects.portal_scheduled()
        .select_related("server")
        .filter(server__draining=False, state=CardState.OK)
    )
    if server:
        draining = Server.objects.filter(name=server).values_list("draining", flat=True).first()
        if draining is None:
            raise Invalid(f"There is no server {server!r}; leave it empty for any server.", field="server")
        if draining:
            raise Invalid(
                f"Server {server} is draining: it takes no new bookings. "
                "Pick another server, or leave it empty for any online server.",
                field="server",
            )
        if Server.objects.filter(name=server, kind=Server.Kind.SLURM).exists():
            raise Invalid(
                f"{server} is a Slurm cluster: book whole nodes of it (nodes, or gpu book --server "
                f"{server} --node NAME), or submit a job to it with a GPU count.",
                field="server",
            )
        return list(candidates.filter(server__name=server))
    gpus = list(candidates.filter(server__in=Server.objects.online()))
    if not gpus:
        if Server.objects.online().exists():
            raise Conflict(
                "Every online GPU server is draining (taking no new bookings), so the portal has no "
                "cards to pick from. Try again later, or ask an admin which server to use.",
                field="server",
            )
        raise Conflict(
            "No GPU server is online now, so the portal has no cards to pick from. Pick cards on the "
            "dashboard or name a server to book ahead, or try again once a server reports.",
            field="server",
        )
    return gpus


def _fitting_by_server(
    gpus: Sequence[GPU], memory_mb: int | None, start: datetime, end: datetime
) -> dict[str, list[tuple[tuple[float, int, int], str]]]:
    """The cards where the booking fits, beside the bookings and the queue's holds, by server
    name, each with its load and UUID."""
    fitting: dict[str, list[tuple[tuple[float, int, int], str]]] = defaultdict(list)
    for gpu, mine in fitting_cards(gpus, start, end, memory_mb):
        booked = peak(((h.start, h.end, h.memory_mb or 0) for h in mine), start, end)
        load = (
            GPU.card_share(booked, gpu.memory_bookable_mb),
            gpu.utilization_pct or 0,
            gpu.memory_used_mb or 0,
        )
        fitting[gpu.server.name].append((load, gpu.uuid))
    return fitting


def _pick_and_lock(
    count: int, server: str | None, memory_mb: int | None, start: datetime, end: datetime
) -> list[GPU]:
    """Pick cards, lock them and check them again: another booking may have taken one between
    the unlocked pick and the lock, and then the portal picks again.

    Each attempt is a savepoint. A failed one releases the row locks it took, so the next
    attempt again locks its cards in UUID order with none held: two bookings cannot deadlock.
    """
    for attempt in range(1, PICK_ATTEMPTS + 1):
        try:
            with transaction.atomic():
                cards = _locked_gpus(_pick(count, server, memory_mb, start, end), memory_mb)
                _check_free(cards, start, end, memory_mb)
                return cards
        except Blocked:
            if attempt == PICK_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _audit(
    actor: AbstractBaseUser | PortalActor, reservation: Reservation, action: str, message: str, **data: object
) -> None:
    """Every change of a booking comes through here: it is audited, and open pages are told."""
    change_publish(BOOKINGS)  # once committed: the dashboard shows the booking
    if actor is PORTAL:
        data["by"] = "portal"  # no actor, yet not a deleted user's entry
    AuditEntry.objects.create(
        actor_id=actor.pk,
        team_id=reservation.team_id,
        action=action,
        target=f"reservation {reservation.pk}",
        message=message,
        data=data,
    )


def describe(gpus: Sequence[GPU], memory_mb: int | None) -> str:
    cards = ", ".join(str(g.index) for g in gpus)
    server = gpus[0].server.name
    if memory_mb is None:
        return f"{len(gpus)} whole card(s) on {server} (GPU {cards})"
    return f"{format_mb(memory_mb)} on each of {len(gpus)} card(s) on {server} (GPU {cards})"


# --- services -----------------------------------------------------------------------


@refusals_told  # outside the transaction: the team's channels hear of it after the rollback
@explain_conflicts
@transaction.atomic
def reservation_create(
    *,
    user: AbstractBaseUser,
    gpus: Sequence[str] | None = None,
    count: int | None = None,
    server: str | None = None,
    memory_mb: int | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    note: str = "",
    team: Team | str | None = None,
    now: datetime | None = None,
    queue_start: bool = False,
    lent_from: Reservation | None = None,
    whole_nodes: bool = False,
) -> Reservation:
    """Book `gpus` (UUIDs) or `count` cards the portal picks (on `server`, or anywhere).

    `memory_mb` None books whole cards; otherwise that much memory on each card.
    `queue_start`: the queue's scheduler booking for a job it starts in plan order, which the
    queue's holds for waiting jobs do not bind (every other booking must leave them free).
    `lent_from`: a loan, the queue's booking for a preemptible job on cards of that idle booking
    (jobs/lending.py): beside it, within its cards and its window, never beside anyone else's.
    Raises a ServiceError subclass, naming the field and the fix, and writes nothing.
    """
    now = now or timezone.now()
    start, end = _utc(start) or now, _utc(end)
    # An empty end: the default length within the member's longest booking (read unlocked: the
    # quota check under the lock judges the booking all the same).
    end = end or start + default_length(memberships_for(user, team).first())
    errors = Errors()  # every problem of the request at once, before anything is locked
    errors.check(_check_request, gpus, count, memory_mb, note)
    errors.check(_check_window_limits, start, end, now)
    errors.raise_any()
    membership = membership_locked(user, team)
    if gpus:
        cards = _locked_gpus(gpus, memory_mb, whole_nodes=whole_nodes)
        _check_cards_free(cards, start, end, memory_mb, queue_start=queue_start, lent_from=lent_from)
    else:
        cards = _pick_and_lock(count or 0, server, memory_mb, start, end)
    _check_quota(membership, cards, memory_mb, start, end, fields=_quota_fields(gpus, memory_mb))

    reservation = Reservation.objects.create(
        owner=user, team=membership.team, start=start, end=end, booked_end=end, note=note, lent_from=lent_from
    )
    Allocation.objects.bulk_create(
        Allocation(reservation=reservation, gpu_id=g.uuid, memory_mb=memory_mb, start=start, end=end)
        for g in cards
    )
    _audit(
        user,
        reservation,
        AuditEntry.Action.RESERVATION_CREATE,
        f"{user} booked {describe(cards, memory_mb)} from {format_time(start)} to {format_time(end)}",
        gpus=[g.uuid for g in cards],
        memory_mb=memory_mb,
        start=start.isoformat(),
        end=end.isoformat(),
    )
    return reservation


def _check_cards_free(
    cards: Sequence[GPU],
    start: datetime,
    end: datetime,
    memory_mb: int | None,
    *,
    queue_start: bool,
    lent_from: Reservation | None,
) -> None:
    """The chosen cards free for the booking; a loan (`lent_from`) beside the lent booking alone,
    within it, and bound by no queue hold (the queue placed it)."""
    if lent_from is None:
        _check_free(cards, start, end, memory_mb, queue_start=queue_start)
        return
    _check_loan(lent_from, cards, memory_mb, start, end)
    _check_free(cards, start, end, memory_mb, exclude=lent_from.pk, queue_start=True)


def _check_loan(
    lender: Reservation, cards: Sequence[GPU], memory_mb: int | None, start: datetime, end: datetime
) -> None:
    """A loan stays within the lent booking: its cards, its window, its memory (a share is lent
    only whole: what it holds, for at most that much)."""
    lent = dict(Allocation.objects.filter(reservation=lender).values_list("gpu_id", "memory_mb"))
    if lender.status_at(start) != Reservation.Status.ACTIVE or end > lender.end:
        raise Conflict(
            f"Booking {lender.pk} is not active for the whole loan; it cannot be lent.", field="gpus"
        )
    for gpu in cards:
        if gpu.uuid not in lent:
            raise Conflict(f"{gpu_label(gpu)} is not a card of booking {lender.pk}.", field="gpus")
        held = lent[gpu.uuid]
        if held is not None and (memory_mb is None or memory_mb > held):
            raise Conflict(
                f"Booking {lender.pk} holds {format_mb(held)} of {gpu_label(gpu)}: too little to lend."
            )


def reservation_locked(reservation: Reservation | int) -> Reservation:
    """The booking's row, locked until the transaction ends (SQLite's writers take the whole
    database in turn): its changes here, a loan and its owner's return (jobs/lending.py), an idle
    round's release (gpus/idle.py) take it one at a time."""
    pk = reservation if isinstance(reservation, int) else reservation.pk
    rows = Reservation.objects.select_for_update(of=("self",), no_key=True)
    return rows.select_related("owner", "team").get(pk=pk)


def reservation_lock(reservation: Reservation | int) -> None:
    """The booking's row locked as `reservation_locked` locks it, first, for work on it that only
    needs its turn (a job submitted to it, a session started on it): a release at the same moment
    waits, or is read. None there (a wrong id): nothing locked, the caller's checks name it."""
    pk = reservation if isinstance(reservation, int) else reservation.pk
    rows = Reservation.objects.select_for_update(of=("self",), no_key=True).filter(pk=pk)
    list(rows.values_list("pk", flat=True))


@refusals_told
@explain_conflicts
@transaction.atomic
def reservation_extend(
    *, user: AbstractBaseUser, reservation: Reservation | int, end: datetime, now: datetime | None = None
) -> Reservation:
    """Move an open booking's end later, if its cards are free until then and quotas allow."""
    now = now or timezone.now()
    end = end.astimezone(UTC)  # as a new booking's (_utc)
    reservation = reservation_locked(reservation)
    if reservation.owner_id != user.pk:
        raise Forbidden(ONLY_OWNER_EXTENDS)
    status = reservation.status_at(now)
    if status not in (Reservation.Status.UPCOMING, Reservation.Status.ACTIVE):
        raise Invalid(f"This booking is {status.label.lower()}; make a new one instead.", field="end")
    if end <= reservation.end:
        raise Invalid(
            f"The new end must be after the current end, {format_time(reservation.end)}.", field="end"
        )
    if reservation.allocations.filter(gpu__server__kind=Server.Kind.SLURM).exists():
        raise Invalid(  # its Slurm reservation keeps its end (gpus/slurm_booking.py)
            "A booking of Slurm nodes keeps its end: book the nodes again from its end.", field="end"
        )
    membership = membership_locked(user, reservation.team)
    _check_window_limits(reservation.start, end, now, new_start=False)
    allocations = list(reservation.allocations.all())
    memory_mb = allocations[0].memory_mb
    cards = _locked_gpus([a.gpu_id for a in allocations], memory_mb)
    # Only the added time: what it holds already is its own, and a loan of it (the queue's job on
    # its idle cards, jobs/lending.py) sits within that, never in its owner's way.
    _check_free(cards, reservation.end, end, memory_mb, exclude=reservation.pk)
    # Only its end changes: whatever limit it passes, the end is what its owner would move.
    fields = dict.fromkeys(("length", "cards", "memory", "hours"), "end")
    _check_quota(membership, cards, memory_mb, reservation.start, end, fields=fields, exclude=reservation.pk)

    old_end = reservation.end
    reservation.end = reservation.booked_end = end
    reservation.save(update_fields=["end", "booked_end"])
    reservation.allocations.update(end=end)
    _audit(
        user,
        reservation,
        AuditEntry.Action.RESERVATION_EXTEND,
        f"{user} extended reservation {reservation.pk} from {format_time(old_end)} to {format_time(end)}",
        old_end=old_end.isoformat(),
        end=end.isoformat(),
    )
    return reservation


def _end_now(reservation: Reservation, now: datetime) -> None:
    """Stop holding the cards from `now`: started bookings keep the part they used."""
    if now > reservation.start:
        reservation.end = now
        reservation.allocations.update(end=now)
    else:
        reservation.allocations.update(live=False)


def cancel_reason_check(*, user: AbstractBaseUser, reservation: Reservation, reason: object) -> str:
    """The cancel's reason, normalised: asked by the cancel and by its confirm page before anything
    stops (read by hand from a form or a body). Someone else's booking needs one: its owner sees it
    (the rule is portal.access.owner_reason_check, a job cancel's too)."""
    return owner_reason_check(
        user=user, obj=reservation, reason=reason, refused=ONLY_OWNER_OR_MANAGER_CANCELS
    )


@transaction.atomic
def reservation_cancel(
    *, user: AbstractBaseUser, reservation: Reservation | int, reason: str = "", now: datetime | None = None
) -> Reservation:
    """Cancel a booking: the owner (their upcoming one; an active one is released), or a
    leader of its team or an admin (upcoming or active), who must give a reason the owner sees:
    the owner is told (gpus.booking_ends), and what ran on it ends cancelled, saying who and why."""
    now = now or timezone.now()
    reservation = reservation_locked(reservation)
    reason = cancel_reason_check(user=user, reservation=reservation, reason=reason)
    status = reservation.status_at(now)
    if status not in (Reservation.Status.UPCOMING, Reservation.Status.ACTIVE):
        raise Invalid(f"This booking is already {status.label.lower()}; there is nothing to cancel.")
    if reservation.owner_id == user.pk and status == Reservation.Status.ACTIVE:
        return _release(user, reservation, now, reason)
    return _cancel(user, reservation, now, reason)


def _cancel(
    user: AbstractBaseUser | PortalActor, reservation: Reservation, now: datetime, reason: str
) -> Reservation:
    # Someone else's booking (a leader's, an admin's cancel): its owner is told who, why and what
    # stops, and the audit log says what stops too. The portal's own cancels tell on their own.
    others = user is not PORTAL and user.pk != reservation.owner_id
    stopped = owner_told_of_cancel(user, reservation, reason, now) if others else ""
    _end_now(reservation, now)
    reservation.cancelled_at = now
    reservation.cancelled_by = None if user is PORTAL else user
    reservation.cancel_reason = reason
    reservation.save(update_fields=["end", "cancelled_at", "cancelled_by", "cancel_reason"])
    wake_on_commit(QUEUE_SCHEDULER)  # its cards are free: pending jobs may start now
    because = f": {reason}" if reason else ""
    message = f"{user} cancelled reservation {reservation.pk} of {reservation.owner}{because}"
    _audit(
        user,
        reservation,
        AuditEntry.Action.RESERVATION_CANCEL,
        f"{message}. {stopped}" if stopped else message,
        reason=reason,
    )
    return reservation


def _release(
    user: AbstractBaseUser | PortalActor, reservation: Reservation, now: datetime, reason: str = ""
) -> Reservation:
    _end_now(reservation, now)
    reservation.released_at = now
    # Who and why, for the jobs and sessions it ends (they say so) as well as the audit log.
    reservation.released_by = None if user is PORTAL else user
    reservation.release_reason = reason[:500]
    reservation.save(update_fields=["end", "released_at", "released_by", "release_reason"])
    wake_on_commit(QUEUE_SCHEDULER)  # its cards are free: pending jobs may start now
    because = f": {reason}" if reason else ""
    _audit(
        user,
        reservation,
        AuditEntry.Action.RESERVATION_RELEASE,
        f"{user} released reservation {reservation.pk} early, at {format_time(now)}{because}",
        booked_end=reservation.booked_end.isoformat(),
        reason=reason,
    )
    return reservation


@transaction.atomic
def reservation_release(
    *,
    user: AbstractBaseUser | PortalActor,
    reservation: Reservation | int,
    now: datetime | None = None,
    reason: str = "",
) -> Reservation:
    """End the owner's active booking now, freeing its cards for others.

    `user=PORTAL` is the portal releasing it on a rule (an idle booking), with the `reason`
    for the audit log; no user but the owner can ever pass the check below.
    """
    now = now or timezone.now()
    reservation = reservation_locked(reservation)
    if user is not PORTAL and reservation.owner_id != user.pk:
        raise Forbidden(ONLY_OWNER_RELEASES)
    status = reservation.status_at(now)
    if status == Reservation.Status.UPCOMING:
        raise Invalid("This booking has not started yet; cancel it instead.")
    if status != Reservation.Status.ACTIVE:
        raise Invalid(f"This booking is already {status.label.lower()}; there is nothing to release.")
    return _release(user, reservation, now, reason)


@transaction.atomic
def reservations_cancel_for_leaver(
    *, user: AbstractBaseUser, reason: str, now: datetime | None = None
) -> list[tuple[Reservation, Reservation.Status]]:
    """End every open booking of `user`, whose account was deactivated, as the portal, with
    `reason` (e.g. "alice's account was deactivated"): an upcoming one is cancelled; an active one
    is released now, keeping the part already used, as any early release does. A job still running
    on one sees its booking end; jobs.leavers asks it to stop first, so it ends cancelled with the
    reason. Each booking is audited with no actor (`by: portal`).

    Returns each booking with its status before (upcoming or active). Re-running it finds
    nothing open and does nothing. The caller tells whoever must know (jobs.leavers: the leaders).
    """
    now = now or timezone.now()
    reason = reason.strip()[:500]
    open_ = (
        Reservation.objects.filter(owner_id=user.pk)
        .with_status("open", now)
        .select_for_update(of=("self",), no_key=True)
        .select_related("owner", "team")
        .order_by("pk")
    )
    ended = []
    for reservation in open_:
        status = reservation.status_at(now)
        if status == Reservation.Status.UPCOMING:
            _cancel(PORTAL, reservation, now, reason)
        else:
            _release(PORTAL, reservation, now, reason)
        ended.append((reservation, status))
    return ended
