"""Accounts and teams: API tokens and the demo data. Quota limits are set in gpus/quotas.py."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from rest_framework.authtoken.models import Token

from portal.models import Membership, Team

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
