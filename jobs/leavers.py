"""A deactivated user's work: nothing of theirs starts, and what they had is stopped, saying why.

A leaver's account on the GPU hosts outlives their portal account (JOB_USER=@owner runs jobs as
it), so deactivation must reach their queue and their bookings, not only their sign-in.

- `owner_active()` is the one rule every start checks: the scheduler's pending set and its start,
  `dispatch`, the reconciler's due jobs and the worker's claim (jobs/host/runner.py), inside the
  conditional UPDATE where it writes, so a job can never slip between a check and its start.
- `user_work_stop` is what deactivation does: pending and queued jobs cancelled, running ones
  asked to stop through the cancel path (their worker stops them and records them cancelled),
  upcoming bookings cancelled and active ones released (gpus.booking.reservations_cancel_for_leaver),
  all with the reason in the job's message and log, the audit log and a notification to the
  leaders of the teams concerned.

A member who leaves a team (their Membership deleted: a directory sync, a leader, the admin) has
their queued jobs of that team that have not started cancelled the same way
(`team_leaver_jobs_cancel`, from the post_delete receiver `membership_deleted` that jobs/apps.py
connects, and `team_leavers_stop` on the reconciler's pass): the booking service would refuse
every start of theirs in that team.

It happens at once when a user's is_active goes from True to False on save (jobs/signals.py: the
admin's form, a directory sync, `manage.py shell`), and on the reconciler's next pass otherwise
(`leavers_stop`, from jobs_reconcile): a deactivation written without save() (QuerySet.update,
SQL) or a handler that failed is caught there. The row is the record; the signal makes it sooner.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlencode

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservations_cancel_for_leaver
from gpus.models import Reservation
from jobs.logs.live import job_changed
from jobs.logs.store import log_append
from jobs.models import Job
from jobs.runs import waiting_job_cancel
from portal.models import AuditEntry, Membership, Notification, Team
from portal.notifications import notification_send
from portal.wakeups import QUEUE_SCHEDULER, wake_on_commit

log = logging.getLogger(__name__)

User = get_user_model()

AUDIT_JOBS_STOPPED = AuditEntry.Action.JOB_CANCEL
WAITING = (Job.Status.PENDING, Job.Status.QUEUED)
RUNNING = (Job.Status.STARTING, Job.Status.RUNNING)
IDS_SHOWN = 10


def owner_active() -> Q:
    """Jobs whose owner's account is active.

    A subquery on the owner's id, not a join (`owner__is_active`): Django turns an UPDATE with a
    join into `id IN (SELECT ...)`, and PostgreSQL would then not re-check the job's status on a
    row another worker changed meanwhile. This way every condition of a claim stays in the
    UPDATE's own WHERE."""
    return Q(owner__in=User.objects.filter(is_active=True).values("pk"))


def deactivated(user: AbstractBaseUser) -> str:
    """The reason, as the job's log, the audit log and the leaders read it."""
    return f"{user.get_username()}'s account was deactivated"


@dataclass
class WorkStopped:
    """What `user_work_stop` did: (job id, team id) pairs, and (booking, its status before)."""

    cancelled: list[tuple[int, int]] = field(default_factory=list)  # pending or queued: cancelled here
    stopping: list[tuple[int, int]] = field(default_factory=list)  # running: asked to stop
    bookings: list[tuple[Reservation, Reservation.Status]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.cancelled or self.stopping or self.bookings)


@transaction.atomic
def user_work_stop(*, user: AbstractBaseUser, reason: str, now: datetime | None = None) -> WorkStopped:
    """Stop all of `user`'s work, as the portal, because of `reason` (see `deactivated`).

    - pending and queued jobs: cancelled now ("Cancelled: <reason>."), with a line in their log;
    - starting and running jobs: asked to stop, as a cancel does; their worker sends SIGTERM (SIGKILL
      after JOB_KILL_GRACE_SECONDS), writes the reason in their log, and records them cancelled;
    - bookings: upcoming ones cancelled, active ones released now, each audited by the booking
      service (after the jobs, so a job on a booking ends cancelled, not timed out);
    - one audit entry per team for its jobs, and a notification to that team's leaders.

    Re-running it finds nothing left and writes nothing. Mail and wake-ups go after commit.
    """
    now = now or timezone.now()
    message = f"Cancelled: {reason}."[:1000]
    mine = Job.objects.filter(owner_id=user.pk).select_for_update(of=("self",), no_key=True).order_by("pk")
    # Locked: a worker's claim of one of these waits for this transaction, then finds it
    # cancelled (on SQLite, BEGIN IMMEDIATE already serialises every writer).
    stopped = WorkStopped(cancelled=_cancel_waiting(mine.filter(status__in=WAITING), message, now))
    # A running job's log is its worker's: the worker writes the reason there as it stops it.
    stopped.stopping = list(
        mine.filter(status__in=RUNNING, cancel_requested_at=None).values_list("pk", "team_id")
    )
    if stopped.stopping:
        Job.objects.filter(owner_id=user.pk, status__in=RUNNING, cancel_requested_at=None).update(
            cancel_requested_at=now, cancelled_by=None, message=message
        )
    job_changed([pk for pk, _ in stopped.stopping])  # the cancelled ones: `_cancel_waiting`
    stopped.bookings = reservations_cancel_for_leaver(user=user, reason=reason, now=now)
    if stopped:
        _audit_jobs(user, reason, stopped)
        _tell_leaders(user, reason, stopped)
        log.warning(
            "Stopped the work of %s (%s): %d job(s) cancelled, %d asked to stop, %d booking(s) ended",
            user.get_username(),
            reason,
            len(stopped.cancelled),
            len(stopped.stopping),
            len(stopped.bookings),
        )
    return stopped


