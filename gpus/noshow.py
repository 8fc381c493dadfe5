"""No-shows: a booking its owner never used, from its start, for NO_SHOW_MINUTES.

The idle round (gpus/idle.py) marks a booking *used* (`Reservation.used_at`) the first time it
finds one of its cards that nothing is lent from not idle: the owner's process, job or session on
its cards, or anything it cannot see (an offline server, an unreadable process list). Unknown counts as used
on purpose: a no-show is a verdict on a person, so the portal gives it only on cards it saw unused
all along. A borrower's work on a lent booking (jobs/lending.py) is not the owner's use.

A booking still unused NO_SHOW_MINUTES after its start is a no-show: its owner is told once
(`no_show_at`, claimed with a conditional UPDATE, so a second round or checker never tells twice),
and where its team releases idle bookings (`Team.auto_release_idle`, the same switch its leaders
already set) the portal releases it at once, through gpus.booking like any release. Loans are the
queue's bookings, never no-shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.urls import reverse

from gpus.booking import PORTAL, reservation_release
from gpus.models import Reservation
from portal.channels import team_channels_notify
from portal.errors import ServiceError
from portal.models import Notification
from portal.notifications import notification_send
from portal.timefmt import format_time

log = logging.getLogger(__name__)


def lent_now(bookings: Iterable[Reservation], now: datetime) -> dict[int, set[str]]:
    """The bookings among `bookings` with a live loan on them, each with its lent cards' UUIDs:
    the work on those cards is a borrower's."""
    loans = Reservation.objects.loans_live(now).filter(lent_from__in=[b.pk for b in bookings])
    lent: dict[int, set[str]] = {}
    for booking, card in loans.values_list("lent_from_id", "allocations__gpu_id"):
        lent.setdefault(booking, set()).add(card)
    return lent


def reservation_mark_used(pk: int, now: datetime) -> None:
    """The owner came back to their lent booking (jobs/lending.py's take-back: their job, session
    or process on it): that is use, which the idle round cannot tell from the borrower's while the
    borrower is still on the cards, so a return in the last minutes before the verdict was judged
    a no-show and, where the team asked, released under the owner."""
    Reservation.objects.filter(pk=pk, used_at=None).update(used_at=now)


def no_show_due(reservation: Reservation, now: datetime) -> bool:
    """Unused from its start for NO_SHOW_MINUTES, not told yet, and a person's booking."""
    return (
        reservation.lent_from_id is None
        and reservation.used_at is None
        and reservation.no_show_at is None
        and now - reservation.start >= timedelta(minutes=settings.NO_SHOW_MINUTES)
    )


def no_show_handle(reservation: Reservation, now: datetime) -> tuple[bool, bool]:
    """Tell the owner (once) and release where the team asked; (told, released)."""
    with transaction.atomic():
        claimed = Reservation.objects.filter(pk=reservation.pk, used_at=None, no_show_at=None).update(
            no_show_at=now
        )
        if not claimed:
            return False, False
        reservation.no_show_at = now
        if reservation.idle_since is not None and reservation.idle_warned_at is None:
            # The notice stands for this stretch's idle warning: one message, not two at once.
            Reservation.objects.filter(pk=reservation.pk).update(idle_warned_at=now)
            reservation.idle_warned_at = now
        released = reservation.team.auto_release_idle and _release(reservation, now)
        _tell(reservation, now, released=released)
    log.info("Reservation %s is a no-show%s", reservation.pk, ": released" if released else "")
    return True, released


def _release(reservation: Reservation, now: datetime) -> bool:
    reason = f"no-show: unused for {_minutes(reservation, now)} minutes from its start"
    try:
        with transaction.atomic():
            reservation_release(user=PORTAL, reservation=reservation.pk, now=now, reason=reason)
    except ServiceError as error:  # released, cancelled or ended since this round's read
        log.info("Reservation %s not released as a no-show: %s", reservation.pk, error.message)
        return False
    return True


def _minutes(reservation: Reservation, now: datetime) -> int:
    return (now - reservation.start) // timedelta(minutes=1)


def _tell(reservation: Reservation, now: datetime, *, released: bool) -> None:
    r, minutes = reservation, _minutes(reservation, now)
    seen = (
        f"Your booking {r.pk} ({r.summary}) started at {format_time(r.start)} and its cards have not "
        f"been used since: {minutes} minutes with no process on them."
    )
    if released:
        kind = Notification.Kind.BOOKING_RELEASED
        subject = f"Booking {r.pk} released: not used from its start"
        next_ = (
            f"{r.team} releases unused bookings automatically, so the portal released it at "
            f"{format_time(now)}; its cards are free for others. Book again when you need them."
        )
    else:
        kind, subject = Notification.Kind.IDLE_BOOKING, f"Booking {r.pk} not used since its start"
        next_ = (
            f"It stays yours until {format_time(r.end)}. If you no longer need it, release it "
            'so that others can use the cards: one click on "Release now" on its page.'
        )
    url = reverse("reservation_detail", args=[r.pk])
    notification_send(
        user=r.owner,
        kind=kind,
        subject=subject,
        body=f"{seen}\n\n{next_}",
        url=f"{url}#actions",
        key=f"no-show:{r.pk}",
    )
    team_channels_notify(
        team=r.team_id,
        kind=Notification.Kind.IDLE_BOOKING,
        subject=f"Booking {r.pk} of {r.owner} is a no-show" + (": released" if released else ""),
        body=f"{r.owner}'s booking {r.pk} ({r.summary}) has not been used in the {minutes} minutes "
        f"since its start at {format_time(r.start)}." + (" The portal released it." if released else ""),
        url=url,
        key=f"no-show:{r.pk}",
    )
