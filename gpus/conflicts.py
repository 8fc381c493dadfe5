"""What already holds a card, and why a booking does not fit: the live allocations on cards
(held_on), the sweep that finds what blocks a booking (blockers), the earliest slot that fits,
and the refusal message, built after the locked transaction has rolled back (Blocked,
explain_conflicts). The booking services (gpus/booking.py) check with these; the idle checker
and the tests read them too.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

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
    """The bookings that stop `memory_mb` (None: the whole card) fitting on `gpu` in [start, end).

    A whole card needs the card empty. Memory quotas may overlap while their sum at every
    instant stays within the card's bookable memory: a sweep, not a pairwise test, because
    three bookings can each fit pairwise and still overflow together.
    """
    overlapping = [h for h in held if h.start < end and h.end > start]
    if not overlapping or memory_mb is None:
        return overlapping
    wholes = [h for h in overlapping if h.memory_mb is None]
    if wholes:
        return wholes
    in_use = peak(((h.start, h.end, h.memory_mb or 0) for h in overlapping), start, end)
    return overlapping if in_use + memory_mb > gpu.memory_bookable_mb else []


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
        if not blockers(gpu, held, candidate, candidate + length, memory_mb):
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
