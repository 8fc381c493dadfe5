"""Fair share as it will be, for the shown plan's order (jobs/queue/expected.py; never a pass's).

A pass orders the waiting jobs by today's priority, and that is the rule: each pass starts what
today's order says. But a job that waits hours is started by a later pass, which orders by *its*
priorities, and fair share turns meanwhile: whoever's work runs uses GPU-hours and loses priority
as it runs. A plan that keeps today's order for the whole horizon shows the member whose three
jobs sit on top all three starting first, when after the first one starts a colleague who has
used less goes ahead of the other two. So the Queue page's plan walks the jobs in the order the
later passes will take them: the next job is the one with the highest priority *at the moment the
plan has reached*, with the usage everyone will have by then (`UsageForecast`): their decayed usage
today, the live bookings' cards (a running queued job's until its expected end) and the jobs the
plan has placed so far (from their start, for their expected run), each charged by the charge
rule (gpus.models.GPU.charged_share). Nothing else changes: the priorities shown are today's, and
the scheduler's passes order by them.

Usage decays with FAIRSHARE_HALF_LIFE_DAYS. The factors compare each usage with the total, so
every usage may be scaled alike: here all are kept in today's units (an hour used later weighs
2^(its delay / half-life)), and nothing needs decaying as the plan's moment moves on.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta

from gpus.models import GPU
from jobs.queue.calendar import Calendar
from jobs.queue.rules import Entry, Request, Shares, Usage, Weights, age_factor, fairshare_factors

Key = tuple[int, int]  # (team id, user id)
# A stream of use: [start, end), the GPUs it charges (cards × each card's charged share), whose.
Stream = tuple[datetime, datetime, float, int, int]


class UsageForecast:
    """The teams' and members' usage at a moment from now on (`at`), from today's and the streams
    of use known or planned (see the module's text). The moment only moves forward."""

    def __init__(
        self,
        shares: Shares,
        usage: Usage,
        now: datetime,
        half_life: timedelta,
        streams: Sequence[Stream] = (),
    ) -> None:
        self.shares, self.now = shares, now
        self.h = half_life.total_seconds()
        self.moment = now
        self.version = 0  # bumped whenever the usage at the moment changes
        # Per key (a team id, or a (team, user) pair): usage up to `mark`, and the GPUs it uses since.
        self.used: dict[object, float] = defaultdict(float, {**usage.team, **usage.member})
        self.rate: dict[object, float] = defaultdict(float)
        self.mark: dict[object, float] = defaultdict(float)
        self.teams = set(usage.team)
        self.members = set(usage.member)
        self.changes: list[tuple[datetime, int, object, float]] = []  # (when, order, key, GPUs ±)
        self.seq = 0
        self.frozen = False
        for start, end, gpus, team, user in streams:
            self.add(start, end, gpus, team, user)

    def _weight(self, at: datetime) -> float:
        """Hours used from now until `at`, one GPU, in today's units (∫ 2^(t/h) dt)."""
        return self.h / math.log(2) * (2.0 ** ((at - self.now).total_seconds() / self.h)) / 3600

    def _rate_change(self, key: object, at: datetime, gpus: float) -> None:
        weight = self._weight(at)
        self.used[key] += self.rate[key] * (weight - self.mark[key])
        self.mark[key] = weight
        self.rate[key] += gpus

    def add(self, start: datetime, end: datetime, gpus: float, team: int, user: int) -> None:
        """A stream of use: a booking's cards, or a job the plan placed."""
        start = max(start, self.now)
        if end <= start or gpus <= 0:
            return
        self.teams.add(team)
        self.members.add((team, user))
        for key in (team, (team, user)):
            if start <= self.moment:  # already under way at the moment: it counts at once
                self.used[key] += gpus * (self._weight(min(end, self.moment)) - self._weight(start))
                if end > self.moment:
                    self._rate_change(key, self.moment, gpus)
                    heapq.heappush(self.changes, (end, self._next(), key, -gpus))
                self.version += 1
            else:
                heapq.heappush(self.changes, (start, self._next(), key, gpus))
                heapq.heappush(self.changes, (end, self._next(), key, -gpus))

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def move_to(self, at: datetime) -> None:
        """The plan has reached `at` (never back)."""
        if at <= self.moment:
            return
        while self.changes and self.changes[0][0] <= at:
            when, _, key, gpus = heapq.heappop(self.changes)
            self._rate_change(key, when, gpus)
        self.moment = at
        self.version += 1

    def usage(self) -> Usage:
        """Everyone's usage at the moment, in today's units."""
        weight = self._weight(self.moment)

        def now_of(key: object) -> float:
            return self.used[key] + self.rate[key] * (weight - self.mark[key])

        return Usage(team={t: now_of(t) for t in self.teams}, member={m: now_of(m) for m in self.members})

    def placed(
        self, r: Request, start: datetime, end: datetime, calendar: Calendar, uuids: Sequence[str]
    ) -> None:
        """A job the plan placed on these cards from `start` until `end` (its expected run): its
        owner uses them meanwhile, each card charged by the charge rule (over the card's bookable
        memory, which the calendar knows, for its total)."""
        gpus = sum(GPU.charged_share(r.memory_mb, calendar.cards[uuid].bookable_mb) for uuid in uuids)
        self.add(start, end, gpus, r.team_id, r.user_id)

    def freeze(self) -> None:
        """The plan's estimates are made: the jobs left follow in one order, as of the moment."""
        self.frozen = True

    def order(self, entries: Sequence[Entry], weights: Weights) -> Iterator[Entry]:
        """The entries in the order the passes to come will take them: each next one the highest
        priority at the forecast's moment, today's order among equals and among one member's own
        jobs. The plan moves the forecast on and tells it each job it places as it walks; once it
        freezes the forecast, the rest follow in one order, as of then."""
        queues: dict[Key, deque[Entry]] = defaultdict(deque)
        place = {e.request.job_id: i for i, e in enumerate(entries)}
        for entry in entries:  # today's order, so each member's own jobs stay in it
            queues[(entry.request.team_id, entry.request.user_id)].append(entry)

        def rank(entry: Entry, factors: dict[Key, float]) -> tuple[float, int]:
            r = entry.request
            fair = factors[(r.team_id, r.user_id)]
            age = age_factor(r.submitted_at, self.moment, weights)
            return round(fair * weights.fairshare + age * weights.age - r.nice, 3), -place[r.job_id]

        factors: dict[Key, float] = {}
        seen = -1
        left = len(entries)
        while left and not self.frozen:
            if seen != self.version:
                factors = fairshare_factors(queues.keys(), self.shares, self.usage())
                seen = self.version
            key = max((k for k, q in queues.items() if q), key=lambda k: rank(queues[k][0], factors))
            left -= 1
            yield queues[key].popleft()
        factors = fairshare_factors(queues.keys(), self.shares, self.usage())
        yield from sorted(
            (e for q in queues.values() for e in q), key=lambda e: rank(e, factors), reverse=True
        )
