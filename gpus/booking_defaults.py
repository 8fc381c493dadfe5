"""What a booking asks for when nothing is typed: the service's empty end (`default_length`) and
the booking form's defaults, within the person's limits in every one of their teams, so a plain
*Reserve* as rendered is never refused by the person's own quota.

The rules that judge a booking are gpus/quotas.py's; this module only reads the same limits (and,
for the weekly GPU-hours, the same use) to choose a request that passes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from gpus.models import GPU
from gpus.quotas import gpu_hours_between, weeks_touching
from portal.models import Membership


def default_length(membership: Membership | None) -> timedelta:
    """A booking's length when its end is left empty: BOOKING_DEFAULT_HOURS, or the member's
    longest booking (and the portal's) when shorter, so the default never breaks the person's own
    limit. A longest booking of 0 (no bookings at all) leaves the default: the refusal says why."""
    hours = [settings.BOOKING_DEFAULT_HOURS, settings.BOOKING_MAX_HOURS]
    if membership is not None and membership.max_booking_hours:
        hours.append(membership.max_booking_hours)
    return timedelta(hours=min(hours))


def cards_at_once(membership: Membership) -> int | None:
    """The most whole cards the member may hold at once: their own limit and the team's, the
    lower (None: no limit)."""
    limits = [v for v in (membership.max_cards, membership.team.max_cards) if v is not None]
    return min(limits, default=None)


def limits_in_words(membership: Membership) -> str:
    """What a member may book, in words, for the booking form: "4 h a booking, 1 card at once,
    256 GiB at once for the whole team". The member's own limit where set, else the team's
    (shared with teammates); a limit set by neither is left out."""
    longest = min(h for h in (membership.max_booking_hours, settings.BOOKING_MAX_HOURS) if h is not None)
    words = [f"{longest} h a booking"]
    units = (
        ("max_cards", "cards at once"),
        ("max_gb", "GiB at once"),
        ("gpu_hours_per_week", "GPU-hours per week"),
    )
    for field, unit in units:
        own = getattr(membership, field)
        limit = own if own is not None else getattr(membership.team, field)
        if limit is None:
            continue
        unit = "card at once" if unit == "cards at once" and limit == 1 else unit
        words.append(f"{limit} {unit}" + ("" if own is not None else " for the whole team"))
    return ", ".join(words)


def gib_at_once(memberships: Sequence[Membership]) -> int | None:
    """The lowest "GiB at once" of the person's own limits and their teams' (None: no limit)."""
    limits = [v for m in memberships for v in (m.max_gb, m.team.max_gb) if v is not None]
    return min(limits, default=None)


def share_within(memberships: Sequence[Membership], cards: Sequence[GPU], count: int) -> int | None:
    """The memory per card (MiB) a default booking of `count` cards asks for: None (whole cards)
    while that many whole cards of the largest of `cards` fit the GiB at once; otherwise that
    limit split among them (a whole card counts its full memory, a share only its own), at most
    what the roomiest card can take. None too when nothing would fit (a limit of 0, no card known):
    the default stays, and the refusal says why."""
    limit = gib_at_once(memberships)
    if not limit or not cards or count < 1:
        return None
    limit_mb = limit * 1024
    if count * max(g.memory_total_mb for g in cards) <= limit_mb:
        return None
    share = min(limit_mb // count, max(g.memory_bookable_mb for g in cards))
    return share if share > 0 else None


def hours_left_in_week(membership: Membership, week: datetime, following: datetime) -> float | None:
    """The GPU-hours the member may still book for this team in the week [week, following): the
    lower of their own weekly room and the team's (None: neither has a weekly limit)."""
    rooms = []
    for limits, owner_id in ((membership, membership.user_id), (membership.team, None)):
        if limits.gpu_hours_per_week is not None:
            used = gpu_hours_between(week, following, team=membership.team, owner_id=owner_id)
            rooms.append(limits.gpu_hours_per_week - used)
    return min(rooms, default=None)


def gpu_hours_an_hour(cards: Sequence[GPU], count: int, share_mb: int | None) -> float:
    """What `count` cards of `share_mb` each (None: whole) cost an hour against the weekly limit,
    on the dearest of `cards` they fit on (a share of a smaller card costs more): the charge rule
    is GPU.charged_share."""
    if share_mb is None or not cards:
        return float(count)
    fitting = [g for g in cards if g.memory_bookable_mb >= share_mb] or list(cards)
    return count * max(GPU.charged_share(share_mb, g.memory_total_mb) for g in fitting)


def length_within(memberships: Sequence[Membership], per_hour: float, now: datetime) -> timedelta:
    """The form's default length: `default_length` in every team, shortened to the GPU-hours left
    at `per_hour` in each week it reaches (a default booking on a Sunday evening also spends next
    week's hours), to the minute below (the form's precision). Left as it is when no GPU-hour is
    left this week: the refusal says why, and when the week's hours come back."""
    length = empty_end(memberships)
    if per_hour <= 0:
        return length
    end = now + length
    for week, following in weeks_touching(now, end):
        rooms = [r for m in memberships if (r := hours_left_in_week(m, week, following)) is not None]
        if not rooms:
            continue
        if min(rooms) <= 0 and week <= now:
            return length
        begins = max(now, week)
        end = min(end, begins + timedelta(hours=max(min(rooms), 0) / per_hour))
        if end < following:
            break  # the booking ends in this week: the later ones are not reached
    minutes = int((end - now).total_seconds() // 60)
    return timedelta(minutes=minutes) if minutes >= 1 else length


def empty_end(memberships: Sequence[Membership]) -> timedelta:
    """What an empty end books, in whichever of the person's teams: the shortest `default_length`."""
    return min((default_length(m) for m in memberships), default=default_length(None))


@dataclass(frozen=True)
class FormDefaults:
    """The booking form's defaults: the end `length` after the start (within the longest booking
    and the week's GPU-hours left), and `memory_mb` per card (None: whole cards) within the GiB
    at once."""

    length: timedelta
    memory_mb: int | None


def form_defaults(
    memberships: Sequence[Membership], cards: Sequence[GPU], count: int, now: datetime
) -> FormDefaults:
    """Defaults for `count` cards (the ticked ones, or any of those offered when `cards` are all
    the form offers) that fit every limit of every team of the person's."""
    if not count:
        return FormDefaults(length=empty_end(memberships), memory_mb=None)
    share = share_within(memberships, cards, count)
    return FormDefaults(
        length=length_within(memberships, gpu_hours_an_hour(cards, count, share), now), memory_mb=share
    )
