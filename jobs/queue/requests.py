"""What a queued job asks for, checked: cards, memory, server, time limit, array, nice, start.

Read-only checks for jobs.submit.job_submit; each refusal names its field and the fix.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from gpus.models import GPU, Server, format_mb
from gpus.quotas import TOLERANCE, QuotaAsk, Use, has_limits, length_check, quota_check
from jobs.models import Job
from jobs.queue.rules import START_SLACK, parse_array
from portal.errors import Invalid
from portal.models import Membership, Team

MAX_GPUS = 64
MAX_NICE = 1_000_000


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
    preemptible: bool = False

    def job_fields(self) -> dict[str, Any]:
        """The Job fields of a queued job that asks for this."""
        return {
            "team": self.team,
            "time_limit_minutes": self.minutes,
            "queued": True,
            "status": Job.Status.PENDING,
            "gpu_count": self.gpu_count,
            "memory_mb": self.memory_mb,
            "request_server": self.server,
            "nice": self.nice,
            "begin_at": self.begin_at,
            "preemptible": self.preemptible,
        }

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
        preemptible: bool = False,
    ) -> QueueRequest:
        if not 1 <= gpu_count <= MAX_GPUS:
            raise Invalid(f"Ask for 1 to {MAX_GPUS} cards; {gpu_count} will not do.", field="gpu_count")
        membership = membership_check(user, team)
        chosen = _check_server(server)
        _check_memory(memory_mb, chosen)
        _check_some_server_fits(gpu_count, memory_mb, chosen)
        minutes = _check_minutes(time_limit_minutes)
        _check_limits(membership, gpu_count, memory_mb, chosen, minutes)
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
            minutes=minutes,
            indices=indices,
            max_running=max_running,
            array_spec=array.strip(),
            nice=nice or 0,
            begin_at=begin_at,
            team=membership.team,
            preemptible=bool(preemptible),
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
    cards = GPU.objects.portal_scheduled().filter(state="ok")
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


def _check_some_server_fits(gpu_count: int, memory_mb: int | None, server: Server | None) -> None:
    """A job's cards are all on one server: a request no server has enough cards for (of enough
    memory, for a share) would wait for ever as "resources". Every card a server has counts, a
    lost one too (it may come back); with no card known yet (nothing has reported), nothing is
    refused here."""
    cards = GPU.objects.portal_scheduled() if server is None else GPU.objects.filter(server=server)
    fitting: Counter[str] = Counter()
    known = False
    for name, total, reserved in cards.values_list("server__name", "memory_total_mb", "memory_reserved_mb"):
        known = True
        if memory_mb is None or GPU.bookable_mb(total, reserved) >= memory_mb:
            fitting[name] += 1
    if not known:
        return
    name, most = max(fitting.items(), key=lambda item: (item[1], item[0]), default=("", 0))
    if gpu_count <= most:
        return
    what = f"{gpu_count} cards" + (f" with {format_mb(memory_mb)} each" if memory_mb is not None else "")
    if server is not None:
        where, fix = f"{server.name} has {most}", "or leave the server empty for any"
    elif memory_mb is None:
        where, fix = f"the largest server, {name}, has {most}", "or split the work into smaller jobs"
    else:
        where = f"the most any server has is {most}, on {name}" if most else "no server has one"
        fix = "or less memory per card (memory_mb)"
    raise Invalid(
        f"gpu_count: {what} asked for, but {where}. Ask for at most {max(most, 1)}, {fix}.", field="gpu_count"
    )


def _check_limits(
    membership: Membership, gpu_count: int, memory_mb: int | None, server: Server | None, minutes: int
) -> None:
    """A request that no booking could ever hold within the portal's, the member's or the team's
    limits would wait as "quota" for ever, and hold its place in the queue: gpus.quotas' rules for
    bookings (its booking lasts the time limit plus START_SLACK), asked whether it could ever fit
    (nothing held, its booking across a Monday), with the cards that would count least: a whole
    card at the smallest card's memory, a share on the largest cards that fit."""
    slack = int(START_SLACK.total_seconds() // 60)
    start, end = QuotaAsk.ever_window(timedelta(minutes=minutes) + START_SLACK)

    def shorter(hours: float) -> str:
        longest = int(hours * 60 + TOLERANCE) - slack
        return f"a time limit of at most {longest} minutes" if longest >= 1 else "a shorter time limit"

    cards = "gpu_count" if memory_mb is None else "memory_mb"
    quotas = has_limits(membership) or has_limits(membership.team)
    ask = QuotaAsk(
        _least_uses(gpu_count, memory_mb, server, start, end) if quotas else (),
        start,
        end,
        fields={
            "length": "time_limit_minutes",
            "cards": "gpu_count",
            "memory": cards,
            "hours": "time_limit_minutes",
        },
        what="job",
        held=False,
        shorter=shorter,
    )
    length_check(ask)
    quota_check(membership, ask)


def _least_uses(
    gpu_count: int, memory_mb: int | None, server: Server | None, start: datetime, end: datetime
) -> list[Use]:
    """The allocations of a booking of the job that would count least against a quota: whole cards
    at the smallest card's memory; a share on the server whose largest fitting cards are the
    smallest fraction of their card (gpus.quotas' Use). A share while no card is known counts its
    memory and no GPU-hours."""
    cards = GPU.objects.portal_scheduled() if server is None else GPU.objects.filter(server=server)
    if memory_mb is None:
        smallest = min(cards.values_list("memory_total_mb", flat=True), default=0)
        return [Use.of(start, end, None, smallest)] * gpu_count
    totals: dict[int, list[int]] = defaultdict(list)
    for server_id, total, reserved in cards.values_list("server_id", "memory_total_mb", "memory_reserved_mb"):
        if GPU.bookable_mb(total, reserved) >= memory_mb:
            totals[server_id].append(total)
    options = [
        [Use.of(start, end, memory_mb, t) for t in sorted(found)[-gpu_count:]]
        for found in totals.values()
        if len(found) >= gpu_count
    ]
    least = min(options, key=lambda uses: sum(u.card_fraction for u in uses), default=None)
    return least or [Use(start, end, 0, memory_mb, 0.0)] * gpu_count


def _check_minutes(minutes: int | None) -> int:
    """A queued job's time limit: required (its booking lasts that long, plus START_SLACK), with a
    default; how long a booking may last is _check_limits', as for any booking."""
    minutes = minutes if minutes is not None else settings.QUEUE_DEFAULT_TIME_LIMIT_MINUTES
    if minutes < 1:
        raise Invalid(
            f"A queued job's time limit is at least 1 minute; {minutes} will not do.",
            field="time_limit_minutes",
        )
    if minutes > settings.BOOKING_MAX_HOURS * 60:  # said here: 2**31 minutes is no window at all
        longest = settings.BOOKING_MAX_HOURS * 60 - int(START_SLACK.total_seconds() // 60)
        raise Invalid(
            f"The portal allows bookings of at most {settings.BOOKING_MAX_HOURS} h; this job needs "
            f"{minutes // 60:,} h or more. Ask for a time limit of at most {longest} minutes.",
            field="time_limit_minutes",
        )
    return minutes


def membership_check(user: AbstractBaseUser, slug: str | None) -> Membership:
    """The team a job without a booking is for (the queue's, a Slurm cluster's: jobs/slurm.py)."""
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
        raise Invalid(
            f"You are in several teams ({names}); say which one the job is for "
            f"(the Team field; with gpu: --team {teams[0].slug}).",
            field="team",
        )
    return memberships[0]
