"""Quotas: what a member or a team holds at once and per week, against their limits, and
the services that set those limits. The use the pages show is read in gpus/quota_usage.py.

The limits are fields on portal's Team and Membership rows; what counts against them is
the live allocations booked here in gpus, so the rules live beside the bookings.

A whole card counts one card and its full memory; a memory quota counts its GB and,
for GPU-hours, the fraction of the card it books (GB / card total). Weeks run Monday
00:00 to Monday 00:00 in the portal's time zone (TIME_ZONE), whoever books or looks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F, Q, QuerySet, Sum, Value
from django.db.models.functions import Greatest, Least
from django.urls import reverse
from django.utils import timezone

from gpus.models import GPU, Allocation, AllocationQuerySet
from portal.access import can_manage_team, is_admin
from portal.channels import team_channels_notify
from portal.errors import Conflict, Forbidden, Invalid, QuotaExceeded
from portal.figures import figure
from portal.models import (
    AuditEntry,
    Membership,
    NotificationChannel,
    QuotaFields,
    Team,
    members_above_team,
)
from portal.teams import team_locked
from portal.timefmt import format_time

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Use:
    """One allocation's weight for quotas."""

    start: datetime
    end: datetime
    cards: int  # 1 for a whole card, 0 for a memory quota
    mb: int
    card_fraction: float  # 1.0 for a whole card, memory_mb / card total otherwise

    @classmethod
    def of(cls, start: datetime, end: datetime, memory_mb: int | None, card_total_mb: int) -> Use:
        # What a booking costs is GPU.charged_share (over the card's total), the one charge rule.
        if memory_mb is None:
            return cls(start, end, 1, card_total_mb, 1.0)
        return cls(start, end, 0, memory_mb, GPU.charged_share(memory_mb, card_total_mb))


def peak(intervals: Iterable[tuple[datetime, datetime, float]], start: datetime, end: datetime) -> float:
    """The highest sum of amounts at any instant of [start, end): a sweep over interval edges.

    Windows are half-open, so a booking ending at 10:00 and one starting at 10:00 never add up.
    """
    events: list[tuple[datetime, float]] = []
    for s, e, amount in intervals:
        s, e = max(s, start), min(e, end)
        if s < e:
            events.append((s, amount))
            events.append((e, -amount))
    events.sort()  # at equal times the negative (an end) sorts first
    current = best = 0.0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def week_start(at: datetime) -> datetime:
    """Monday 00:00 of `at`'s week in TIME_ZONE, whoever asks: a request's current zone is its
    viewer's (portal/time_zones.py), and a quota's week must not move with who books or looks."""
    zone = timezone.get_default_timezone()
    local = timezone.localtime(at, zone)
    monday = local.date() - timedelta(days=local.weekday())
    return timezone.make_aware(datetime.combine(monday, time.min), zone)


