"""The queue's rules: fair-share priority and the plan of which pending job starts when.

Pure functions over plain data, like the watchdog's rules: the scheduler (jobs/queue/scheduler.py)
gathers the facts, and the Queue page and API show the same plan.

**Priority** = fair-share factor × QUEUE_FAIRSHARE_WEIGHT + age factor × QUEUE_AGE_WEIGHT − nice.
The fair-share factor is Slurm's classic 2^(−usage/shares), once for the team among the teams
and once for the member within the team, multiplied. Usage is booked GPU-hours (a memory share
counts its fraction of the card, the quotas' rule), manual bookings and queued jobs alike,
decayed with a half-life of FAIRSHARE_HALF_LIFE_DAYS. The age factor grows from 0 to 1 over
QUEUE_AGE_MAX_HOURS of waiting.

**The plan** walks the pending jobs in priority order over one calendar: the live bookings
(manual ones and the running jobs' own). A job that fits now on one server starts; the first
QUEUE_BACKFILL_DEPTH that do not get a *shadow booking* at their earliest estimated start, which
the jobs after them must not overlap. So a lower-priority job starts now only where it cannot
delay any of those (conservative backfill), and a wide job waiting for a whole server keeps its
place while short jobs run in front of it. No more jobs start on a server than its worker has
free slots, where the worker said how many it runs at once (`Calendar.slots`); none on a server
whose worker said so once but has since gone silent (`Calendar.silent`): such a server gets no
estimate either, and a job that would fit there now says why it waits (`Entry.note`); so does a
job that asked for a server that is offline (reason `offline`). Whether a job fits
a card is the booking service's own rule (gpus.conflicts.fits_on_card), over the window the
scheduler will book (`Request.booked`: the time limit and START_SLACK).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from jobs.queue.calendar import Calendar
from portal.errors import Invalid

MAX_ARRAY = 10_000
# The booking of a queued job outlasts its time limit by this much, so the limit (not the
# booking's end) stops it, and says so (jobs.queue.scheduler). The plan checks that whole window.
START_SLACK = timedelta(minutes=1)
ARRAY_SPEC_MAX_CHARS = 50  # JobArray.spec's max_length
# Job.array_index and JobArray.max_running are PositiveIntegerFields: PostgreSQL's integer.
MAX_ARRAY_NUMBER = 2**31 - 1
# Why a job in a container image waits when no server it may use is up (its note, `Entry.note`).
NO_IMAGE_SERVER = (
    "no online server that has its image has working containers now; it starts once one does "
    "(the image's servers are in GET /api/v1/images/)"
)
_ARRAY = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*(?:%\s*(\d+)\s*)?$|^\s*(\d+)\s*$")

# --- arrays ---------------------------------------------------------------------------------------


def parse_array(spec: str) -> tuple[list[int], int | None]:
    """'0-99%8' → (indices 0..99, at most 8 running); '5' → ([5], None)."""
    if len(spec or "") > ARRAY_SPEC_MAX_CHARS:  # JobArray.spec keeps it as given
        raise Invalid(f"An array is at most {ARRAY_SPEC_MAX_CHARS} characters, like 0-99%8.", field="array")
    match = _ARRAY.match(spec or "")
    if not match:
        raise Invalid(
            f"{spec!r} is not an array: write it like 0-99, or 0-99%8 for at most 8 at once.", field="array"
        )
    numbers = [int(number) for number in match.groups() if number is not None]
    if max(numbers) > MAX_ARRAY_NUMBER:  # else the database refuses the row: a 500
        raise Invalid(
            f"{spec!r}: indices and the % limit go up to {MAX_ARRAY_NUMBER}; write smaller numbers.",
            field="array",
        )
    if match[4] is not None:
        return [int(match[4])], None
    first, last = int(match[1]), int(match[2])
    limit = int(match[3]) if match[3] else None
    if last < first:
        raise Invalid(
            f"{spec!r}: the last index must not be below the first; write {last}-{first}.", field="array"
        )
    if last - first + 1 > MAX_ARRAY:
        raise Invalid(
            f"{spec!r} makes {last - first + 1} tasks; at most {MAX_ARRAY} in one array.", field="array"
        )
    if limit is not None and limit < 1:
        raise Invalid(f"{spec!r}: %{limit} would never run a task; give at least %1.", field="array")
    return list(range(first, last + 1)), limit


# --- fair share -------------------------------------------------------------------------------------


def decayed_hours(
    start: datetime, end: datetime, fraction: float, now: datetime, half_life: timedelta
) -> float:
    """GPU-hours booked in [start, min(end, now)), each hour weighted 0.5^(its age / half-life)."""
    end = min(end, now)
    if end <= start:
        return 0.0
    h = half_life.total_seconds()
    ages = (now - end).total_seconds(), (now - start).total_seconds()
    # ∫ 0.5^(age/h) d(age) over the booking's ages, in hours.
    return fraction * h / math.log(2) * (0.5 ** (ages[0] / h) - 0.5 ** (ages[1] / h)) / 3600


@dataclass(frozen=True)
class Shares:
    """Who holds which share: teams among themselves, members within their team."""

    team: dict[int, int]  # team id → shares
    member: dict[tuple[int, int], int]  # (team id, user id) → shares


@dataclass(frozen=True)
class Usage:
    team: dict[int, float]
    member: dict[tuple[int, int], float]


def fairshare_factor(team: int, user: int, shares: Shares, usage: Usage) -> float:
    """2^(−U/S) for the team among the teams, times the same for the member within the team: 1 for
    who used nothing, ½ for who used exactly their share, less for more."""
    return _factor(team, shares.team, usage.team) * _factor(
        (team, user),
        {k: v for k, v in shares.member.items() if k[0] == team},
        {k: v for k, v in usage.member.items() if k[0] == team},
    )


def _factor(key: object, shares: dict, usage: dict) -> float:
    total_shares = sum(shares.values()) or 1
    total_usage = sum(usage.values())
    if total_usage <= 0:
        return 1.0
    share = shares.get(key, 1) / total_shares
    used = usage.get(key, 0.0) / total_usage
    return 2.0 ** (-used / share) if share > 0 else 0.0


# --- the plan -----------------------------------------------------------------------------------------


class Request(NamedTuple):
    """A pending job as the plan takes it: a plain value, a thousand of them made every pass (a
    NamedTuple, which is made several times faster than a frozen dataclass)."""

    job_id: int
    user_id: int
    team_id: int
    gpu_count: int
    memory_mb: int | None  # per card; None: whole cards
    server_id: int | None  # None: any server
    minutes: int
    submitted_at: datetime
    nice: int = 0
    begin_at: datetime | None = None
    array_id: int | None = None
    # A job in a container image: the servers that have it and where containers work (None: any).
    servers: frozenset[int] | None = None
    # How long it is expected to run (jobs/queue/expected.py; the pages' plan only, never a pass's):
    # the jobs after it count on its cards from then. Its own start still needs its whole window.
    expected_minutes: int | None = None

    @property
    def booked(self) -> timedelta:
        """How long its booking lasts once it starts: the time limit and START_SLACK. The plan
        checks this window, the one the scheduler asks the booking service for."""
        return timedelta(minutes=self.minutes) + START_SLACK

    @property
    def holds(self) -> timedelta:
        """How long the plan keeps its cards from the jobs after it: its booking, or what it is
        expected to take (shorter, never longer)."""
        if self.expected_minutes is None:
            return self.booked
        return min(self.booked, timedelta(minutes=self.expected_minutes) + START_SLACK)


@dataclass(frozen=True)
class Weights:
    fairshare: float
    age: float
    age_max: timedelta


@dataclass
class Entry:
    """One pending job in the plan: its priority and factors, and what the plan decided."""

    request: Request
    priority: float
    fairshare: float
    age: float
    start_now: list[str] = field(default_factory=list)  # the cards to book now; empty: it waits
    estimated_start: datetime | None = None
    reason: str = ""
    held: list[str] = field(default_factory=list)  # its shadow's cards, from estimated_start
    note: str = ""  # why it waits, in words, beyond its reason (a silent worker where it would fit)
    basis: str = ""  # what its estimated start rests on (jobs/queue/expected.py): begin_time, plan, lending


def plan(
    requests: Sequence[Request],
    calendar: Calendar,
    *,
    shares: Shares,
    usage: Usage,
    weights: Weights,
    depth: int,
    draining: set[int],
    array_room: dict[int, int],
    not_now: Collection[int] = (),
    offline: dict[int, str] | None = None,
) -> list[Entry]:
    """Every pending job in priority order, with what to do about it now (see the module's text).

    `array_room`: how many more tasks each array may run now. `not_now`: jobs that wait this pass
    whatever the calendar says, but keep their place: their shadows bind the jobs after them.
    `offline`: the servers jobs asked for by name that are not online, with the words that say so:
    such a job waits, saying why, and gets no estimate (when a host comes back is anyone's guess).
    Mutates `calendar` (the starts and the shadows), so the caller can book exactly what the plan
    chose."""
    now = calendar.now
    entries = _ordered(requests, now, shares, usage, weights)
    refused: dict[tuple, list[tuple]] = defaultdict(list)  # shapes that did not fit now, by where they may go
    blocked_by_shadows: dict[tuple, bool] = {}
    estimates: dict[tuple, datetime | None] = {}
    silences: dict[tuple, str] = {}
    shadows = 0
    room = dict(array_room)
    for entry in entries:
        r = entry.request
        if _waits_regardless(entry, now, draining, offline or {}, room):
            continue
        if r.job_id in not_now:
            # Its start was refused this pass (a card taken since the plan read them): it starts on a
            # later pass, and keeps its place (its shadow) meanwhile. Not a refused shape: the
            # cards it would have fitted are not known to be full.
            entry.reason = "resources"
        else:
            shape = (r.gpu_count, r.memory_mb, r.server_id, r.minutes)
            where = (r.server_id, r.servers)  # shapes compare only among jobs that may use the same servers
            dominated = _dominated(shape, refused[where])
            cards = [] if dominated else _fit_now(calendar, r, draining)
            if cards:
                entry.start_now = cards
                calendar.start(cards, now + r.holds, r.memory_mb)
                if r.array_id is not None:
                    room[r.array_id] = room.get(r.array_id, 1) - 1
                continue
            if not dominated:  # what a refused shape dominates, it dominates too: kept once
                refused[where].append(shape)
            if (shape, where) not in blocked_by_shadows:
                # It would fit now but for the room held for jobs before it: it waits for priority.
                blocked_by_shadows[(shape, where)] = bool(_fit_now(calendar, r, draining, shadows=False))
            entry.reason = "priority" if blocked_by_shadows[(shape, where)] else "resources"
            entry.note = _note(calendar, r, draining, silences)
        if shadows < depth:
            shadows += _shadow(calendar, entry, draining, estimates)
    return entries


def _shadow(
    calendar: Calendar, entry: Entry, draining: set[int], estimates: dict[tuple, datetime | None]
) -> int:
    """A waiting job's estimated start, and its shadow there: the jobs after it must leave room
    for it at its estimate. 1 when a shadow was placed."""
    r = entry.request
    at, server = _estimate(calendar, r, draining, estimates)
    entry.estimated_start, entry.basis = at, ("plan" if at is not None else "")
    if at is None or server is None:
        return 0
    held = calendar.free_cards(server, at, at + r.booked, r.memory_mb)[: r.gpu_count]
    calendar.add(held, at, at + r.holds, r.memory_mb, shadow=True)
    entry.held = held
    return 1


def _waits_regardless(
    entry: Entry, now: datetime, draining: set[int], offline: dict[int, str], room: dict[int, int]
) -> bool:
    """Whether the job waits whatever the calendar says, its reason (and words) set: it asked for
    a later start, its chosen server is offline or draining, or its array runs all it may."""
    r = entry.request
    if r.begin_at is not None and r.begin_at > now:
        entry.reason, entry.estimated_start, entry.basis = "begin_time", r.begin_at, "begin_time"
    elif r.server_id is not None and r.server_id in offline:
        entry.reason, entry.note = "offline", offline[r.server_id]
    elif r.server_id is not None and r.server_id in draining:
        entry.reason = "draining"
    elif r.array_id is not None and room.get(r.array_id, 1) <= 0:
        entry.reason = "array_limit"
    else:
        return False
    return True


def _dominated(shape: tuple, refused: list[tuple]) -> bool:
    """True when a shape that asks no less (cards, memory per card — whole is most — and minutes)
    was already refused this pass: the calendar only fills up within a pass, so it fails too."""
    count, memory, _server, minutes = shape
    for r_count, r_memory, _, r_minutes in refused:
        more_memory = memory is None or (r_memory is not None and memory >= r_memory)
        if count >= r_count and minutes >= r_minutes and more_memory:
            return True
    return False


def _ordered(
    requests: Sequence[Request], now: datetime, shares: Shares, usage: Usage, weights: Weights
) -> list[Entry]:
    """The entries in priority order, the oldest first among equals. The fair-share factor is
    worked out once per team and member: a thousand jobs, a few dozen people."""
    factors: dict[tuple[int, int], float] = {}
    entries = []
    for r in requests:
        if (r.team_id, r.user_id) not in factors:
            factors[(r.team_id, r.user_id)] = fairshare_factor(r.team_id, r.user_id, shares, usage)
        entries.append(_entry(r, now, factors[(r.team_id, r.user_id)], weights))
    return sorted(entries, key=lambda e: (-e.priority, e.request.submitted_at, e.request.job_id))


def _entry(r: Request, now: datetime, fair: float, weights: Weights) -> Entry:
    age = min(1.0, max(0.0, (now - r.submitted_at) / weights.age_max)) if weights.age_max else 0.0
    priority = fair * weights.fairshare + age * weights.age - r.nice
    return Entry(request=r, priority=round(priority, 3), fairshare=round(fair, 4), age=round(age, 4))


def _servers(calendar: Calendar, r: Request, draining: set[int]) -> list[int]:
    """The servers the job may start on (`_may_use`), in the calendar's order."""
    if r.server_id is not None:
        return (
            [r.server_id] if r.server_id in calendar.by_server and _may_use(r, r.server_id, draining) else []
        )
    return [s for s in calendar.by_server if _may_use(r, s, draining)]


def _may_use(r: Request, server: int, draining: set[int]) -> bool:
    """The one it asked for, else any not draining; for a job in an image, only those of `r.servers`."""
    chosen = server == r.server_id if r.server_id is not None else server not in draining
    return chosen and (r.servers is None or server in r.servers)


def _fit_now(calendar: Calendar, r: Request, draining: set[int], *, shadows: bool = True) -> list[str]:
    """`gpu_count` cards of the first server where they are free for the job from now, or []."""
    end = calendar.now + r.booked
    for server, room in calendar.roomy(r.memory_mb):  # most of a full cluster has no room: not asked
        if room < r.gpu_count or not _may_use(r, server, draining):
            continue
        free = calendar.free_cards(server, calendar.now, end, r.memory_mb, shadows=shadows, need=r.gpu_count)
        if len(free) >= r.gpu_count:
            return free
    return []


def _note(calendar: Calendar, r: Request, draining: set[int], silences: dict[tuple, str]) -> str:
    """Why a job that does not start waits, in words beyond its reason: no server that has its
    image can run it now, or silent workers where it would fit (`_silence`); else ""."""
    if r.servers is not None and not _servers(calendar, r, draining):
        return NO_IMAGE_SERVER
    return _silence(calendar, r, draining, silences) if calendar.silent else ""


def _silence(calendar: Calendar, r: Request, draining: set[int], cache: dict[tuple, str]) -> str:
    """The words of the silent servers where the job would fit now but for their worker, or "".
    Worked out once per shape and set of servers it may use, while the silent servers' cards stay
    as they are; a server whose cards cannot take it now is passed over without reading a booking."""
    key = (r.gpu_count, r.memory_mb, r.minutes, r.server_id, r.servers, calendar.silent_version)
    if key not in cache:
        end = calendar.now + r.booked

        def fits(server: int, room: int) -> bool:
            if room < r.gpu_count or not _may_use(r, server, draining):
                return False
            free = calendar.free_cards(server, calendar.now, end, r.memory_mb, need=r.gpu_count)
            return len(free) >= r.gpu_count

        roomy = calendar.roomy(r.memory_mb, silent=True)
        cache[key] = "; ".join(sorted(calendar.silent[s] for s, room in roomy if fits(s, room)))
    return cache[key]


def _estimate(
    calendar: Calendar, r: Request, draining: set[int], cache: dict[tuple, datetime | None]
) -> tuple[datetime | None, int | None]:
    """The earliest start over the servers the job may use, and where (shadows included): among
    equal starts, the first server in the servers' order. The servers are tried from the soonest
    what their cards hold now lets them take it (`Calendar.soonest`, a lower bound of their
    earliest start), so the search stops at the first that cannot beat the best found."""
    best: tuple[datetime, int, int] | None = None  # (start, place in the servers' order, server)
    for bound, place, server in calendar.soonest(r.gpu_count, r.memory_mb):
        if best is not None and (bound, place) > best[:2]:
            if bound > best[0]:
                break
            continue  # it could only tie, behind the best in the servers' order
        if not _may_use(r, server, draining):
            continue
        key = (server, calendar.version[server], r.gpu_count, r.memory_mb, r.minutes)
        if key not in cache:
            cache[key] = calendar.earliest(server, r.gpu_count, r.booked, r.memory_mb, calendar.now)
        at = cache[key]
        if at is not None and (best is None or (at, place) < best[:2]):
            best = (at, place, server)
    return (best[0], best[2]) if best else (None, None)
