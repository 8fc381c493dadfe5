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
    team = Team.objects.create(name="Vision Lab", slug="vision-lab")
    for username, role in (
        ("leader", Membership.Role.LEADER),
        ("alice", Membership.Role.MEMBER),
        ("bob", Membership.Role.MEMBER),
    ):
        user = User.objects.create_user(username, f"{username}@example.org", password)
        Membership.objects.create(team=team, user=user, role=role)
    return True
