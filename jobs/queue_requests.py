"""What a queued job asks for, checked: cards, memory, server, time limit, array, nice, start.

Read-only checks for jobs.submit.job_submit; each refusal names its field and the fix.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from gpus.models import GPU, Server, format_mb
from gpus.quotas import Use, gpu_hours
from jobs.models import Job
from jobs.queue import START_SLACK, parse_array
from portal.errors import Invalid
from portal.models import Membership, Team

MAX_GPUS = 64
WEEK = timedelta(days=7)
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
    ) -> QueueRequest:
        if not 1 <= gpu_count <= MAX_GPUS:
            raise Invalid(f"Ask for 1 to {MAX_GPUS} cards; {gpu_count} will not do.", field="gpu_count")
        membership = _check_membership(user, team)
        chosen = _check_server(server)
        _check_memory(memory_mb, chosen)
        _check_some_server_fits(gpu_count, memory_mb, chosen)
        _check_limits(membership, gpu_count, memory_mb, chosen)
        minutes = _check_minutes(time_limit_minutes, membership)
        _check_weekly_hours(membership, gpu_count, memory_mb, chosen, minutes)
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


def _check_some_server_fits(gpu_count: int, memory_mb: int | None, server: Server | None) -> None:
    """A job's cards are all on one server: a request no server has enough cards for (of enough
    memory, for a share) would wait for ever as "resources". Every card a server has counts, a
    lost one too (it may come back); with no card known yet (nothing has reported), nothing is
    refused here."""
    cards = GPU.objects.all() if server is None else GPU.objects.filter(server=server)
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
    membership: Membership, gpu_count: int, memory_mb: int | None, server: Server | None
) -> None:
    """A request above the member's or the team's own limit on what is held at once could never be
    booked: it would wait as "quota" for ever, and hold its place in the queue."""
    whole_mb = _smallest_card_mb(server) if memory_mb is None else 0
    need_mb = gpu_count * (memory_mb if memory_mb is not None else whole_mb)
    team = membership.team
    for limits, whose, fix in (
        (membership, f"your limit in team {team.slug}", "ask a leader of the team to raise it"),
        (team, f"team {team.slug}'s limit", "ask an admin to raise it"),
    ):
        if memory_mb is None and limits.max_cards is not None and gpu_count > limits.max_cards:
            raise Invalid(
                f"gpu_count: {gpu_count} whole cards asked for, but {whose} is {limits.max_cards} whole "
                f"card(s) at once (max_cards). Ask for at most {limits.max_cards}, or a share of each "
                f"card (memory_mb), or {fix}.",
                field="gpu_count",
            )
        if limits.max_gb is not None and need_mb > limits.max_gb * 1024:
            field = "gpu_count" if memory_mb is None else "memory_mb"
            raise Invalid(
                f"{field}: {gpu_count} card(s) of {format_mb(need_mb // gpu_count)} each is "
                f"{format_mb(need_mb)} of GPU memory, but {whose} is {limits.max_gb} GiB at once (max_gb). "
                f"Ask for fewer cards or less memory per card, or {fix}.",
                field=field,
            )


def _check_weekly_hours(
    membership: Membership, gpu_count: int, memory_mb: int | None, server: Server | None, minutes: int
) -> None:
    """A job needing more GPU-hours than a weekly limit could ever allow would wait as "quota" for
    ever. The booking service (gpus.quotas) counts each week's part of a booking against the limit,
    a share at its fraction of the card's total memory: a booking across Monday 00:00 can hold at
    most twice the limit, half in each week. So refuse above 2 × the limit (1 × a week's worth for a
    booking longer than two weeks), counted with the quotas' own rule at the most favourable cards
    the job could get (the largest that fit, on one server). Weeks are taken as 7 days (a DST week
    differs by an hour)."""
    team = membership.team
    limits = [
        (membership.gpu_hours_per_week, f"your limit in team {team.slug}", "ask a leader of the team"),
        (team.gpu_hours_per_week, f"team {team.slug}'s limit", "ask an admin"),
    ]
    if all(limit is None for limit, _, _ in limits):
        return
    booked = timedelta(minutes=minutes) + START_SLACK
    need = _least_gpu_hours(gpu_count, memory_mb, server, booked)
    if need is None:
        return  # a share, and no card known yet to count it against
    slack = int(START_SLACK.total_seconds() // 60)
    # The least of the booking that some week must hold: half, across Monday 00:00; a booking
    # longer than two weeks (BOOKING_MAX_HOURS above 336) fills a whole week whatever its start.
    in_one_week = min(0.5, WEEK / booked)
    for limit, whose, fix in limits:
        if limit is None or need * in_one_week <= limit + 1e-6:  # gpus.quotas' own tolerance
            continue
        longest = int(2 * limit * (minutes + slack) / need + 1e-6) - slack
        shorter = f"a time limit of at most {longest} minutes" if longest >= 1 else "a shorter time limit"
        raise Invalid(
            f"time_limit_minutes: {gpu_count} card(s) for {minutes} minutes (and the booking's {slack} "
            f"minute of slack) need {need:.1f} GPU-hours, but {whose} is {limit} GPU-hours a week "
            f"(gpu_hours_per_week), and one booking can never hold more than twice that, half in each "
            f"of two weeks. Ask for fewer cards or {shorter}, or {fix} to raise it.",
            field="time_limit_minutes",
        )


def _least_gpu_hours(
    gpu_count: int, memory_mb: int | None, server: Server | None, booked: timedelta
) -> float | None:
    """The fewest GPU-hours a booking of the job could count against a quota (gpus.quotas' Use and
    gpu_hours: a whole card at 1, a share at its fraction of the card's total memory), on the server
    whose largest fitting cards count least. None for a share while no card is known."""
    start = datetime(2000, 1, 3, tzinfo=UTC)  # any instant: only the booking's length counts here
    end = start + booked
    if memory_mb is None:
        return gpu_hours([Use.of(start, end, None, 0)] * gpu_count, start, end)
    cards = GPU.objects.all() if server is None else GPU.objects.filter(server=server)
    totals: dict[int, list[int]] = defaultdict(list)
    for server_id, total, reserved in cards.values_list("server_id", "memory_total_mb", "memory_reserved_mb"):
        if GPU.bookable_mb(total, reserved) >= memory_mb:
            totals[server_id].append(total)
    needs = [
        gpu_hours([Use.of(start, end, memory_mb, t) for t in sorted(found)[-gpu_count:]], start, end)
        for found in totals.values()
        if len(found) >= gpu_count
    ]
    return min(needs, default=None)


def _smallest_card_mb(server: Server | None) -> int:
    """What a whole card counts against a memory limit, at the least: the smallest card's memory."""
    cards = GPU.objects.all() if server is None else GPU.objects.filter(server=server)
    return min(cards.values_list("memory_total_mb", flat=True), default=0)


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
