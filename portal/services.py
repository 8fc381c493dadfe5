from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from rest_framework.authtoken.models import Token

from portal.access import can_manage_team, is_admin
from portal.errors import Forbidden, Invalid
from portal.models import AuditEntry, Membership, QuotaFields, Team

User = get_user_model()


@transaction.atomic
def api_token_regenerate(*, user: AbstractBaseUser) -> Token:
    Token.objects.filter(user=user).delete()
    return Token.objects.create(user=user)


@transaction.atomic
def demo_data_seed(*, password: str) -> bool:
    """Create the demo team and users on an empty database; a no-op when any user exists."""
    if User.objects.exists():
        return False
    User.objects.create_superuser("admin", "admin@example.org", password)
    # Demo quotas, so the limits can be tried: the team may hold 8 cards / 256 GB at once and
    # 400 GPU-hours a week; bob, a student, at most 2 cards and 24 h per booking.
    team = Team.objects.create(
        name="Vision Lab", slug="vision-lab", max_cards=8, max_gb=256, gpu_hours_per_week=400
    )
    for username, role, limits in (
        ("leader", Membership.Role.LEADER, {}),
        ("alice", Membership.Role.MEMBER, {}),
        ("bob", Membership.Role.MEMBER, {"max_cards": 2, "max_booking_hours": 24}),
    ):
        user = User.objects.create_user(username, f"{username}@example.org", password)
        Membership.objects.create(team=team, user=user, role=role, **limits)
    return True


QUOTA_MAX = 1_000_000  # any larger limit means "no limit"; keeps values inside the integer column
QUOTA_FIELDS = ("max_cards", "max_gb", "gpu_hours_per_week")
QUOTA_LABELS = {
    "max_cards": "cards at once",
    "max_gb": "GB at once",
    "gpu_hours_per_week": "GPU-hours per week",
    "max_booking_hours": "longest booking (h)",
}


def _quota_changes(
    target: QuotaFields, limits: dict[str, int | None], fields: tuple[str, ...]
) -> dict[str, list]:
    unknown = sorted(set(limits) - set(fields))
    if unknown:
        raise Invalid(
            f"{unknown[0]} is not a quota setting; use one of {', '.join(fields)}.", field=unknown[0]
        )
    for field, value in limits.items():
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
    """Set a team's limits (admins only). None means no limit. Logged in the audit log."""
    if not is_admin(actor):
        raise Forbidden("Only admins set team quotas; ask one.")
    team = Team.objects.select_for_update().get(pk=team.pk)
    changes = _quota_changes(team, limits, QUOTA_FIELDS)
    _save_quota(actor, team, team, changes, AuditEntry.Action.QUOTA_TEAM, f"team {team.slug}", "the quota of")
    return team


@transaction.atomic
def quota_member_set(*, actor: AbstractBaseUser, membership: Membership, **limits: int | None) -> Membership:
    """Set a member's limits (the team's leaders and admins), each within the team's own."""
    if not can_manage_team(actor, membership.team_id):
        raise Forbidden(f"Only leaders of {membership.team} and admins set its members' quotas.")
    membership = Membership.objects.select_for_update().select_related("team", "user").get(pk=membership.pk)
    changes = _quota_changes(membership, limits, (*QUOTA_FIELDS, "max_booking_hours"))
    team = membership.team
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
