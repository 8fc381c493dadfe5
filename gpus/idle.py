"""Idle bookings: the idle clock, the owner's warning, and the team's optional auto-release.

A card is *idle* when the portal knows it is unused: telemetry fresher than
SERVER_OFFLINE_AFTER_SECONDS, state ok, a process list that could be read and is empty, and
utilization below IDLE_UTIL_PCT. Anything unknown (an offline server, a lost or unresponsive card,
an unreadable process list, no utilization figure) is not idle. A memory share counts the whole
card: it is idle only when the card has no process at all, anyone's, since the portal cannot tell
a share's own work from its neighbours' by utilization. So a busy neighbour keeps a share from
being released; never the reverse.

An active booking is idle when every one of its cards is. Each round (`idle_check`, every
IDLE_CHECK_SECONDS in the portal's worker) moves its clock:

- idle, no stretch open → a stretch starts (`idle_since`);
- idle, stretch open → whole minutes since the last count go to `idle_minutes`;
- not idle, or unknown → the stretch ends; the next idle round starts a new one.

Only time between two rounds that both saw the booking idle is counted, so a checker that was
down (the worker restarting, the database away) never counts the gap: a stretch whose last count
is older than a few rounds starts again. After IDLE_WARN_MINUTES of one stretch the owner is told,
once per stretch; if the booking's team has `auto_release_idle` on, the portal releases it
IDLE_RELEASE_MINUTES after that warning, through gpus.booking like any release.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import close_old_connections, transaction
from django.db.models import Exists, OuterRef, Prefetch
from django.urls import reverse
from django.utils import timezone

from gpus.booking import PORTAL, reservation_locked, reservation_release
from gpus.inventory import CardState
from gpus.models import GPU, Allocation, GPUProcess, Reservation
from gpus.noshow import lent_now, no_show_due, no_show_handle
from portal.access import can_manage_team, only_managers
from portal.channels import team_channels_notify
from portal.errors import Forbidden, ServiceError
from portal.models import AuditEntry, Notification, Team
from portal.notifications import notification_send
from portal.periodic import PeriodicThread, start_thread
from portal.timefmt import format_time

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
CLOCK_FIELDS = ["idle_since", "idle_minutes", "idle_counted_until", "idle_warned_at"]
COUNT_FIELDS = ["idle_minutes", "idle_counted_until"]  # a stretch going on: its start left alone
STRETCH, COUNTED, USED = "stretch", "counted", "used"  # how a round moved a booking


# --- the rule ----------------------------------------------------------------------------------


def card_idle(gpu: GPU, *, has_processes: bool, now: datetime) -> bool:
    """Known to be unused at `now`; unknown is never idle (see the module docstring)."""
    fresh_after = now - timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS)
    return (
        gpu.updated_at is not None
        and gpu.updated_at >= fresh_after
        and gpu.state == CardState.OK
        and gpu.processes_known
        and not has_processes
        and gpu.utilization_pct is not None
        and gpu.utilization_pct < settings.IDLE_UTIL_PCT
    )


def booking_idle(reservation: Reservation, now: datetime) -> bool:
    """Every card idle. Needs `allocations` loaded as `_active_bookings` does (gpu, has_processes)."""
    allocations = reservation.allocations.all()
    return bool(allocations) and all(
        card_idle(a.gpu, has_processes=a.has_processes, now=now) for a in allocations
    )


def release_due_at(reservation: Reservation) -> datetime | None:
    """When the portal releases this booking if it stays idle; None when it never will."""
    if not (reservation.team.auto_release_idle and reservation.idle_warned_at):
        return None
    return reservation.idle_warned_at + timedelta(minutes=settings.IDLE_RELEASE_MINUTES)


def idle_for(reservation: Reservation, now: datetime) -> int:
    """Whole minutes of the current stretch."""
    return (now - reservation.idle_since) // MINUTE if reservation.idle_since else 0


# --- the round ---------------------------------------------------------------------------------


@dataclass
class IdleRound:
    """What one round found and did, by reservation id."""

    idle: list[int] = field(default_factory=list)
    warned: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    no_shows: list[int] = field(default_factory=list)


def idle_check(*, now: datetime | None = None) -> IdleRound:
    """One round over every active booking: move the idle clocks, warn, auto-release.

    A fixed handful of queries for the clocks, whatever the number of bookings: one UPDATE for
    bookings that stopped being active, three reads (bookings; their cards with a process flag;
    which are lent), at most three bulk UPDATEs, each of the fields it moved: a stretch started or
    ended, minutes counted, a first use. So a take-back committed meanwhile (jobs/lending.py: the
    clock restarted, the owner's use marked) is never written over with what this round read:
    counting minutes leaves `idle_since` alone, and only a first use writes `used_at`. No-show
    notices (gpus/noshow.py), warnings and releases cost their own statements, and are rare.

    A re-run, or a second checker, is harmless: a warning (once per stretch) or a no-show notice
    is claimed with a conditional UPDATE, and a release goes through `reservation_release`,
    which refuses a booking that is no longer active.
    """
    now = now or timezone.now()
    _forget_ended(now)
    bookings = _active_bookings(now)
    done = IdleRound()
    moved: dict[str, list[Reservation]] = {STRETCH: [], COUNTED: [], USED: []}
    lent = lent_now(bookings, now)
    for reservation in bookings:
        idle = booking_idle(reservation, now)
        if idle:
            done.idle.append(reservation.pk)
        if how := _advance(reservation, idle, now):
            moved[how].append(reservation)
        if reservation.used_at is None and _used(reservation, idle, lent.get(reservation.pk), now):
            reservation.used_at = now  # gpus/noshow.py: the owner's use, or cards it cannot see
            moved[USED].append(reservation)
    for how, fields in ((STRETCH, CLOCK_FIELDS), (COUNTED, COUNT_FIELDS), (USED, ["used_at"])):
        Reservation.objects.bulk_update(moved[how], fields)  # none moved: no statement
    for reservation in bookings:
        if no_show_due(reservation, now):
            told, released = no_show_handle(reservation, now)
            if told:
                done.no_shows.append(reservation.pk)
            if released:
                done.released.append(reservation.pk)
                continue
        if _warning_due(reservation, now) and _warn(reservation, now):
            done.warned.append(reservation.pk)
        due = release_due_at(reservation)
        if due and due <= now and _release(reservation, now):
            done.released.append(reservation.pk)
    return done


def _used(reservation: Reservation, idle: bool, lent: set[str] | None, now: datetime) -> bool:
    """Not idle on a card nothing is lent from (`lent`: the booking's cards lent to the queue now):
    its owner's use. A borrower's work on the lent cards is not; the owner's on a card of the
    booking that was not lent is, though a borrower runs beside it."""
    if lent is None:
        return not idle
    return any(
        not card_idle(a.gpu, has_processes=a.has_processes, now=now)
        for a in reservation.allocations.all()
        if a.gpu_id not in lent
    )


def idle_clock_restart(pk: int) -> None:
    """The queue's borrowers were sent off the booking's cards (jobs/lending.py, its owner or a
    leader taking it back): its idle stretch ends, as when a round sees the owner's use, so it is
    lent again only after LEND_AFTER_MINUTES more of it. A take-back before the borrower ever ran,
    or for a process of the owner's between two rounds, left the clock where it was, and the next
    pass lent the cards again at once."""
    Reservation.objects.filter(pk=pk).update(idle_since=None, idle_counted_until=None, idle_warned_at=None)


def _forget_ended(now: datetime) -> None:
    """Close the stretch of bookings that ended, or were released or cancelled, since last round."""
    active = Reservation.objects.with_status("active", now).values("pk")
    stale = Reservation.objects.filter(idle_since__isnull=False).exclude(pk__in=active)
    stale.update(idle_since=None, idle_counted_until=None, idle_warned_at=None)


def _active_bookings(now: datetime) -> list[Reservation]:
    cards = Allocation.objects.select_related("gpu__server").annotate(
        has_processes=Exists(GPUProcess.objects.filter(gpu_id=OuterRef("gpu_id")))
    )
    bookings = Reservation.objects.with_status("active", now).select_related("owner", "team")
    return list(bookings.prefetch_related(Prefetch("allocations", queryset=cards)).order_by("pk"))


def _lapse() -> timedelta:
    """A stretch counted longer ago than this was not watched since: start it again. The last
    count trails the last round by under a minute; this allows two missed rounds."""
    return MINUTE + 3 * timedelta(seconds=settings.IDLE_CHECK_SECONDS)


def _advance(reservation: Reservation, idle: bool, now: datetime) -> str:
    """Move the booking's clock in memory; how it moved (STRETCH: started or ended, COUNTED:
    minutes counted), "" when it did not."""
    r = reservation
    if not idle:
        if r.idle_since is None:
            return ""
        r.idle_since = r.idle_counted_until = r.idle_warned_at = None
        return STRETCH
    if r.idle_since is None or r.idle_counted_until is None or now - r.idle_counted_until > _lapse():
        r.idle_since = r.idle_counted_until = now
        r.idle_warned_at = None
        return STRETCH
    minutes = max(0, (now - r.idle_counted_until) // MINUTE)
    if not minutes:
        return ""
    r.idle_minutes += minutes
    r.idle_counted_until += minutes * MINUTE  # the rest of a minute counts next round
    return COUNTED


def _warning_due(reservation: Reservation, now: datetime) -> bool:
    return (
        reservation.idle_since is not None
        and reservation.idle_warned_at is None
        and now - reservation.idle_since >= timedelta(minutes=settings.IDLE_WARN_MINUTES)
    )


def _warn(reservation: Reservation, now: datetime) -> bool:
    """Claim the stretch's one warning and send it; False when another round already did."""
    with transaction.atomic():
        claimed = Reservation.objects.filter(
            pk=reservation.pk, idle_since=reservation.idle_since, idle_warned_at=None
        ).update(idle_warned_at=now)
        if not claimed:
            return False
        reservation.idle_warned_at = now
        notification_send(
            user=reservation.owner,
            kind=Notification.Kind.IDLE_BOOKING,
            subject=f"Booking {reservation.pk} is idle: {reservation.summary}",
            body=_warning_body(reservation, now),
            url=f"{reverse('reservation_detail', args=[reservation.pk])}#actions",
            key=f"idle:{reservation.pk}",
        )
        _tell_team(reservation, "is idle", _team_words(reservation, now), f"idle:{reservation.pk}")
    log.info("Reservation %s idle for %s min: owner warned", reservation.pk, idle_for(reservation, now))
    return True


def _warning_body(reservation: Reservation, now: datetime) -> str:
    r = reservation
    what = (
        f"Your booking {r.pk} ({r.summary}, until {format_time(r.end)}) has been idle for "
        f"{idle_for(r, now)} minutes, since {format_time(r.idle_since)}: no process on its cards "
        f"and utilization below {settings.IDLE_UTIL_PCT}%."
    )
    due = release_due_at(r)
    if due:
        next_ = (
            f"{r.team} releases idle bookings automatically: the portal will release this one at "
            f"{format_time(due)} unless its cards are used before then."
        )
    else:
        next_ = "Nothing happens automatically: the cards stay yours until the booking ends."
    return (
        f"{what}\n\n{next_}\n\n"
        "If you are done, release it now so that others can use the cards: one click on "
        '"Release now" on its page. If you still need them, start your work.'
    )


def _team_words(reservation: Reservation, now: datetime) -> str:
    r = reservation
    due = release_due_at(r)
    return (
        f"{r.owner}'s booking {r.pk} ({r.summary}, until {format_time(r.end)}) has been idle for "
        f"{idle_for(r, now)} minutes, since {format_time(r.idle_since)}. "
        + (f"It is released at {format_time(due)} unless used." if due else "Its owner was told.")
    )


def _tell_team(reservation: Reservation, what: str, body: str, key: str) -> None:
    """The team's chat and webhook channels (portal.channels), after this round's commit."""
    team_channels_notify(
        team=reservation.team_id,
        kind=Notification.Kind.IDLE_BOOKING,
        subject=f"Booking {reservation.pk} of {reservation.owner} {what}",
        body=body,
        url=reverse("reservation_detail", args=[reservation.pk]),
        key=key,
    )


def _release(reservation: Reservation, now: datetime) -> bool:
    """Release it as the portal and tell the owner; False when it is no longer active, or no longer
    the stretch this round read: its owner came back meanwhile (a job or session on it restarted
    the clock, jobs/lending.py), checked under the row's lock, as a take-back takes it."""
    minutes = idle_for(reservation, now)
    try:
        with transaction.atomic():
            locked = reservation_locked(reservation.pk)
            read = (reservation.idle_since, reservation.idle_warned_at)
            if (locked.idle_since, locked.idle_warned_at) != read:
                log.info(
                    "Reservation %s not auto-released: in use again since this round read it", reservation.pk
                )
                return False
            reservation_release(
                user=PORTAL, reservation=reservation.pk, now=now, reason=f"idle for {minutes} minutes"
            )
            notification_send(
                user=reservation.owner,
                kind=Notification.Kind.BOOKING_RELEASED,
                subject=f"Booking {reservation.pk} released: idle for {minutes} minutes",
                body=(
                    f"The portal released your booking {reservation.pk} ({reservation.summary}) at "
                    f"{format_time(now)}: its cards had been idle for {minutes} minutes, since "
                    f"{format_time(reservation.idle_since)}, and {reservation.team} releases idle "
                    f"bookings automatically {settings.IDLE_RELEASE_MINUTES} minutes after the "
                    "warning. The cards are free for others now; book again when you need them."
                ),
                url=reverse("reservation_detail", args=[reservation.pk]),
                key=f"released:{reservation.pk}",
            )
            _tell_team(
                reservation,
                f"released: idle for {minutes} minutes",
                f"The portal released {reservation.owner}'s booking {reservation.pk} "
                f"({reservation.summary}) at {format_time(now)}: idle for {minutes} minutes.",
                f"released:{reservation.pk}",
            )
    except ServiceError as error:  # released, cancelled or ended since this round's read
        log.info("Reservation %s not auto-released: %s", reservation.pk, error.message)
        return False
    log.info("Reservation %s released: idle for %s min", reservation.pk, minutes)
    return True


# --- the team's setting ------------------------------------------------------------------------


@transaction.atomic
def team_auto_release_set(*, actor: AbstractBaseUser, team: Team, on: bool) -> Team:
    """Turn the auto-release of the team's idle bookings on or off (its leaders and admins).
    Audited; nothing is written when nothing changes.

    Turning it on makes bookings already warned get a new warning, which names their release
    time: nobody is released on a warning that said nothing would happen.
    """
    if not can_manage_team(actor, team):
        raise Forbidden(only_managers(team))
    other = Team.objects.filter(pk=team.pk).exclude(auto_release_idle=on)
    team.auto_release_idle = on
    if not other.exists():
        return team
    if on:
        # The reservations' rows before the team's: the booking services' lock order.
        Reservation.objects.filter(team=team).exclude(idle_warned_at=None).update(idle_warned_at=None)
    if other.update(auto_release_idle=on):  # none: someone else changed it a moment ago
        _switch_audit(actor, team, "auto_release_idle", on, "the auto-release of idle bookings")
    return team


@transaction.atomic
def team_lend_idle_set(*, actor: AbstractBaseUser, team: Team, on: bool) -> Team:
    """Turn the lending of the team's idle bookings to the queue on or off (its leaders and
    admins; jobs/lending.py lends them). Audited; nothing is written when nothing changes. Off
    lends nothing more; a job already on a lent card runs on until its owner takes it back."""
    if not can_manage_team(actor, team):
        raise Forbidden(only_managers(team))
    team.lend_idle = on
    if Team.objects.filter(pk=team.pk).exclude(lend_idle=on).update(lend_idle=on):
        _switch_audit(actor, team, "lend_idle", on, "the lending of idle bookings to the queue")
    return team


_SWITCH_ACTIONS = {
    "auto_release_idle": AuditEntry.Action.TEAM_AUTO_RELEASE,
    "lend_idle": AuditEntry.Action.TEAM_LEND_IDLE,
}


def _switch_audit(actor: AbstractBaseUser, team: Team, field: str, on: bool, what: str) -> None:
    """One of the team's idle-booking switches was turned: the audit log says who, which, how."""
    AuditEntry.objects.create(
        actor=actor,
        team=team,
        action=_SWITCH_ACTIONS[field],
        target=f"team {team.slug}",
        message=f"{actor} turned {'on' if on else 'off'} {what} in {team}",
        data={field: [not on, on]},
    )


# --- the thread --------------------------------------------------------------------------------


class IdleChecker(PeriodicThread):
    def __init__(self) -> None:
        super().__init__("idle-booking-checker", settings.IDLE_CHECK_SECONDS)

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        idle_check()  # logs each warning and release itself


def start_checker() -> None:
    """In the portal's own worker only (gpus/signals.py): one checker for the whole portal."""
    log.info("Idle-booking check every %ss", settings.IDLE_CHECK_SECONDS)
    start_thread(IdleChecker())
