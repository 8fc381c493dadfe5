"""The simulated lab week's people (bench/bench_lab_week.py): what they book and queue, and when
they use their bookings, drawn once from the seed in bench/lab_week.toml. The plan is the same
whether lending is on or off: only the portal's answers to it differ."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any


@dataclass
class Stretch:
    """The owner at work on their booking's cards from `start` to `end`, through a job on the
    booking (`by_job`) or a process started from a shell."""

    start: datetime
    end: datetime
    by_job: bool


@dataclass
class PlannedBooking:
    person: int
    booked_at: datetime  # when it is made
    start: datetime
    end: datetime
    cards: int
    no_show: bool
    stretches: list[Stretch] = field(default_factory=list)


@dataclass
class PlannedJob:
    person: int
    submit: datetime
    cards: int
    preemptible: bool
    script: str
    minutes: float  # how long the run takes, uninterrupted
    limit: int  # the time limit asked (minutes)


@dataclass
class Plan:
    bookings: list[PlannedBooking]
    jobs: list[PlannedJob]


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's: small means only, which is what a person's bookings are.
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def plan_week(params: dict[str, Any], week_start: datetime) -> Plan:
    rng = random.Random(params["seed"])
    days = params["days"]
    people = params["lab"]["people"]
    bookings = [b for person in range(people) for b in _bookings(rng, params, person, week_start, days)]
    jobs = _jobs(rng, params, people, week_start, days)
    return Plan(sorted(bookings, key=lambda b: b.booked_at), jobs)


def _bookings(
    rng: random.Random, params: dict[str, Any], person: int, week_start: datetime, days: int
) -> list[PlannedBooking]:
    p = params["bookings"]
    made = []
    for _ in range(_poisson(rng, p["per_person"])):
        day = rng.randrange(days)
        hour = rng.uniform(8, 20) if rng.random() < p["daytime_share"] else rng.uniform(0, 24)
        start = week_start + timedelta(days=day, hours=hour)
        start = start.replace(second=0, microsecond=0)
        hours = _log_uniform(rng, *p["hours"])
        end = start + timedelta(hours=hours)
        booked_at = max(week_start, start - timedelta(hours=rng.uniform(0, p["lead_hours_max"])))
        cards = 2 if rng.random() < p["two_card_share"] else 1
        no_show = rng.random() < p["no_show_share"]
        booking = PlannedBooking(person, booked_at, start, end, cards, no_show)
        if not no_show:
            booking.stretches = _stretches(rng, p, start, end)
        made.append(booking)
    return made


def _stretches(rng: random.Random, p: dict[str, Any], start: datetime, end: datetime) -> list[Stretch]:
    """Busy and idle in turn, from an arrival within `arrive_minutes_max` of the start."""
    at = start + timedelta(minutes=rng.uniform(0, p["arrive_minutes_max"]))
    stretches = []
    while at < end - timedelta(minutes=5):
        busy_end = min(end - timedelta(minutes=1), at + timedelta(hours=rng.uniform(*p["busy_hours"])))
        stretches.append(Stretch(at, busy_end, rng.random() < p["by_job_share"]))
        at = busy_end + timedelta(hours=rng.uniform(*p["idle_hours"]))
    return stretches


def _jobs(
    rng: random.Random, params: dict[str, Any], people: int, week_start: datetime, days: int
) -> list[PlannedJob]:
    q = params["queue"]
    scripts = {
        (person, s): _log_uniform(rng, *q["typical_minutes"])
        for person in range(people)
        for s in range(q["scripts_per_person"])
    }
    jobs = []
    at = week_start
    end = week_start + timedelta(days=days)
    rate = q["jobs_per_day"] / 86400  # per second
    while True:
        at += timedelta(seconds=rng.expovariate(rate))
        if at >= end:
            return jobs
        person, script = rng.randrange(people), rng.randrange(q["scripts_per_person"])
        typical = scripts[(person, script)]
        limit = math.ceil(typical * q["limit_factor"] / 30) * 30
        jobs.append(
            PlannedJob(
                person=person,
                submit=at,
                cards=2 if rng.random() < q["two_card_share"] else 1,
                preemptible=rng.random() < q["preemptible_share"],
                script=f"train{script}.py",
                minutes=typical * rng.uniform(1 - q["spread"], 1 + q["spread"]),
                limit=limit,
            )
        )