def _cancel_waiting(jobs: QuerySet[Job], message: str, now: datetime) -> list[tuple[int, int]]:
    """Cancel these locked, not yet started jobs with `message`, a line in each log, and their
    change published (the pages showing them update); their (job id, team id) pairs. The claim
    is a conditional UPDATE, so one a worker took meanwhile is left to the caller's running-job
    path."""
    found = []
    for pk, team_id in jobs.values_list("pk", "team_id"):
        if waiting_job_cancel(pk, by=None, message=message, now=now):
            found.append((pk, team_id))
            # No worker has it: the log is free to write.
            log_append(pk, f"[portal] {message} The job never started.", now=now)
    if found:
        wake_on_commit(QUEUE_SCHEDULER)
    return found


def left_team(user: AbstractBaseUser, team: Team) -> str:
    """The reason, as the job's log, the audit log and the leaders read it."""
    return f"{user.get_username()} left team {team.name}"


@transaction.atomic
def team_leaver_jobs_cancel(
    *, user: AbstractBaseUser, team: Team, reason: str, now: datetime | None = None
) -> WorkStopped:
    """Cancel `user`'s queued jobs of `team` that have not started, because they left the team
    (`reason`, see `left_team`): the booking service would refuse each start (Forbidden) in every
    pass. Said in each job's message and log, one audit entry, and a notification to the team's
    leaders and to the user. The booking of a queued job already booked is released by the
    scheduler's next pass (its job has ended). Jobs on the user's own bookings are left alone:
    those bookings are theirs, not the queue's. Re-running it finds nothing and writes nothing."""
    now = now or timezone.now()
    message = f"Cancelled: {reason}."[:1000]
    waiting = (
        Job.objects.filter(owner_id=user.pk, team_id=team.pk, queued=True, status__in=WAITING)
        .select_for_update(of=("self",), no_key=True)
        .order_by("pk")
    )
    stopped = WorkStopped(cancelled=_cancel_waiting(waiting, message, now))
    if stopped:
        _audit_jobs(user, reason, stopped)
        key = f"team-leaver:{team.pk}:{user.pk}"
        after = "They are no longer a member; the audit log has the details."
        _tell_leaders(user, reason, stopped, after=after, key=key)
        notification_send(
            user=user,
            kind=Notification.Kind.JOB_STOPPED,
            subject=f"Your queued jobs in {team.name} were cancelled",
            body=f"The portal cancelled {_jobs([pk for pk, _ in stopped.cancelled])}: {reason}.",
            url=reverse("job_history"),
            key=key,
        )
        log.warning(
            "Cancelled %d queued job(s) of %s: %s", len(stopped.cancelled), user.get_username(), reason
        )
    return stopped


def membership_deleted(sender: type[Membership], instance: Membership, **kwargs: object) -> None:
    """post_delete of a Membership (a directory sync, a leader removing a member, the admin):
    the member's queued jobs of that team go at once. A failure here never stops the removal;
    the reconciler's next pass (`team_leavers_stop`) tries again."""
    try:
        with transaction.atomic():  # a savepoint: the removal's own transaction goes on
            team_leaver_jobs_cancel(
                user=instance.user, team=instance.team, reason=left_team(instance.user, instance.team)
            )
    except Exception:
        log.exception("Could not cancel the queued jobs of %s in team %s", instance.user_id, instance.team_id)


def team_leavers_stop(*, now: datetime | None = None) -> int:
    """The reconciler's part for members who left a team: queued jobs not yet started whose owner
    is no member of their team now (a removal written without delete(), or a failed handler) are
    cancelled. Returns how many (user, team) pairs; one failure never stops the others."""
    now = now or timezone.now()
    member = Membership.objects.filter(user_id=OuterRef("owner_id"), team_id=OuterRef("team_id"))
    orphans = (
        Job.objects.filter(queued=True, status__in=WAITING)
        .exclude(Exists(member))
        .values_list("owner_id", "team_id")
        .distinct()
    )
    done = 0
    for owner_id, team_id in list(orphans):
        try:
            user, team = User.objects.get(pk=owner_id), Team.objects.get(pk=team_id)
            done += bool(team_leaver_jobs_cancel(user=user, team=team, reason=left_team(user, team), now=now))
        except Exception:
            log.exception("Could not cancel the queued jobs of user %s in team %s", owner_id, team_id)
    return done


