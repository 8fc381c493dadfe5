"""Quota usage: what members and teams hold now and have booked this week, read for the pages
(the team page, "My quotas", Reports) against the limits gpus.quotas sets and enforces.

Counted with the quota rules' own weights (gpus.quotas.Use) and week (gpus.quotas.this_week),
so a figure shown here is the figure a booking is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from gpus.models import Allocation, AllocationQuerySet
from gpus.quotas import QUOTA_FIELDS, QUOTA_LABELS, Use, gpu_hours, this_week
from portal.access import is_admin
from portal.models import Membership, Team


@dataclass(frozen=True)
class MemberUse:
    cards_now: int
    gb_now: float
    gpu_hours_week: float  # booked in this week (this_week), later this week included


NO_USE = MemberUse(cards_now=0, gb_now=0.0, gpu_hours_week=0.0)
# GPU-hours to three decimals, as the usage CSV and API: a few minutes of a share are not "0.0".
HOURS_DECIMALS = 3


def _uses_this_week(rows: AllocationQuerySet, key: str, now: datetime) -> dict[int, MemberUse]:
    """Live allocations overlapping this week, grouped by `key` (a user or team id): use now and this week."""
    week, following = this_week(now)
    grouped: dict[int, list[Use]] = {}
    for group, s, e, memory_mb, total in rows.live_between(week, following).values_list(
        key, "start", "end", "memory_mb", "gpu__memory_total_mb"
    ):
        grouped.setdefault(group, []).append(Use.of(s, e, memory_mb, total))
    result = {}
    for group, uses in grouped.items():
        current = [u for u in uses if u.start <= now < u.end]
        result[group] = MemberUse(
            cards_now=sum(u.cards for u in current),
            gb_now=round(sum(u.mb for u in current) / 1024, 1),
            gpu_hours_week=round(gpu_hours(uses, week, following), HOURS_DECIMALS),
        )
    return result


def gpu_hours_booked_this_week(rows: AllocationQuerySet, now: datetime | None = None) -> float:
    """The "GPU-hours booked this week" of the bookings behind `rows`, whoever shows it: the team
    page's total (team_use_total over team_use) and the Reports page's line of that name add the
    same figures in the same way, so the same bookings read the same on both."""
    return team_use_total(
        _uses_this_week(rows, "reservation__owner_id", now or timezone.now())
    ).gpu_hours_week


def team_use(team: Team, now: datetime | None = None) -> dict[int, MemberUse]:
    """Per member (user id): cards and GB held now, and GPU-hours booked this week (the weekly quota)."""
    rows = Allocation.objects.filter(reservation__team=team)
    return _uses_this_week(rows, "reservation__owner_id", now or timezone.now())


class MemberQuota(NamedTuple):
    membership: Membership
    use: MemberUse  # the member's own, in this team
    may_manage: bool  # leads the team, or an admin: the team page is theirs to open


def member_quotas(user: AbstractBaseUser, now: datetime | None = None) -> list[MemberQuota]:
    """The user's quota in each of their teams with their own use (not the team's): "My quotas".

    Two queries however many teams and teammates: the memberships, and the user's allocations.
    """
    rows = Allocation.objects.filter(reservation__owner=user)
    use = _uses_this_week(rows, "reservation__team_id", now or timezone.now())
    admin = is_admin(user)
    return [
        MemberQuota(m, use.get(m.team_id, NO_USE), admin or m.is_leader)
        for m in Membership.objects.filter(user=user).select_related("team").order_by("team__name")
    ]


def team_use_total(use: dict[int, MemberUse]) -> MemberUse:
    """The whole team's use: the sum over everyone who booked for it (former members included)."""
    return MemberUse(
        cards_now=sum(u.cards_now for u in use.values()),
        gb_now=round(sum(u.gb_now for u in use.values()), 1),
        gpu_hours_week=round(sum(u.gpu_hours_week for u in use.values()), HOURS_DECIMALS),
    )


def over_limits(holder: Team | Membership, use: MemberUse) -> list[str]:
    """What the holder already uses above its (new) limits: "2 cards at once (limit 1)". A limit
    set below use takes nothing away; it refuses new bookings until use is under it."""
    used = {"max_cards": use.cards_now, "max_gb": use.gb_now, "gpu_hours_per_week": use.gpu_hours_week}
    over = []
    for field in QUOTA_FIELDS:
        limit = getattr(holder, field)
        if limit is not None and used[field] > limit:
            over.append(f"{used[field]:g} {QUOTA_LABELS[field]} (limit {limit:g})")
    return over
