"""What people do about a violation: stop it now, or mark it resolved with a note.

Who: whoever may see it (`Violation.objects.restrict`): who caused it, the owner of the booking it
broke, the leaders of the teams concerned, admins. Marking it resolved calls off its stop, so the
one who caused it may not do that alone (`resolvable_by`); they may stop it.

**Stop it now** is recorded on the row; its host's watchdog reads it at its next round
(jobs/host/watchdog.py) and stops it whatever the kind's policy and grace: a running job by its own
supervisor (the job ends failed, its log saying who asked and why), any other process by SIGTERM,
then SIGKILL. The request is in the audit log and told now; the stop itself is audited and told
again when it is done, as every watchdog stop is.

**Resolved** records who and the note; an open violation is never stopped from then on (a stop
under way goes on), and nobody is told of it again. In the audit log, and told.

Told, each time: who caused it, the owner of the booking it broke and the leaders of the teams
concerned, not the one who acted (docs/watchdog.md, "Acting on a violation").
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from gpus.models import Violation
from portal.access import CHANGE, permits
from portal.errors import Forbidden, Invalid
from portal.models import AuditEntry, Membership
from portal.notifications import notification_send

User = get_user_model()

NOTE_MAX = Violation._meta.get_field("resolution").max_length


@transaction.atomic
def violation_stop(*, actor: AbstractBaseUser, violation: Violation, reason: str = "") -> Violation:
    """Ask its host's watchdog to stop it at its next round; refused, with why, when it has ended,
    was acted on already, or is the booking owner's own process within their booking."""
    if not permits(actor, CHANGE, violation):
        raise Forbidden("Only who caused it, the booking's owner, their team's leaders and admins stop it.")
    reason = _note(reason, field="reason", required=False)
    now = timezone.now()
    asked = (
        Violation.objects.filter(pk=violation.pk, ended_at=None, stop_requested_at=None, resolved_at=None)
        .exclude(action__in=(Violation.Action.STOPPED, Violation.Action.STOP_FAILED))
        .exclude(kind=Violation.Kind.OWNER_OUTSIDE_JOB)
        .update(stop_requested_at=now, stop_requested_by=actor, stop_reason=reason)
    )
    violation.refresh_from_db()
    if not asked:
        raise Invalid(violation.why_not_stoppable() or "It cannot be stopped now.", field="reason")
    why = f": {reason}" if reason else ""
    _record(
        actor,
        violation,
        AuditEntry.Action.VIOLATION_STOP,
        f"{actor} asked the GPU watchdog to stop pid {violation.pid} on {_card(violation)} now{why}",
        key="stop_asked",
        subject=f"stop asked for by {actor}",
        body=f"{actor} asked for it to be stopped now{why}. The watchdog on {violation.server.name} "
        "stops it at its next round, and you will be told when it is gone.",
    )
    return violation


@transaction.atomic
def violation_resolve(*, actor: AbstractBaseUser, violation: Violation, note: str) -> Violation:
    """Mark it resolved with a note (needed: it is the record of what was done); an open one is
    then never stopped by the watchdog (a stop under way goes on)."""
    if not Violation.objects.resolvable_by(actor).filter(pk=violation.pk).exists():
        raise Forbidden(
            "You caused this violation: the booking's owner, a leader of your team or an admin marks it "
            "resolved. You may stop it."
        )
    note = _note(note, field="note", required=True)
    now = timezone.now()
    done = Violation.objects.filter(pk=violation.pk, resolved_at=None).update(
        resolved_at=now, resolved_by=actor, resolution=note
    )
    violation.refresh_from_db()
    if not done:
        raise Invalid(violation.why_not_resolvable() or "It cannot be marked resolved now.", field="note")
    still = " It is left running: the watchdog will not stop it." if violation.ended_at is None else ""
    _record(
        actor,
        violation,
        AuditEntry.Action.VIOLATION_RESOLVE,
        f"{actor} marked violation {violation.pk} (pid {violation.pid} on {_card(violation)}) "
        f"resolved: {note}",
        key="resolved",
        subject=f"resolved by {actor}",
        body=f"{actor} marked it resolved: {note}.{still}",
    )
    return violation


def _note(text: str, *, field: str, required: bool) -> str:
    text = " ".join((text or "").split())
    if required and not text:
        raise Invalid("Say how it was resolved, e.g. “bob's test run, agreed with alice”.", field=field)
    if len(text) > NOTE_MAX:
        raise Invalid(f"Keep it to {NOTE_MAX} characters at most.", field=field)
    return text


def _record(
    actor: AbstractBaseUser,
    violation: Violation,
    action: str,
    message: str,
    *,
    key: str,
    subject: str,
    body: str,
) -> None:
    """The audit entry, and the people concerned told (not the one who acted)."""
    AuditEntry.objects.create(
        actor=actor,
        team_id=violation.reservation.team_id if violation.reservation else None,
        action=action,
        target=f"violation {violation.pk}",
        message=message,
        data={"kind": violation.kind, "gpu": violation.gpu_id, "pid": violation.pid, "job": violation.job_id},
    )
    what = violation.get_kind_display().split(":")[0]
    text = "\n".join(
        [
            f"{what} on {_card(violation)}: pid {violation.pid} of {_who(violation)}"
            + (f", job {violation.job_id}" if violation.job_id else ""),
            body,
        ]
    )
    for user in concerned(violation, but=actor):
        notification_send(
            user=user,
            kind=violation.kind,
            subject=f"{_card(violation)}: {what} {subject}",
            body=text,
            url=reverse("violation_detail", args=[violation.pk]),
            key=f"violation:{violation.pk}:{key}",
        )


def concerned(violation: Violation, *, but: AbstractBaseUser | None = None) -> list[AbstractBaseUser]:
    """Who caused it, the owner of the booking it broke, and the leaders of the teams concerned
    (the booking's, and the offender's): the people told when someone acts on it."""
    people = {violation.user_id, violation.reservation.owner_id if violation.reservation else None}
    teams = set(Membership.objects.filter(user_id=violation.user_id).values_list("team_id", flat=True))
    if violation.reservation is not None:
        teams.add(violation.reservation.team_id)
    leaders = Membership.objects.filter(team_id__in=teams, role=Membership.Role.LEADER)
    people.update(leaders.values_list("user_id", flat=True))
    people.discard(None)
    if but is not None:
        people.discard(but.pk)
    return list(User.objects.filter(pk__in=people, is_active=True).order_by("username"))


def _card(violation: Violation) -> str:
    return f"{violation.gpu.server.name} GPU {violation.gpu.index}"


def _who(violation: Violation) -> str:
    return violation.user.username if violation.user else f"OS user {violation.os_user or '?'}"
