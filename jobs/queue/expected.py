"""What the Queue page, GET /api/v1/queue/ and `gpu queue` show of a waiting job's start: the plan
made over *expected* ends rather than booked ones (`expected_ends`), and loans (jobs/lending.py).

The scheduler's own passes book with time limits, so a wide job's shadow never moves earlier on a
guess (conservative backfill stays conservative). Only the shown estimate uses what the jobs ahead
are expected to take: a running queued job ends, as far as anyone can tell, after its owner's
typical run of that script (jobs.rightsizing.typical_minutes), else at its time limit; one already
past its typical time ends "any minute now". Each estimate says its basis (`Entry.basis`):

- `begin_time`: it asked not to start before then (`--begin`);
- `lending`: a preemptible job that fits on an idle booking lent to the queue: the next pass;
- `plan`: the calendar: bookings, the running jobs' expected ends, and the jobs ahead's shadows
  (each for its expected run, `expected_requests`; a job's own start still needs room for its
  whole time limit, as the scheduler books it);
- empty, with no estimate: beyond QUEUE_BACKFILL_DEPTH, or no server it may use takes work now.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from jobs.lending import loans_preview
from jobs.models import Job
from jobs.queue.rules import START_SLACK, Entry, Request
from jobs.rightsizing import typical_minutes


def expected_ends(now: datetime) -> dict[int, datetime]:
    """Booking id → when the queued job on it is expected to end, for jobs expected to end before
    their booking does. Never before now + START_SLACK: a job still running holds its cards now."""
    rows = list(
        Job.objects.filter(
            status__in=(Job.Status.QUEUED, Job.Status.STARTING, Job.Status.RUNNING),
            reservation__isnull=False,
            queued=True,  # a job in someone's own booking is theirs to plan, and ends with it
        ).values_list("reservation_id", "owner_id", "name", "started_at", "reservation__end")
    )
    typical = typical_minutes({(owner, name) for _, owner, name, _, _ in rows})
    ends = {}
    for booking, owner, name, started, end in rows:
        minutes = typical.get((owner, name))
        if minutes is None:
            continue
        expected = max((started or now) + timedelta(minutes=minutes), now + START_SLACK)
        if expected < end:
            ends[booking] = expected
    return ends


def expected_requests(requests: Sequence[Request]) -> list[Request]:
    """The pending jobs, each with how long it is expected to run (its owner's typical run of its
    script) where that is known: the jobs after it count on its cards from then. Two reads."""
    names = dict(Job.objects.filter(pk__in=[r.job_id for r in requests]).values_list("pk", "name"))
    typical = typical_minutes({(r.user_id, names[r.job_id]) for r in requests if r.job_id in names})
    return [
        r._replace(expected_minutes=minutes)
        if (minutes := typical.get((r.user_id, names.get(r.job_id, "")))) is not None
        else r
        for r in requests
    ]


def with_lending(
    entries: Sequence[Entry], now: datetime, *, slots: dict[int, int], arrays: dict[int, int]
) -> None:
    """A preemptible job that the next pass would place on a lent booking starts then (`slots`:
    the servers' free job slots, as the plan read them; `arrays`: each array's room before the
    plan's own starts, which take theirs here)."""
    room = dict(arrays)
    for entry in entries:
        if entry.start_now and entry.request.array_id is not None:
            room[entry.request.array_id] = room.get(entry.request.array_id, 1) - 1
    for job in loans_preview(entries, now, slots=slots, arrays=room):
        entry = next(e for e in entries if e.request.job_id == job)
        entry.estimated_start, entry.basis = now, "lending"
