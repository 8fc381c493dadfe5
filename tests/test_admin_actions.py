"""The admin's own actions declare the permission they need (portal/admin.py): a staff member who
may only look at users or tokens neither sees them nor can run them by posting to the changelist,
as a browser's form would; a superuser can.

- Unlock sign-in: changing users (auth.change_user);
- Confirm claimed Unix account: changing users and their profiles (portal.change_profile), what
  giving the account by hand on the user's form takes;
- Revoke (API tokens): changing tokens (portal.change_apitoken).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse

from portal.models import ApiToken, AuditEntry, Profile
from portal.services import api_token_create
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

USERS = reverse("admin:auth_user_changelist")
TOKENS = reverse("admin:portal_apitoken_changelist")


def staff(*codenames: str):  # type: ignore[no-untyped-def]
    user = UserFactory(username="helpdesk", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def run(client, changelist: str, action: str, pk: int):  # type: ignore[no-untyped-def]
    """What the changelist's action form posts."""
    return client.post(changelist, {"action": action, "_selected_action": [pk], "index": 0}, follow=True)


@pytest.fixture
def mallory(db):
    """A user whose directory claims a Unix account, not yet confirmed."""
    user = UserFactory(username="mallory")
    Profile.objects.create(user=user, unix_account_claim="mjones")
    return user


def unix_account(user) -> str | None:  # type: ignore[no-untyped-def]
    return Profile.objects.get(user=user).unix_account


def test_a_staff_member_who_may_only_view_users_cannot_unlock_or_confirm(client, alice, mallory):
    client.force_login(staff("view_user", "view_profile"))
    run(client, USERS, "unlock_signin", alice.pk)
    run(client, USERS, "confirm_unix_account_claim", mallory.pk)
    assert not AuditEntry.objects.exists()
    assert unix_account(mallory) is None

    page = client.get(USERS)
    assert page.status_code == 200 and ">alice<" in page.content.decode()
    assert "Unlock sign-in" not in page.content.decode()
    assert "Confirm claimed Unix account" not in page.content.decode()


def test_changing_users_unlocks_sign_in_and_confirming_also_takes_changing_profiles(client, alice, mallory):
    client.force_login(staff("view_user", "change_user"))
    page = client.get(USERS).content.decode()
    assert "Unlock sign-in" in page and "Confirm claimed Unix account" not in page

    assert "Sign-in unlocked for 1 user(s)" in run(client, USERS, "unlock_signin", alice.pk).content.decode()
    refused = run(client, USERS, "confirm_unix_account_claim", mallory.pk).content.decode()
    assert "No action selected" in refused and unix_account(mallory) is None
    assert list(AuditEntry.objects.values_list("action", flat=True)) == [AuditEntry.Action.SIGNIN_UNLOCK]


def test_a_superuser_runs_every_users_action(client, admin_user, alice, mallory):
    client.force_login(admin_user)
    page = client.get(USERS).content.decode()
    assert "Unlock sign-in" in page and "Confirm claimed Unix account" in page
    run(client, USERS, "unlock_signin", alice.pk)
    run(client, USERS, "confirm_unix_account_claim", mallory.pk)
    assert unix_account(mallory) == "mjones"
    assert AuditEntry.objects.filter(actor=admin_user).count() == 2


@pytest.mark.parametrize(("codenames", "revokes"), [(["view_apitoken"], False), (["change_apitoken"], True)])
def test_revoking_a_token_takes_changing_tokens(client, alice, codenames, revokes):
    token, _key = api_token_create(user=alice, name="laptop", expires_at=None)
    client.force_login(staff(*codenames))
    run(client, TOKENS, "revoke", token.pk)
    assert (ApiToken.objects.get(pk=token.pk).revoked_at is not None) is revokes
    page = client.get(TOKENS).content.decode()
    assert "laptop" in page and ("Revoke the selected tokens" in page) is revokes


def test_a_superuser_revokes_a_token(client, admin_user, alice):
    token, _key = api_token_create(user=alice, name="laptop", expires_at=None)
    client.force_login(admin_user)
    assert "Revoke the selected tokens" in client.get(TOKENS).content.decode()
    run(client, TOKENS, "revoke", token.pk)
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