def weeks_touching(start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    weeks = []
    week = week_start(start)
    while week < end:
        following = week_start(week + timedelta(days=7, hours=12))  # survives a DST change
        weeks.append((week, following))
        week = following
    return weeks


def gpu_hours(uses: Iterable[Use], start: datetime, end: datetime) -> float:
    total = 0.0
    for use in uses:
        # Timestamps, not `end - start`: a week's ends are in TIME_ZONE, and Python subtracts two
        # times of one zone by the wall clock (a booking over a whole DST week would count 168 h,
        # not 167 or 169).
        overlap = min(use.end, end).timestamp() - max(use.start, start).timestamp()
        if overlap > 0:
            total += use.card_fraction * overlap / 3600
    return total


def _allocations(team: Team, owner_id: int | None, exclude_reservation: int | None) -> AllocationQuerySet:
    rows = Allocation.objects.filter(reservation__team=team)
    if owner_id is not None:
        rows = rows.filter(reservation__owner_id=owner_id)
    if exclude_reservation is not None:
        rows = rows.filter(~Q(reservation_id=exclude_reservation))
    return rows


def uses_between(
    start: datetime,
    end: datetime,
    *,
    team: Team,
    owner_id: int | None = None,
    exclude_reservation: int | None = None,
) -> list[Use]:
    """Live allocations of a team (or of one member in it) overlapping [start, end)."""
    rows = _allocations(team, owner_id, exclude_reservation).live_between(start, end)
    return [
        Use.of(s, e, memory_mb, total)
        for s, e, memory_mb, total in rows.values_list("start", "end", "memory_mb", "gpu__memory_total_mb")
    ]


def gpu_hours_between(
    start: datetime,
    end: datetime,
    *,
    team: Team,
    owner_id: int | None = None,
    exclude_reservation: int | None = None,
) -> float:
    """GPU-hours of a team (or member) inside [start, end), summed by the database.

    Grouped by (memory, card size), so a busy team's week is a handful of rows rather
    than every booking: this runs under the team's lock on every booking.
    """
    overlap = ExpressionWrapper(
        Least(F("end"), Value(end)) - Greatest(F("start"), Value(start)), output_field=DurationField()
    )
    rows = _allocations(team, owner_id, exclude_reservation).live_between(start, end)
    groups = rows.values("memory_mb", "gpu__memory_total_mb").annotate(held=Sum(overlap)).order_by()
    total = 0.0
    for group in groups:
        use = Use.of(start, end, group["memory_mb"], group["gpu__memory_total_mb"])
        total += use.card_fraction * group["held"].total_seconds() / 3600
    return total


def _gb(mb: float) -> str:
    return f"{mb / 1024:.1f}".removesuffix(".0")


QUOTA_FIELDS = ("max_cards", "max_gb", "gpu_hours_per_week")
# A limit's name in messages: the model's verbose name, as on the pages' forms and in /admin/
# (a refusal names the limit a person sees on the team page, never its column).
QUOTA_LABELS = {
    name: str(Membership._meta.get_field(name).verbose_name)
    for name in (*QUOTA_FIELDS, "max_booking_hours", "shares")
}


def limit_named(field: str) -> str:
    """A limit as a refusal's fix names it: 'the "GiB at once" limit'."""
    return f'"{QUOTA_LABELS[field]}" limit'


TOLERANCE = 1e-6  # GPU-hours are float sums of card fractions: a request exactly at its limit fits
# Where the queue's "could it ever fit" check places a request: centred on a Monday 00:00 far from
# any DST change, so a week's part of it is the least any booking of it could hold (half of it,
# or a whole week's worth when it is longer than two weeks).
_EVER_MONDAY = datetime(2001, 1, 15, 12, tzinfo=UTC)


@dataclass(frozen=True)
class QuotaAsk:
    """A request as the limit checks read it: the allocations it would make, in its window, and the
    names of the request's own fields, so a refusal sits beside the one its user would change.

    `held`: count what the member and team already hold in the window (a booking). False asks
    whether the request could ever be booked (the queue at submit: a job that never could would
    wait as "quota" for ever); its window is then `ever_window(length)`.
    """

    new: Sequence[Use]
    start: datetime
    end: datetime
    fields: Mapping[str, str]  # "length", "cards", "memory", "hours" → the request's field for each
    what: str = "booking"
    held: bool = True
    exclude_reservation: int | None = None
    # The longest length (h) that fits, in the request's terms; None: a booking's end.
    shorter: Callable[[float], str] | None = None

    @staticmethod
    def ever_window(length: timedelta) -> tuple[datetime, datetime]:
        start = week_start(_EVER_MONDAY) - length / 2
        return start, start + length

    def advise_shorter(self, hours: float) -> str:
        """What the user would ask for to last at most `hours`: a booking's end, a job's time limit."""
        if self.shorter is not None:
            return self.shorter(hours)
        return f"an end by {format_time(self.start + timedelta(hours=hours))}"


@dataclass(frozen=True)
class _Holder:
    """Whose limits are read (a member's or the team's), and the words a refusal says them with."""

    limits: QuotaFields
    label: str
    holder: str
    fix: str
    scope: dict[str, Any]


def _holders(membership: Membership, exclude_reservation: int | None) -> list[_Holder]:
    team = membership.team
    return [
        _Holder(
            membership,
            f"Your quota in {team}",
            "you already have",
            f"ask a leader of {team} to raise your",
            {"team": team, "owner_id": membership.user_id, "exclude_reservation": exclude_reservation},
        ),
        _Holder(
            team,
            f"The team quota of {team}",
            "the team already has",
            f"ask an admin to raise {team}'s",
            {"team": team, "owner_id": None, "exclude_reservation": exclude_reservation},
        ),
    ]


def memberships_for(user: AbstractBaseUser, team: Team | str | None) -> QuerySet[Membership]:
    """The user's membership for a booking's team (default: their first team by name) first: whose
    quota the booking counts against."""
    rows = Membership.objects.select_related("team").filter(user_id=user.pk)
    if isinstance(team, Team):
        rows = rows.filter(team_id=team.pk)
    elif team:
        rows = rows.filter(team__slug=team)
    return rows.order_by("team__name")


def membership_locked(user: AbstractBaseUser, team: Team | str | None) -> Membership:
    """The user's membership for the booking's team (default: their first team by name), locked,
    and its team's row, locked after it and attached as it stands once locked (team_locked).

    Every booking locks its team's row, limits or none: whoever changes the team's limits locks it
    too, so a booking is judged by the limits in force when it gets its turn and a teammate's
    booking after it counts it. Bookings of one team take turns (each a few milliseconds of the
    database); other teams' never wait for them. The one lock order: the member's row, then the
    team's (quota_member_set and the admin's team form take them so too)."""
    membership = memberships_for(user, team).select_for_update(of=("self",)).first()
    if membership is None:
        if team:
            raise Forbidden(
                f"You are not a member of team {team}; book for one of your own teams.", field="team"
            )
        raise Forbidden(
            "You are in no team yet, so you cannot book: ask an admin to add you to your lab's team."
        )
    # Its limits as locked, not as the query above read them (perhaps before it waited for the
    # member's lock: PostgreSQL reads again only the rows a query locks).
    membership.team = team_locked(membership.team_id)
    return membership


def _cards_refusal(who: _Holder, ask: QuotaAsk) -> str | None:
    limit = who.limits.max_cards
    need = sum(u.cards for u in ask.new)
    if limit is None or not need:
        return None
    held = 0
    if ask.held:
        existing = uses_between(ask.start, ask.end, **who.scope)
        held = int(peak(((u.start, u.end, u.cards) for u in existing), ask.start, ask.end))
    if held + need <= limit:
        return None
    use = (
        f"; {who.holder} {held} in that window, so {max(0, limit - held)} more would fit"
        if ask.held
        else f", so at most {limit} would ever fit"
    )
    return (
        f"{who.label} allows {limit} whole card(s) at once{use} and this {ask.what} asks for {need}. "
        f"Ask for fewer cards or a share of each card, or {who.fix} {limit_named('max_cards')}."
    )


def _memory_refusal(who: _Holder, ask: QuotaAsk) -> str | None:
    limit = who.limits.max_gb
    if limit is None:
        return None
    need_mb = sum(u.mb for u in ask.new)
    held_mb = 0.0
    if ask.held:
        existing = uses_between(ask.start, ask.end, **who.scope)
        held_mb = peak(((u.start, u.end, u.mb) for u in existing), ask.start, ask.end)
    if held_mb + need_mb <= limit * 1024:
        return None
    use = (
        f"; {who.holder} {_gb(held_mb)} GiB in that window, so {_gb(max(0.0, limit * 1024 - held_mb))} GiB "
        "more would fit"
        if ask.held
        else f", so at most {limit} GiB would ever fit"
    )
    return (
        f"{who.label} allows {limit} GiB of GPU memory at once{use} and this {ask.what} asks for "
        f"{_gb(need_mb)} GiB. Ask for fewer cards or less memory per card, or {who.fix} "
        f"{limit_named('max_gb')}."
    )


def _hours_refusal(who: _Holder, ask: QuotaAsk) -> str | None:
    limit = who.limits.gpu_hours_per_week
    if limit is None:
        return None
    per_hour = sum(u.card_fraction for u in ask.new) or 1.0
    for week, following in weeks_touching(ask.start, ask.end):
        need = gpu_hours(ask.new, week, following)
        if not need:
            continue
        used = gpu_hours_between(week, following, **who.scope) if ask.held else 0.0
        if used + need <= limit + TOLERANCE:
            continue
        if ask.held:
            room = max(0.0, limit - used)
            said = (
                f"{who.label} allows {limit} GPU-hours in the week of {week:%a %Y-%m-%d}; {who.holder} "
                f"{figure(used)} booked, so {figure(room)} more would fit (about {room / per_hour:.1f} h "
                f"with these cards) and this {ask.what} needs {figure(need)}."
            )
            longest = room / per_hour
        else:
            total = gpu_hours(ask.new, ask.start, ask.end)
            said = (
                f"{who.label} allows {limit} GPU-hours a week; this {ask.what} needs {figure(total)} "
                "GPU-hours, and one booking can never hold more than twice that, half in each of two weeks."
            )
            longest = 2 * limit / per_hour
        return (
            f"{said} Ask for fewer cards or {ask.advise_shorter(longest)}, or {who.fix} "
            f"{limit_named('gpu_hours_per_week')}."
        )
    return None


def has_limits(limits: QuotaFields) -> bool:
    """Whether a team or member quota sets any limit on what is held (no limit: no query needed)."""
    return any(v is not None for v in (limits.max_cards, limits.max_gb, limits.gpu_hours_per_week))


def _length_refusal(limit: int | None, ask: QuotaAsk, label: str, fix: str = "") -> str | None:
    """A booking longer than `limit` hours (None: no limit), in the one wording of a length limit."""
    length = ask.end - ask.start
    if limit is None or length <= timedelta(hours=limit):
        return None
    hours = f"{length.total_seconds() / 3600:.2f}".rstrip("0").removesuffix(".")
    return (
        f"{label} allows bookings of at most {limit} h; this {ask.what} needs {hours} h. "
        f"Ask for {ask.advise_shorter(limit)}{fix}."
    )


def length_check(ask: QuotaAsk) -> None:
    """The portal's own longest booking (BOOKING_MAX_HOURS), for bookings and the queue alike: no
    member's quota, so a plain Invalid (400) beside the request's length field. Read before any
    row is locked (a booking form shows it with the request's other problems)."""
    refusal = _length_refusal(settings.BOOKING_MAX_HOURS, ask, "The portal")
    if refusal:
        raise Invalid(refusal, field=ask.fields["length"])


def quota_check(membership: Membership, ask: QuotaAsk) -> None:
    """The one quota rule, for bookings and the queue alike: the member's longest booking, the
    member's limits and the team's, each at once (cards, memory) and per week (GPU-hours).
    Every limit the request would pass is named in one QuotaExceeded (400): each saying the limit,
    the use, what would fit and what to do, beside the request's field its user would change (its
    `errors`; `message` is the first), so a person fixes them all in one go. Nothing is raised
    when all fit. The portal's own limits (length_check) are the caller's to check first."""
    team = membership.team
    refusals: list[tuple[str | None, str]] = []
    refusal = _length_refusal(
        membership.max_booking_hours,
        ask,
        f"Your quota in {team}",
        f", or ask a leader of {team} to raise your {limit_named('max_booking_hours')}",
    )
    if refusal:
        refusals.append((ask.fields["length"], refusal))
    checks = (("cards", _cards_refusal), ("memory", _memory_refusal), ("hours", _hours_refusal))
    for who in _holders(membership, ask.exclude_reservation):
        if not has_limits(who.limits):
            continue  # no query at all for the common "no quota set" case
        for kind, check in checks:
            refusal = check(who, ask)
            if refusal:
                refusals.append((ask.fields.get(kind), refusal))
    if refusals:
        raise quota_exceeded(membership, refusals)


def this_week(now: datetime) -> tuple[datetime, datetime]:
    """The week the weekly quota counts now: [Monday 00:00, the next Monday 00:00) in TIME_ZONE."""
    return week_start(now), weeks_touching(now, now + timedelta(seconds=1))[-1][1]


# --- setting the limits ------------------------------------------------------------------

QUOTA_MAX = 1_000_000  # any larger limit means "no limit"; keeps values inside the integer column


def _quota_changes(
    target: QuotaFields, limits: dict[str, int | None], fields: tuple[str, ...]
) -> dict[str, list]:
    unknown = sorted(set(limits) - set(fields))
    if unknown:
        raise Invalid(
            f"{unknown[0]} is not a quota setting; use one of {', '.join(fields)}.", field=unknown[0]
        )
    for field, value in limits.items():
        if field == "shares" and (
            value is None or isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise Invalid("Shares must be a whole number of 1 or more (equal shares: 1 each).", field=field)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= QUOTA_MAX
        ):
            raise Invalid(
                f"{QUOTA_LABELS[field]} must be a whole number from 0 to {QUOTA_MAX:,}, "
                "or empty for no limit.",
                field=field,
            )
    return {f: [getattr(target, f), v] for f, v in limits.items() if getattr(target, f) != v}


def _describe(changes: dict[str, list]) -> str:
    def show(v: int | None) -> str:
        return "no limit" if v is None else str(v)

    return ", ".join(f"{QUOTA_LABELS[f]} {show(old)} → {show(new)}" for f, (old, new) in changes.items())


def _save_quota(
    actor: AbstractBaseUser,
    team: Team,
    holder: QuotaFields,
    changes: dict[str, list],
    action: str,
    target: str,
    what: str,
) -> None:
    """Write the changed limits and their audit entry; nothing at all when nothing changed."""
    if not changes:
        return
    for field, (_, new) in changes.items():
        setattr(holder, field, new)
    holder.save(update_fields=list(changes))
    AuditEntry.objects.create(
        actor=actor,
        team=team,
        action=action,
        target=target,
        message=f"{actor} set {what} {team}: {_describe(changes)}",
        data=changes,
    )


@transaction.atomic
def quota_team_set(*, actor: AbstractBaseUser, team: Team, **limits: int | None) -> Team:
    """Set a team's limits (admins only). None means no limit. Refused, naming them, while a member's
    own limit is above the new one. Logged in the audit log."""
    if not is_admin(actor):
        raise Forbidden("Only admins set team quotas; ask one.")
    team = team_locked(team.pk)
    changes = _quota_changes(team, limits, (*QUOTA_FIELDS, "shares"))
    # Members' quotas fit inside the team's: a lower team limit is refused while one is above it
    # (quota_member_set locks the team's row too, so neither can slip past the other).
    new = {field: limits.get(field, getattr(team, field)) for field in QUOTA_FIELDS}
    members = team.memberships.select_related("user").order_by("user__username")
    own = ((m.user.username, {f: getattr(m, f) for f in QUOTA_FIELDS}) for m in members)
    above = members_above_team(new, own)
    if above:
        field, message = next(iter(above.items()))
        raise Invalid(message, field=field, errors={f: [m] for f, m in above.items()})
    _save_quota(actor, team, team, changes, AuditEntry.Action.QUOTA_TEAM, f"team {team.slug}", "the quota of")
    return team


@transaction.atomic
def quota_member_set(*, actor: AbstractBaseUser, membership: Membership, **limits: int | None) -> Membership:
    """Set a member's limits (the team's leaders and admins), each within the team's own."""
    if not can_manage_team(actor, membership.team_id):
        raise Forbidden(f"Only leaders of {membership.team} and admins set its members' quotas.")
    locked = Membership.objects.select_for_update(of=("self",)).select_related("team", "user")
    found = locked.filter(pk=membership.pk).first()
    if found is None:  # removed from the team since the page or the API read it (another tab)
        raise Conflict(
            f"{membership.user} is no longer in {membership.team}: someone removed them just now, "
            "and their quota went with them."
        )
    membership = found
    changes = _quota_changes(membership, limits, (*QUOTA_FIELDS, "max_booking_hours", "shares"))
    team = membership.team = team_locked(membership.team_id)
    for field in QUOTA_FIELDS:
        team_limit, value = getattr(team, field), limits.get(field, getattr(membership, field))
        if team_limit is not None and value is not None and value > team_limit:
            raise Invalid(
                f"{team}'s own quota allows {team_limit} {QUOTA_LABELS[field]}; set at most {team_limit}, "
                "or leave it empty to use the team's limit.",
                field=field,
            )
    target = f"member {membership.user} of {team.slug}"
    _save_quota(
        actor,
        team,
        membership,
        changes,
        AuditEntry.Action.QUOTA_MEMBER,
        target,
        f"{membership.user}'s quota in",
    )
    return membership


# --- telling the team of a refusal -------------------------------------------------------------


def quota_exceeded(membership: Membership, refusals: Sequence[tuple[str | None, str]]) -> QuotaExceeded:
    """The refusal a booking service raises: every (field, message) the request would pass, each
    beside its field (the first is its `message`). Marked with whose quota refused it, so that
    `refusals_told` can tell the team once the refused request's transaction is rolled back."""
    errors: dict[str, list[str]] = {}
    for field, message in refusals:
        errors.setdefault(field or "", []).append(message)
    field, message = refusals[0]
    refusal = QuotaExceeded(message, field=field, errors=errors)
    refusal.refused = (membership.user_id, membership.team_id)  # type: ignore[attr-defined]
    return refusal


def refusals_told(service: Callable[..., T]) -> Callable[..., T]:
    """A booking service whose quota refusals are told to the team's chat and webhook channels
    (portal.channels), after its transaction: outside it, so the message is never rolled back
    with the refused booking. At most one per person and team every NOTIFY_MAIL_EVERY_MINUTES
    (the key), so one person retrying does not flood the channel. Not for the queue's scheduler
    (`queue_start`): its job waits for the quota, which is no refusal, and tries every pass."""

    @functools.wraps(service)
    def wrapper(**kwargs: Any) -> T:
        try:
            return service(**kwargs)
        except QuotaExceeded as refusal:
            refused = getattr(refusal, "refused", None)
            if refused is not None and not kwargs.get("queue_start"):
                _refusal_tell(*refused, " ".join(m for ms in refusal.errors.values() for m in ms))
            raise

    return wrapper


def _refusal_tell(user_id: int, team_id: int, message: str) -> None:
    try:
        team = Team.objects.get(pk=team_id)
        user = get_user_model().objects.get(pk=user_id)
        team_channels_notify(
            team=team,
            kind=NotificationChannel.QUOTA_REFUSED,
            subject=f"A booking of {user} was refused by a quota of {team}",
            body=f"{user} asked for a booking for {team}, refused: {message}",
            url=reverse("team_detail", args=[team.slug]),
            key=f"quota_refused:{user_id}:{team_id}",
        )
    except Exception:  # the refusal itself must reach the person whatever becomes of this
        log.exception("Could not tell team %s's channels of a quota refusal", team_id)
