"""What a session's owner and the audit log are told about it, from the portal or from its host's
worker (jobs.host.lab): its booking ends soon, it was stopped and why, a lab that was refused its
start. Apart from the session services so that the host's side needs nothing of the portal's
(jobs.sessions.services sends a lab's task, jobs.tasks runs it on the host: one way round).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction

from gpus.models import Allocation
from jobs.models import InteractiveSession
from portal.models import AuditEntry, Notification
from portal.notifications import notification_send
from portal.timefmt import format_time

EXTEND_LOOKAHEAD = timedelta(hours=1)  # how far after the end the warning looks for the next booking


def session_warn_ending(session: InteractiveSession, ends_at: datetime, now: datetime) -> None:
    """The owner's inbox, once: the booking under the session ends soon; with the way to extend
    it when its cards are free after its end, else who takes them."""
    with transaction.atomic():
        if not InteractiveSession.objects.filter(pk=session.pk, warned_at=None).update(warned_at=now):
            return  # another beat told them
        minutes = max(1, round((ends_at - now).total_seconds() / 60))
        what = (
            "JupyterLab and its kernels are"
            if session.kind == InteractiveSession.Kind.JUPYTERLAB
            else (f"{session.get_kind_display()} ({' '.join(session.command)[:200]}) is")
        )
        notification_send(
            user=session.owner,
            kind=Notification.Kind.SESSION_ENDING,
            subject=f"Booking {session.reservation_id} ends at {format_time(ends_at)}: your "
            f"{session.get_kind_display()} stops then",
            body=(
                f"Your {what} on {session.server.name}, on booking {session.reservation_id}, which ends "
                f"in about {minutes} min, at {format_time(ends_at)}. It is stopped then (SIGTERM, then "
                f"SIGKILL after the grace period): save your work. {_after_end(session, ends_at)}"
            ),
            url=f"/reservations/{session.reservation_id}/",
            key=f"session-ending:{session.pk}",
        )


def _after_end(session: InteractiveSession, ends_at: datetime) -> str:
    """Whether Extend can help: the first booking of someone else on its cards after its end."""
    cards = list(session.reservation.allocations.values_list("gpu_id", flat=True))
    taken = (
        Allocation.objects.live_between(ends_at, ends_at + EXTEND_LOOKAHEAD)
        .filter(gpu_id__in=cards)
        .exclude(reservation_id=session.reservation_id)
        .order_by("start")
        .values_list("start", flat=True)
        .first()
    )
    if taken is None:
        return "Its cards are free after it: Extend the booking on its page to keep going."
    if taken > ends_at:
        return f"Its cards are free until {format_time(taken)}: Extend the booking up to then on its page."
    return "Its cards are booked by someone else right after it, so it cannot be extended."


def session_stopped_tell(session: InteractiveSession, why: str, *, reported: bool = False) -> None:
    """A stop said in the inbox and the audit log. `reported`: `gpu` on the host said it stopped
    the command (its owner's own program: the audit entry names the owner as its source)."""
    what = f"{session.get_kind_display()} session {session.pk} ({' '.join(session.command)[:200]})"
    AuditEntry.objects.create(
        actor=session.owner if reported else None,
        action=AuditEntry.Action.SESSION_STOP,
        team=session.reservation.team,
        target=f"session {session.pk}",
        message=f"Stopped {what} of {session.owner}: {why}",
        data={"reservation": session.reservation_id, "server": session.server_id, "pid": session.pid},
    )
    notification_send(
        user=session.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"Your {session.get_kind_display()} on {session.server.name} was stopped",
        body=f"Your {what} was stopped: {why}.",
        url=f"/reservations/{session.reservation_id}/",
    )


@transaction.atomic
def lab_start_refused_tell(session: InteractiveSession, why: str) -> None:
    """A lab that did not start because its server could not be proved to be the one its worker
    started (jobs.host.lab_listener.listener_proof), or because its launcher refused the listening
    socket handed to it: said in the owner's inbox and the audit log. Its token was sent nowhere;
    someone else on the host may have tried to stand in for it, which an admin wants to know."""
    what = f"{session.get_kind_display()} session {session.pk}"
    AuditEntry.objects.create(
        actor=None,
        action=AuditEntry.Action.SESSION_STOP,
        team=session.reservation.team,
        target=f"session {session.pk}",
        message=f"Refused to start {what} of {session.owner}: {why}",
        data={
            "reservation": session.reservation_id,
            "server": session.server_id,
            "pid": session.pid,
            "refused": "listener not proved",
        },
    )
    notification_send(
        user=session.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"Your {session.get_kind_display()} on {session.server.name} did not start",
        body=(
            f"Your {what} on {session.server.name}, on booking {session.reservation_id}, did not "
            f"start: {why}. Its token was sent nowhere. Start it again from the booking; if this "
            "happens again, tell an admin: another account on that host may be trying to stand in "
            "for labs."
        ),
        url=f"/reservations/{session.reservation_id}/",
    )
