"""What a queued job asks for, checked: cards, memory, server, time limit, array, nice, start.

Read-only checks for jobs.services.job_submit; each refusal names its field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from gpus.models import GPU, Server, format_mb
from jobs.queue import parse_array
from portal.errors import Invalid
from portal.models import Membership, Team

MAX_GPUS = 64
MAX_NICE = 1_000_000
# The booking of a queued job outlasts its time limit by this much, so the limit (not the
# booking's end) stops it, and says so (jobs.scheduler).
START_SLACK = timedelta(minutes=1)


@dataclass(frozen=True)
class QueueRequest:
    gpu_count: int
    memory_mb: int | None
    server: Server | None
    minutes: int
    indices: list[int] | None  # an array's task indices; None: one job
    max_running: int | None
    array_spec: str
    nice: int
    begin_at: datetime | None
    team: Team

    @classmethod
    def check(
        cls,
        *,
        user: AbstractBaseUser,
        gpu_count: int,
        memory_mb: int | None,
        server: str | None,
        time_limit_minutes: int | None,
        array: str,
        nice: int,
        begin_at: datetime | None,
        team: str | None,
        now: datetime,
    ) -> QueueRequest:
        if not 1 <= gpu_count <= MAX_GPUS:
            raise Invalid(f"Ask for 1 to {MAX_GPUS} cards; {gpu_count} will not do.", field="gpu_count")
        membership = _check_membership(user, team)
        chosen = _check_server(server)
        _check_memory(memory_mb, chosen)
        indices, max_running = parse_array(array) if array else (None, None)
        if not 0 <= (nice or 0) <= MAX_NICE:
            raise Invalid(
                f"nice is 0 (the default) to {MAX_NICE}; it can only lower a job's priority.", field="nice"
            )
        if begin_at is not None and begin_at < now:
            begin_at = None  # "start no earlier than" something past: now
        return cls(
            gpu_count=gpu_count,
            memory_mb=memory_mb,
            server=chosen,
            minutes=_check_minutes(time_limit_minutes, membership),
            indices=indices,
            max_running=max_running,
            array_spec=array.strip(),
            nice=nice or 0,
            begin_at=begin_at,
            team=membership.team,
        )


def _check_server(name: str | None) -> Server | None:
    if not name:
        return None
    server = Server.objects.filter(name=name).first()
    if server is None:
        raise Invalid(f"There is no server {name!r}; leave it empty for any server.", field="server")
    return server


def _check_memory(memory_mb: int | None, server: Server | None) -> None:
    if memory_mb is None:
        return
    if memory_mb <= settings.GPU_CONTEXT_HEADROOM_MB:
        raise Invalid(
            f"{format_mb(memory_mb)} per card leaves nothing after the "
            f"{settings.GPU_CONTEXT_HEADROOM_MB} MiB CUDA context headroom; ask for more, or leave it "
            "empty for whole cards.",
            field="memory_mb",
        )
    cards = GPU.objects.filter(state="ok")
    if server is not None:
        cards = cards.filter(server=server)
    largest = max(
        (GPU.bookable_mb(t, r) for t, r in cards.values_list("memory_total_mb", "memory_reserved_mb")),
        default=0,
    )
    if memory_mb > largest:
        where = f"on {server.name}" if server else "anywhere"
        raise Invalid(
            f"{format_mb(memory_mb)} per card is more than any card {where} offers "
            f"(at most {format_mb(largest)}); ask for less, or whole cards.",
            field="memory_mb",
        )


def _check_minutes(minutes: int | None, membership: Membership) -> int:
    """A queued job's time limit: required (its booking lasts that long, plus START_SLACK), with a
    default; the booking must fit the longest one allowed, the member's own limit included."""
    minutes = minutes if minutes is not None else settings.QUEUE_DEFAULT_TIME_LIMIT_MINUTES
    hours = settings.BOOKING_MAX_HOURS
    if membership.max_booking_hours is not None:
        hours = min(hours, membership.max_booking_hours)
    longest = hours * 60 - int(START_SLACK.total_seconds() // 60)
    if not 1 <= minutes <= longest:
        raise Invalid(
            f"A queued job's time limit is 1 to {longest} minutes here (a booking of at most {hours} h);"
            f" {minutes} will not do.",
            field="time_limit_minutes",
        )
    return minutes


def _check_membership(user: AbstractBaseUser, slug: str | None) -> Membership:
    memberships = Membership.objects.filter(user=user).select_related("team")
    if slug:
        membership = memberships.filter(team__slug=slug).first()
        if membership is None:
            raise Invalid(f"You are not a member of team {slug!r}; choose one of your teams.", field="team")
        return membership
    memberships = list(memberships)
    teams = [m.team for m in memberships]
    if not teams:
        raise Invalid(
            "You are in no team, so no quota covers a queued job; ask an admin to add you.", field="team"
        )
    if len(teams) > 1:
        names = ", ".join(t.slug for t in teams)
        raise Invalid(f"You are in several teams ({names}); say which one the job is for.", field="team")
    return memberships[0]
