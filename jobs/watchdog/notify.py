"""Who is told what about a violation (jobs/host/watchdog.py decides when).

- the offender: the portal user behind the process (the job's owner, or the OS user's account);
- the owners of the other bookings active on that card now: their card was taken, or shared
  memory was overrun (not for `unbooked`, which harms no booking yet);
- the offender's team leaders, when the offender has had WATCHDOG_REPEAT_OFFENCES offences or
  more in the past week. An offence is an event, not a process: the violations of one job (or of
  one person outside jobs) of one kind on one card that overlap in time are one offence, so a job
  of three processes over its memory is one, not three (`offences`).

The teams concerned are told too, in their chat and webhook channels (portal.channels), with the
same key. Every message is in the inbox; mail follows each person's preferences, at most one per person and
violation every NOTIFY_MAIL_EVERY_MINUTES (the key `violation:<id>`; a stop or a failed stop has a
key of its own, so it is never held back by the first warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Exists, OuterRef, Q, Value
from django.db.models.functions import Coalesce
from django.urls import reverse
from django.utils import timezone

from gpus.models import Allocation, Violation, format_mb
from gpus.selectors import program_name
from jobs.models import Job
from portal.channels import team_channels_notify
from portal.models import Membership
from portal.notifications import notification_send
from portal.timefmt import format_time

User = get_user_model()

EVENTS = {
    "seen": "was seen",
    "dry_run": "would have been stopped now (dry run)",
    "stopped": "was stopped",
    "stop_failed": "could not be stopped",
}
WHY = {
    Violation.Kind.ESCAPED: "a job's process runs on a card its booking does not hold",
    Violation.Kind.OVER_MEMORY: (
        "a job, or a booking owner's processes outside their jobs, use more memory on a shared card"
        " than was booked"
    ),
    Violation.Kind.INTRUDER: "a process the portal did not start runs on a booked card",
    Violation.Kind.OWNER_OUTSIDE_JOB: "the booking's owner runs a process outside a portal job",
    Violation.Kind.UNBOOKED: "a process the portal did not start runs on a card nobody booked",
    Violation.Kind.ZOMBIE: "a process of a job that has ended still holds GPU memory",
}


def tell_about(violation: Violation, *, event: str, next_step: str = "", pids: Sequence[int] = ()) -> int:
    """Notify everyone concerned by `violation` of `event`, saying what happens next; returns how
    many were told. `pids`: every process of the same event (one job, or one person outside jobs,
    of one kind on one card), told about in this one message."""
    url = reverse("violation_detail", args=[violation.pk])
    key = f"violation:{violation.pk}" if event == "seen" else f"violation:{violation.pk}:{event}"
    subject = f"{_card(violation)}: {violation.get_kind_display().split(':')[0]} {EVENTS[event]}"
    told = 0
    for user, role in _people(violation, event):
        notification_send(
            user=user,
            kind=violation.kind,
            subject=subject,
            body=_body(violation, event, role, next_step, pids),
            url=url,
            key=key,
        )
        told += 1
    _tell_teams(violation, event, subject, url, key, next_step, pids)
    return told


def _tell_teams(
    violation: Violation, event: str, subject: str, url: str, key: str, next_step: str, pids: Sequence[int]
) -> None:
    """The chat and webhook channels of the teams concerned (portal.channels): the team the
    offender worked for (their job's, else each of theirs) and the team of the booking on the card.
    They get what a teammate may read: the program's name, never its arguments."""
    teams = set()
    if violation.job_id is not None:
        teams.update(Job.objects.filter(pk=violation.job_id).values_list("team_id", flat=True))
    elif violation.user_id is not None:
        teams.update(Membership.objects.filter(user_id=violation.user_id).values_list("team_id", flat=True))
    if violation.reservation is not None:
        teams.add(violation.reservation.team_id)
    body = _body(violation, event, "team", next_step, pids)
    for team_id in sorted(teams):
        team_channels_notify(team=team_id, kind=violation.kind, subject=subject, body=body, url=url, key=key)


def _people(violation: Violation, event: str) -> list[tuple[object, str]]:
    people: dict[int, tuple[object, str]] = {}
    if violation.user is not None:
        people[violation.user.pk] = (violation.user, "offender")
    if violation.kind not in (Violation.Kind.UNBOOKED, Violation.Kind.OWNER_OUTSIDE_JOB):
        for owner in _card_owners_now(violation):
            people.setdefault(owner.pk, (owner, "owner"))
    if event == "seen" and violation.user is not None and _repeat_offender(violation):
        for leader in _leaders_of(violation.user):
            people.setdefault(leader.pk, (leader, "leader"))
    return list(people.values())


def _card_owners_now(violation: Violation) -> list[object]:
    """Owners of the bookings active on the card now, other than the job's own booking."""
    now = timezone.now()
    allocations = Allocation.objects.live_at(now).filter(gpu_id=violation.gpu_id)
    if violation.job_id is not None and violation.reservation_id is not None:
        allocations = allocations.exclude(reservation_id=violation.reservation_id)
    owners = allocations.values_list("reservation__owner_id", flat=True)
    return list(User.objects.filter(pk__in=owners))


def _repeat_offender(violation: Violation) -> bool:
    since = timezone.now() - timedelta(days=7)
    return offences(violation.user_id, since=since) >= settings.WATCHDOG_REPEAT_OFFENCES


def offences(user_id: int | None, *, since: datetime) -> int:
    """The user's offences first seen since `since`: one per event, not per process. A violation
    that began while another of the same card, kind and job (or, outside jobs, the same person)
    was open is part of that one's event, and not counted again."""
    job = Coalesce("job_id", Value(0))
    earlier = (
        Violation.objects.annotate(job_key=job)
        .filter(
            user_id=OuterRef("user_id"),
            gpu_id=OuterRef("gpu_id"),
            kind=OuterRef("kind"),
            job_key=OuterRef("job_key"),
        )
        .filter(
            Q(first_seen__lt=OuterRef("first_seen"))
            | Q(first_seen=OuterRef("first_seen"), pk__lt=OuterRef("pk"))
        )
        .filter(Q(ended_at=None) | Q(ended_at__gt=OuterRef("first_seen")))
    )
    return (
        Violation.objects.filter(user_id=user_id, first_seen__gte=since)
        .exclude(kind=Violation.Kind.OWNER_OUTSIDE_JOB)
        .annotate(job_key=job)
        .exclude(Exists(earlier))
        .count()
    )


def _leaders_of(user: object) -> list[object]:
    teams = Membership.objects.filter(user=user).values_list("team_id", flat=True)
    leaders = Membership.objects.filter(team_id__in=teams, role=Membership.Role.LEADER).exclude(user=user)
    return list(User.objects.filter(pk__in=leaders.values_list("user_id", flat=True)))


def _card(violation: Violation) -> str:
    return f"{violation.gpu.server.name} GPU {violation.gpu.index}"


def _body(violation: Violation, event: str, role: str, next_step: str, pids: Sequence[int]) -> str:
    who = violation.user.username if violation.user else f"OS user {violation.os_user or '?'}"
    memory = format_mb(violation.memory_mb) if violation.memory_mb is not None else "unknown memory"
    lines = [
        f"The GPU watchdog saw that {WHY[violation.kind]}:",
        f"  card: {_card(violation)} ({violation.gpu_id})",
        # Arguments may hold secrets: only the process's own user reads them (gpus.selectors).
        f"  process: pid {violation.pid} of {who}: "
        f"{(violation.command if role == 'offender' else program_name(violation.command)) or '?'}",
        f"  memory: {memory}"
        + (f" (booked {format_mb(violation.booked_mb)})" if violation.booked_mb else ""),
    ]
    others = sorted(set(pids) - {violation.pid})
    if others:
        lines.append(f"  and {len(others)} more of the same: pid {', '.join(map(str, others))}")
    if violation.job_id:
        lines.append(f"  job: {violation.job_id}")
    if violation.reservation is not None:
        lines.append(
            f"  booking: #{violation.reservation_id} of {violation.reservation.owner.username}, "
            f"until {format_time(violation.reservation.end)}"
        )
    lines.append(f"It {EVENTS[event]} ({format_time(timezone.now())}).")
    if violation.stop_requested_at is not None and event != "seen":
        by = violation.stop_requested_by.username if violation.stop_requested_by else "someone"
        why = f": {violation.stop_reason}" if violation.stop_reason else ""
        lines.append(f"Its stop was asked for by {by} on the portal{why}.")
    if violation.message:
        lines.append(violation.message)
    if next_step:
        lines.append(next_step)
    lines.append(_advice(violation, role))
    return "\n".join(lines)


def _advice(violation: Violation, role: str) -> str:
    if role == "owner":
        return "It is on your booking: the portal deals with it as above; you need do nothing."
    if role == "leader":
        return "You lead a team of the person concerned, who has had several violations this week."
    if role == "team":
        return "Sent to this team's channel: its leaders see every violation on the portal's Violations page."
    return {
        Violation.Kind.ESCAPED: "Keep to your booked cards: use the CUDA_VISIBLE_DEVICES the portal sets.",
        Violation.Kind.OVER_MEMORY: (
            "Book more memory, limit your job to its booking (memory mode), or end what you run on"
            " the card outside your jobs: all your processes there count against your booking."
        ),
        Violation.Kind.INTRUDER: "Book the card on the portal and run your work as a job on it.",
        Violation.Kind.UNBOOKED: "Book the card on the portal before you use it.",
        Violation.Kind.ZOMBIE: "Stop the processes your job left behind.",
        Violation.Kind.OWNER_OUTSIDE_JOB: "Fine on your own booking; a portal job would show in its figures.",
    }[violation.kind]
