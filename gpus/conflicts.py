"""What already holds a card, and why a booking does not fit: the one rule of "does a request fit
this card" (fits_at_once, fits_on_card), the live allocations on cards (held_on), the queue's holds
for its waiting jobs (queue_holds_on), the checks a booking passes (check_free, fitting_cards),
what blocks it (blockers), the earliest slot that fits, and the refusal message, built after the
locked transaction has rolled back (Blocked, explain_conflicts). The booking services
(gpus/booking.py) and the queue's plan (jobs.queue.calendar.Calendar) decide with the same two functions,
so the plan never starts a job the booking service then refuses; the idle checker and the tests
read them too.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from gpus.hooks import QueueHold, queue_holds
from gpus.models import GPU, Allocation, Reservation, format_mb
from gpus.quotas import peak
from portal.access import display_name, team_ids_of
from portal.errors import Conflict
from portal.timefmt import format_time


def gpu_label(gpu: GPU) -> str:
    return f"{gpu.server.name} GPU {gpu.index} ({gpu.uuid})"


@dataclass(frozen=True)
class Held:
    """A live allocation already on a card; the owner fields only when asked for (messages)."""

    start: datetime
    end: datetime
    memory_mb: int | None
    owner_id: int | None = None
    owner_name: str = ""
    team_id: int | None = None


def queue_holds_on(uuids: Sequence[str], start: datetime, end: datetime) -> dict[str, list[QueueHold]]:
    """The queue's holds on these cards overlapping [start, end), by card UUID, earliest first. The
    jobs app answers (gpus.hooks.queue_holds); until it does, or where its store is away, no card
    is held for the queue."""
    found: dict[str, list[QueueHold]] = defaultdict(list)
    for hold in sorted(queue_holds(uuids, start, end), key=lambda h: (h.start, h.job_id)):
        if hold.gpu_uuid in uuids and hold.start < end and hold.end > start:
            found[hold.gpu_uuid].append(hold)
    return found


def queue_hold_message(gpu: GPU, hold: QueueHold, start: datetime) -> str:
    """Why a user booking may not take a card the queue keeps for a waiting job, and what to do."""
    before = (
        f"end your booking by {format_time(hold.start)}"
        if start < hold.start
        else f"start it at {format_time(hold.end)} or later"
    )
    return (
        f"{gpu_label(gpu)} is held for queued job {hold.job_id} from {format_time(hold.start)} to "
        f"{format_time(hold.end)}: the queue starts that job there then, and a booking in that window "
        f"would push it back. Pick another card, or {before}."
    )


Span = tuple[datetime, datetime, "int | None"]  # a hold on a card: [start, end), MiB (None: whole)


def fits_at_once(bookable_mb: int, memory_mb: int | None, held_mb: Iterable[int | None]) -> bool:
    """The rule at one instant: does `memory_mb` (None: the whole card) fit beside what is held
    then (each hold's MiB, None for a whole card) on a card with `bookable_mb` to share?

    A whole card needs the card empty; a whole-card hold leaves no room; memory shares fit while
    their sum stays within the bookable memory (total − driver-reserved − the context headroom,
    GPU.bookable_mb), never the card's total."""
    held = list(held_mb)
    if memory_mb is None:
        return not held
    if memory_mb > bookable_mb or any(mb is None for mb in held):
        return False
    return sum(mb or 0 for mb in held) + memory_mb <= bookable_mb


def fits_on_card(
    bookable_mb: int, memory_mb: int | None, holds: Iterable[Span], start: datetime, end: datetime
) -> bool:
    """The rule over a window: does `memory_mb` fit on the card for all of [start, end), given the
    holds on it? Windows are half-open (a hold ending at 10:00 and a window starting at 10:00 do
    not meet). Shares are summed at their peak instant: a sweep, not a pairwise test, because
    three shares can each fit pairwise and still overflow together."""
    overlapping = [(s, e, mb) for s, e, mb in holds if s < end and e > start]
    if memory_mb is None or any(mb is None for _, _, mb in overlapping):
        return fits_at_once(bookable_mb, memory_mb, [mb for _, _, mb in overlapping])
    in_use = peak(((s, e, mb or 0) for s, e, mb in overlapping), start, end)
    return fits_at_once(bookable_mb, memory_mb, [round(in_use)] if in_use else [])


def spans(held: Iterable[Held | QueueHold]) -> list[Span]:
    return [(h.start, h.end, h.memory_mb) for h in held]


def held_on(
    uuids: Sequence[str],
    start: datetime,
    end: datetime,
    *,
    exclude: int | None = None,
    owners: bool = False,
) -> dict[str, list[Held]]:
    """Live allocations on these cards overlapping [start, end), by card UUID, oldest first, in one
    query on the indexed allocation table; the owners are joined in only for messages."""
    rows = Allocation.objects.live_between(start, end).filter(gpu_id__in=uuids)
    if exclude is not None:
        rows = rows.exclude(reservation_id=exclude)
    fields = ["start", "end", "memory_mb"]
    if owners:
        fields += ["reservation__owner_id", "reservation__owner__username", "reservation__team_id"]
    held: dict[str, list[Held]] = defaultdict(list)
    for gpu_id, *values in rows.order_by("start").values_list("gpu_id", *fields):
        held[gpu_id].append(Held(*values))
    return held


def blockers(
    gpu: GPU, held: Sequence[Held], start: datetime, end: datetime, memory_mb: int | None
) -> list[Held]:
    """The bookings that stop `memory_mb` (None: the whole card) fitting on `gpu` in [start, end),
    for the refusal message: empty when it fits (`fits_on_card` decides). Against a whole-card
    hold, only those are named; else every overlapping one."""
    if fits_on_card(gpu.memory_bookable_mb, memory_mb, spans(held), start, end):
        return []
    overlapping = [h for h in held if h.start < end and h.end > start]
    wholes = [h for h in overlapping if h.memory_mb is None]
    return wholes if memory_mb is not None and wholes else overlapping


def check_free(
    gpus: Sequence[GPU],
    held: dict[str, list[Held]],
    start: datetime,
    end: datetime,
    memory_mb: int | None,
    *,
    exclude: int | None = None,
    queue_start: bool = False,
) -> None:
    """Every card free for the request (`fits_on_card`), first among the bookings `held` on them
    (else Blocked), then beside the queue's holds for its waiting jobs (else a Conflict that names
    the hold), which bind every booking but the scheduler's own starts (`queue_start`)."""
    holds = {} if queue_start else queue_holds_on([g.uuid for g in gpus], start, end)
    for gpu in gpus:
        mine = spans(held.get(gpu.uuid, []))
        if not fits_on_card(gpu.memory_bookable_mb, memory_mb, mine, start, end):
            raise Blocked(gpu, start, end, memory_mb, exclude)
        queued = holds.get(gpu.uuid, [])
        if queued and not fits_on_card(gpu.memory_bookable_mb, memory_mb, mine + spans(queued), start, end):
            raise Conflict(queue_hold_message(gpu, queued[0], start), field="gpus")


def fitting_cards(
    gpus: Sequence[GPU], start: datetime, end: datetime, memory_mb: int | None
) -> Iterator[tuple[GPU, list[Held]]]:
    """The cards where a user's booking fits, beside the bookings and the queue's holds, each with
    the bookings on it in the window (the picker weighs its load by them)."""
    uuids = [g.uuid for g in gpus]
    held = held_on(uuids, start, end)
    holds = queue_holds_on(uuids, start, end)
    for gpu in gpus:
        mine = held.get(gpu.uuid, [])
        around = spans(mine) + spans(holds.get(gpu.uuid, []))
        if fits_on_card(gpu.memory_bookable_mb, memory_mb, around, start, end):
            yield gpu, mine


def earliest_fit(
    gpu: GPU, start: datetime, end: datetime, memory_mb: int | None, *, exclude: int | None = None
) -> datetime | None:
    """The first start ≥ `start` at which a booking of the same length fits, within the horizon.

    Only a start or the end of an existing booking can be the first fitting instant.
    """
    length = end - start
    horizon = start + timedelta(days=settings.BOOKING_HORIZON_DAYS)
    held = held_on([gpu.uuid], start, horizon + length, exclude=exclude).get(gpu.uuid, [])
    for candidate in sorted({start, *(h.end for h in held if h.end > start)}):
        if candidate > horizon:
            break
        if fits_on_card(gpu.memory_bookable_mb, memory_mb, spans(held), candidate, candidate + length):
            return candidate
    return None


class Blocked(Exception):
    """A card is not free. Raised inside the locked transaction, which rolls back; the
    message (owner names, the earliest slot: two more reads) is built after, unlocked."""

    def __init__(self, gpu: GPU, start: datetime, end: datetime, memory_mb: int | None, exclude: int | None):
        super().__init__(gpu.uuid)
        self.gpu, self.start, self.end, self.memory_mb, self.exclude = gpu, start, end, memory_mb, exclude


def conflict_message(viewer: AbstractBaseUser, blocked: Blocked) -> str:
    gpu, start, end, memory_mb, exclude = (
        blocked.gpu,
        blocked.start,
        blocked.end,
        blocked.memory_mb,
        blocked.exclude,
    )
    held = held_on([gpu.uuid], start, end, exclude=exclude, owners=True).get(gpu.uuid, [])
    found = blockers(gpu, held, start, end, memory_mb)
    window = f"from {format_time(start)} to {format_time(end)}"
    if not found:
        return f"{gpu_label(gpu)} was taken {window} a moment ago and is free again now; try again."
    viewer_teams = team_ids_of(viewer)
    who = "; ".join(
        f"{display_name(viewer, viewer_teams, h.owner_id, h.owner_name, h.team_id)} holds "
        f"{'the whole card' if h.memory_mb is None else format_mb(h.memory_mb)} "
        f"from {format_time(h.start)} to {format_time(h.end)}"
        for h in found[:3]
    )
    if len(found) > 3:
        who += f"; and {len(found) - 3} more"
    want = (
        "the whole card"
        if memory_mb is None
        else f"{format_mb(memory_mb)} of its {format_mb(gpu.memory_bookable_mb)} bookable"
    )
    fit = earliest_fit(gpu, start, end, memory_mb, exclude=exclude)
    when = (
        f"The earliest a booking of the same length fits is {format_time(fit)}."
        if fit
        else f"No slot of that length is free within the next {settings.BOOKING_HORIZON_DAYS} days."
    )
    return f"{gpu_label(gpu)} is not free for {want} {window}: {who}. {when}"


def explain_conflicts(service: Callable[..., Reservation]) -> Callable[..., Reservation]:
    """A booking service's Blocked, raised inside its rolled-back transaction, as a Conflict
    that says who holds the card and when it is next free."""

    @functools.wraps(service)
    def wrapper(*, user: AbstractBaseUser, **kwargs: Any) -> Reservation:
        try:
            return service(user=user, **kwargs)
        except Blocked as blocked:
            raise Conflict(conflict_message(user, blocked), field="gpus") from None

    return wrapper
