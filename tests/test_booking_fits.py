"""One "does a booking fit this card" rule (issue 20): the booking service and the queue's plan
decide alike, so the scheduler never plans a start that booking then refuses every pass.

Each case puts the same bookings on one card (24 GiB total, 300 MiB driver-reserved, the context
headroom on top: less bookable than total), then asks both: the booking service
(`reservation_create`, in a savepoint rolled back) and the plan's calendar as the scheduler reads
it (`jobs.queue.scheduler._calendar`, `Calendar.fits`, and `could_fit_now` for windows from now).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.conflicts import fits_at_once, fits_on_card
from gpus.models import GPU
from jobs.models import Job
from jobs.queue.scheduler import _calendar, queue_plan, schedule_pass
from jobs.submit import ScriptUpload, job_submit
from portal.errors import Conflict, Invalid

H = timedelta(hours=1)
TOTAL = 24 * 1024
G = 1024


class _RolledBack(Exception):
    pass


def booking_fits(
    user, gpu: GPU, start: datetime, end: datetime, memory_mb: int | None, now: datetime
) -> bool:
    try:
        with transaction.atomic():
            reservation_create(user=user, gpus=[gpu.uuid], start=start, end=end, memory_mb=memory_mb, now=now)
            raise _RolledBack
    except _RolledBack:
        return True
    except (Conflict, Invalid):
        return False


def plan_fits(gpu: GPU, start: datetime, end: datetime, memory_mb: int | None, now: datetime) -> bool:
    calendar = _calendar(now, [gpu.server_id], now + 48 * H)
    fits = calendar.fits(gpu.uuid, start, end, memory_mb)
    if fits and start <= now < end:
        # The fast checks are upper bounds: they never rule out what fits.
        assert calendar.could_fit_now(gpu.uuid, memory_mb)
        assert calendar.room_now(gpu.server_id, memory_mb) >= 1
    return fits


def bookable(gpu: GPU) -> int:
    return gpu.memory_bookable_mb


# (holds: (from, to, MiB or None) in hours from now, or MiB as a function of the card's bookable
# memory; request: from, to, MiB) → fits
CASES = {
    "whole card on an empty card": ([], (0, 1, None), True),
    "all the bookable memory": ([], (0, 1, bookable), True),
    "one MiB over the bookable memory": ([], (0, 1, lambda g: bookable(g) + 1), False),
    "the card's total memory (more than is bookable)": ([], (1, 2, lambda g: TOTAL), False),
    "whole card right after a whole-card hold (touching)": ([(0, 1, None)], (1, 2, None), True),
    "a share right after a whole-card hold (touching)": ([(0, 1, None)], (1, 2, 4 * G), True),
    "a share right before a whole-card hold (touching)": ([(2, 3, None)], (0, 2, 4 * G), True),
    "a share across a whole-card hold": ([(0, 2, None)], (1, 3, 4 * G), False),
    "a share while a whole card is held now": ([(0, 1, None)], (0, 1, 1), False),
    "a whole card beside a share": ([(0, 1, 4 * G)], (0, 2, None), False),
    "a whole card beside a later share": ([(1, 2, 4 * G)], (0, 3, None), False),
    "shares summing to the limit, one MiB more": (
        [(0, 2, lambda g: bookable(g) // 2), (0, 2, lambda g: bookable(g) - bookable(g) // 2)],
        (1, 2, 1),
        False,
    ),
    "shares summing to the limit, after them": (
        [(0, 2, lambda g: bookable(g) // 2), (0, 2, lambda g: bookable(g) - bookable(g) // 2)],
        (2, 3, 8 * G),
        True,
    ),
    "shares up to exactly the limit": ([(0, 2, 10 * G)], (0, 2, lambda g: bookable(g) - 10 * G), True),
    "pairwise fits, together overflows": ([(0, 2, 10 * G), (1, 3, 10 * G)], (0, 3, 4 * G), False),
    "pairwise fits, together fits": ([(0, 2, 10 * G), (1, 3, 10 * G)], (0, 3, 3 * G), True),
    "shares one after the other (touching)": ([(0, 1, 20 * G), (1, 2, 20 * G)], (0, 2, 3 * G), True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_it_decides_alike_in_booking_and_in_the_plan(case, alice, bob, box):
    holds, (start_h, end_h, want), expected = CASES[case]
    gpu = box[0]
    assert bookable(gpu) < gpu.memory_total_mb  # reserved memory and headroom count
    now = timezone.now()
    for hold_start, hold_end, mb in holds:
        reservation_create(
            user=bob,
            gpus=[gpu.uuid],
            start=now + hold_start * H,
            end=now + hold_end * H,
            memory_mb=mb(gpu) if callable(mb) else mb,
            now=now,
        )
    memory_mb = want(gpu) if callable(want) else want
    start, end = now + start_h * H, now + end_h * H

    in_booking = booking_fits(alice, gpu, start, end, memory_mb, now)
    in_plan = plan_fits(gpu, start, end, memory_mb, now)

    assert in_booking == in_plan == expected


def test_the_rule_at_one_instant():
    assert fits_at_once(1000, None, [])
    assert not fits_at_once(1000, None, [1])
    assert not fits_at_once(1000, 1, [None])
    assert fits_at_once(1000, 400, [300, 300])
    assert not fits_at_once(1000, 401, [300, 300])
    assert not fits_at_once(1000, 1001, [])


def test_the_rule_over_a_window_treats_windows_as_half_open():
    t = timezone.now()
    assert fits_on_card(1000, None, [(t, t + H, None)], t + H, t + 2 * H)
    assert fits_on_card(1000, None, [(t + H, t + 2 * H, 500)], t, t + H)
    assert not fits_on_card(1000, 600, [(t, t + 2 * H, 500)], t + H, t + 3 * H)


def test_the_plan_asks_for_the_window_the_scheduler_books(alice, bob, box, sent):
    """A queued job's booking outlasts its time limit by START_SLACK: the plan must check that whole
    window, or a booking starting within the slack makes it plan a start that is refused every pass."""
    now = timezone.now()
    uuids = [g.uuid for g in box]
    later = reservation_create(
        user=bob, gpus=uuids, start=now + H + timedelta(seconds=30), end=now + 2 * H, now=now
    )
    job = job_submit(
        user=alice,
        reservation=None,
        gpu_count=1,
        time_limit_minutes=60,
        script=ScriptUpload(name="train.py", content=b"print('hi')\n"),
    )

    schedule_pass(now=now)

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING and job.pending_reason == "resources"
    assert not job.message.startswith("Waiting:")  # planned to wait, not refused by booking
    (entry,) = queue_plan(now=now)
    assert entry.estimated_start == later.end