def leavers_stop(*, now: datetime | None = None) -> int:
    """The reconciler's part: stop the work of every inactive user who still has some (a
    deactivation that bypassed save(), or whose handler failed). Returns how many users.

    One user's failure is logged and the others go on; the next pass tries again."""
    now = now or timezone.now()
    busy = Job.objects.filter(Q(status__in=WAITING) | Q(status__in=RUNNING, cancel_requested_at=None)).values(
        "owner_id"
    )
    booked = Reservation.objects.with_status("open", now).values("owner_id")
    stopped = 0
    for user in User.objects.filter(Q(pk__in=busy) | Q(pk__in=booked), is_active=False):
        try:
            stopped += bool(user_work_stop(user=user, reason=deactivated(user), now=now))
        except Exception:
            log.exception("Could not stop the work of deactivated user %s; the next pass tries again", user)
    return stopped


# --- telling -----------------------------------------------------------------------------------


def _jobs(ids: Sequence[int]) -> str:
    """ "job 12", or "3 jobs (12, 13, 14)": an array's thousand tasks in one short line."""
    if len(ids) == 1:
        return f"job {ids[0]}"
    shown = ", ".join(str(pk) for pk in ids[:IDS_SHOWN])
    more = f" and {len(ids) - IDS_SHOWN} more" if len(ids) > IDS_SHOWN else ""
    return f"{len(ids)} jobs ({shown}{more})"


def _by_team(pairs: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    teams: dict[int, list[int]] = defaultdict(list)
    for pk, team_id in pairs:
        teams[team_id].append(pk)
    return teams


def _audit_jobs(user: AbstractBaseUser, reason: str, stopped: WorkStopped) -> None:
    """One entry per team (the bookings have theirs from the booking service)."""
    cancelled, stopping = _by_team(stopped.cancelled), _by_team(stopped.stopping)
    for team_id in sorted(cancelled.keys() | stopping.keys()):
        done = []
        if cancelled[team_id]:
            done.append(f"cancelled {_jobs(cancelled[team_id])}")
        if stopping[team_id]:
            done.append(f"asked {_jobs(stopping[team_id])} to stop")
        AuditEntry.objects.create(
            actor=None,
            team_id=team_id,
            action=AUDIT_JOBS_STOPPED,
            target=f"user {user.get_username()}",
            message=f"The portal {' and '.join(done)} of {user.get_username()}: {reason}",
            data={
                "by": "portal",
                "reason": reason,
                "cancelled": cancelled[team_id],
                "stopping": stopping[team_id],
            },
        )


def _team_lines(team_id: int, stopped: WorkStopped) -> list[str]:
    lines = []
    if cancelled := [pk for pk, team in stopped.cancelled if team == team_id]:
        lines.append(f"- cancelled {_jobs(cancelled)} that had not started;")
    if stopping := [pk for pk, team in stopped.stopping if team == team_id]:
        lines.append(f"- stopping {_jobs(stopping)} that were running (each log says why);")
    for booking, status in stopped.bookings:
        if booking.team_id == team_id:
            done = "cancelled" if status == Reservation.Status.UPCOMING else "released early"
            lines.append(f"- {done} booking {booking.pk} ({status.label.lower()}: {booking.summary});")
    return lines


def _tell_leaders(
    user: AbstractBaseUser,
    reason: str,
    stopped: WorkStopped,
    *,
    after: str = "Nothing of theirs starts while the account is inactive; the audit log has the details.",
    key: str = "",
) -> None:
    """Each active leader of a team concerned (not the leaver): one notification, their teams' part."""
    teams = {team for _, team in stopped.cancelled + stopped.stopping} | {
        b.team_id for b, _ in stopped.bookings
    }
    leads: dict[int, list[Membership]] = defaultdict(list)
    for membership in (
        Membership.objects.filter(team_id__in=teams, role=Membership.Role.LEADER, user__is_active=True)
        .exclude(user_id=user.pk)
        .select_related("user", "team")
        .order_by("team__name")
    ):
        leads[membership.user_id].append(membership)
    name = user.get_username()
    kind = (
        Notification.Kind.JOB_STOPPED
        if stopped.cancelled or stopped.stopping
        else Notification.Kind.BOOKING_RELEASED
    )
    for memberships in leads.values():
        parts = [f"{m.team}:\n" + "\n".join(_team_lines(m.team_id, stopped)) for m in memberships]
        notification_send(
            user=memberships[0].user,
            kind=kind,
            subject=f"{name}'s work was stopped: {reason}",
            body=(f"The portal stopped {name}'s work: {reason}.\n\n" + "\n\n".join(parts) + f"\n\n{after}"),
            url=f"{reverse('job_history')}?{urlencode({'user': name})}",
            key=key or f"leaver:{user.pk}",
        )
