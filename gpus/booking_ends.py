"""A booking someone ended early, released or cancelled: the one sentence that says who did it
and why, for everything that stops with it, and the owner told when it was someone else.

One rule for both ways a booking ends early (issue 41): a job (jobs/host/runner.py), a Slurm job
(jobs/host/slurm_runner.py) and a lab (jobs/host/lab.py) on it end *cancelled*, saying "leader
cancelled the booking at Mon 2026-11-23 14:00 UTC (paper deadline)" exactly as they say "alice
released the booking at ...". Never *timed out*: nobody's time ran out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.urls import reverse

from gpus.hooks import Work, work_on_booking
from gpus.models import Reservation
from portal.models import Notification
from portal.notifications import notification_send
from portal.timefmt import format_time

# What a run reads of its booking to say whether, by whom and why it was ended early; a run's
# supervisor reads them through its job (prefix "reservation__").
ENDED_EARLY_FIELDS = (
    "released_at",
    "released_by__username",
    "release_reason",
    "cancelled_at",
    "cancelled_by__username",
    "cancel_reason",
)


def ended_words(verb: str, at: datetime, by: str | None, reason: str = "") -> str:
    """ "alice released the booking at Mon 2026-11-23 14:00 UTC (idle for 2 h)"; `verb` released
    or cancelled. No user: the portal did (an idle booking, a deactivated account)."""
    because = f" ({reason})" if reason else ""
    return f"{by or 'the portal'} {verb} the booking at {format_time(at)}{because}"


def ended_early_words(row: Mapping[str, Any], prefix: str = "") -> str:
    """Why what ran on a booking stopped, from its ENDED_EARLY_FIELDS (each under `prefix`): its
    cancel or its early release; "" when neither happened."""
    if at := row[f"{prefix}cancelled_at"]:
        return ended_words(
            "cancelled", at, row[f"{prefix}cancelled_by__username"], row[f"{prefix}cancel_reason"]
        )
    if at := row[f"{prefix}released_at"]:
        return ended_words(
            "released", at, row[f"{prefix}released_by__username"], row[f"{prefix}release_reason"]
        )
    return ""


def not_started_words(early: str, end: datetime) -> str:
    """Why a job no worker started ends with its booking (the reconciler's pass over queued jobs,
    a worker that claims one too late): `early`, the booking's ended_early_words, by the one rule
    ("Cancelled: leader cancelled the booking at ... (paper deadline)."), else its end."""
    if early:
        return f"Cancelled: {early}."
    return f"Cancelled: the booking ended at {format_time(end)}, before a worker started the job."


def ended_early_of(booking: Reservation) -> str:
    """The same words for a booking already loaded (a lab's supervisor holds it)."""
    return ended_early_words(
        {
            "released_at": booking.released_at,
            "released_by__username": booking.released_by.username if booking.released_by_id else None,
            "release_reason": booking.release_reason,
            "cancelled_at": booking.cancelled_at,
            "cancelled_by__username": booking.cancelled_by.username if booking.cancelled_by_id else None,
            "cancel_reason": booking.cancel_reason,
        }
    )


def _how_it_stops(work: Sequence[Work]) -> str:
    """What the owner is told happens to each: a running one is signalled, a queued one never
    starts (it has no process to signal)."""
    if not work:
        return ""
    running, waiting = any(not w.waiting for w in work), any(w.waiting for w in work)
    how = {
        (True, False): "Each gets SIGTERM, then SIGKILL after the grace period, and",
        (False, True): "A queued job never starts: it",
        (True, True): "A running one gets SIGTERM, then SIGKILL after the grace period; a queued one "
        "never starts. Each",
    }[running, waiting]
    return f" {how} ends cancelled, saying who cancelled the booking and why."


def owner_told_of_cancel(by: AbstractBaseUser, booking: Reservation, reason: str, now: datetime) -> str:
    """The owner of a booking someone else cancelled (a leader, an admin) is told, in the inbox,
    by mail as they prefer and on their channels: who, why, and what it stops. Inside the cancel's
    transaction: told if and only if it commits. Returns what it stops, in words, for the audit log."""
    work = work_on_booking(booking.pk)
    labels = "; ".join(w.label for w in work)
    stopping = f"It stops what runs on it: {labels}." if work else "Nothing ran on it."
    was = "active" if booking.start <= now else "upcoming"
    notification_send(
        user=booking.owner,
        kind=Notification.Kind.BOOKING_RELEASED,
        subject=f"{by} cancelled your booking {booking.pk}: {reason}",
        body=(
            f"{by} cancelled your {was} booking {booking.pk} ({booking.summary}, "
            f"{format_time(booking.start)} – {format_time(booking.booked_end)}) at {format_time(now)}.\n"
            f"Why: {reason}\n\n{stopping}{_how_it_stops(work)}"
        ),
        url=reverse("reservation_detail", args=[booking.pk]),
        key=f"cancelled:{booking.pk}",
    )
    return stopping
