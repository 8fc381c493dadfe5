"""Whose word a Unix account is taken on (docs/identity.md, "Unix accounts"): a directory trusted
for it (LDAP_UNIX_ACCOUNT_TRUSTED, OIDC_UNIX_ACCOUNT_TRUSTED) sets it; any other only claims one,
which the worker and the watchdog ignore until an admin confirms it. A sign-in never takes an
account, nor does a username a person chose at their provider stand in for one.

The sign-ins themselves run against slapd and the OIDC provider in tests/test_ldap.py and
tests/test_oidc.py; here are the rules, the worker's and the watchdog's use of them, and the
admin's confirm step.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from jobs.host.launch import JobSetupError, _job_account
from jobs.models import Job
from portal.accounts import unix_account_name, users_by_unix_name
from portal.errors import Invalid
from portal.identity import identity_sync, unix_account_claim_confirm
from portal.models import AuditEntry, ExternalAccount, Profile
from tests.conftest import ROOT
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
User = get_user_model()


def linked(username: str, source: str = "oidc", **profile: str):  # type: ignore[no-untyped-def]
    """A user a directory sign-in created: no usable password, bound to `source`."""
    user = UserFactory(username=username)
    user.set_unusable_password()
    user.save()
    ExternalAccount.objects.create(
        user=user, source=source, issuer="https://sso.lab.example", subject=username
    )
    if profile:
        Profile.objects.create(user=user, **profile)
    return user


def claim(user) -> str | None:  # type: ignore[no-untyped-def]
    return Profile.objects.get(user=user).unix_account_claim


def own(user) -> str | None:  # type: ignore[no-untyped-def]
    return Profile.objects.get(user=user).unix_account


def audited() -> list[str]:
    return list(AuditEntry.objects.order_by("pk").values_list("message", flat=True))


@pytest.fixture(autouse=True)
def _defaults(settings) -> None:
    settings.LDAP_UNIX_ACCOUNT_TRUSTED = True
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = False


# --- The defaults ---------------------------------------------------------------------------


def test_ldap_is_trusted_and_single_sign_on_is_not_by_default():
    env = {k: v for k, v in os.environ.items() if not k.endswith("_UNIX_ACCOUNT_TRUSTED")}
    code = "import portal.settings as s; print(s.LDAP_UNIX_ACCOUNT_TRUSTED, s.OIDC_UNIX_ACCOUNT_TRUSTED)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["True", "False"], done.stderr


# --- A claim from a source not trusted for it -------------------------------------------------


def test_an_untrusted_claim_never_takes_the_account_of_someone_not_in_the_portal(caplog):
    """bob has a host account but has not signed in yet: mallory's editable claim must not make
    her jobs run as him, nor his processes hers."""
    mallory = linked("mallory")
    with caplog.at_level(logging.INFO, logger="portal.identity"):
        identity_sync(user=mallory, groups=None, unix_account="bob", source="oidc")

    assert own(mallory) is None
    assert claim(mallory) == "bob"
    assert unix_account_name(mallory) is None
    assert users_by_unix_name(["bob", "mallory"]) == {}
    assert audited() == [
        "mallory claims the Unix account bob, awaiting an admin to confirm it (single sign-on)"
    ]


def test_a_claim_is_held_once_and_a_new_one_replaces_it():
    mallory = linked("mallory")
    for _ in range(2):
        identity_sync(user=mallory, groups=None, unix_account="bob", source="oidc")
    assert len(audited()) == 1
    identity_sync(user=mallory, groups=None, unix_account="mjones", source="oidc")
    assert claim(mallory) == "mjones"
    assert len(audited()) == 2


def test_a_claim_on_someone_elses_account_is_refused_not_held():
    carol = UserFactory(username="carol")  # a local account: her username is her Unix account
    mallory = linked("mallory")
    identity_sync(user=mallory, groups=None, unix_account="carol", source="oidc")
    assert claim(mallory) is None
    assert "mallory was not given the Unix account carol: it is carol's" in audited()[0]
    assert users_by_unix_name(["carol"]) == {"carol": carol.pk}


def test_an_untrusted_claim_leaves_the_account_an_admin_gave():
    erin = linked("erin", unix_account="ewalker")
    identity_sync(user=erin, groups=None, unix_account="erin2", source="oidc")
    assert (own(erin), claim(erin)) == ("ewalker", "erin2")
    assert unix_account_name(erin) == "ewalker"

    # The provider now says what she has: the claim is moot.
    identity_sync(user=erin, groups=None, unix_account="ewalker", source="oidc")
    assert (own(erin), claim(erin)) == ("ewalker", None)
    assert audited()[-1] == "erin no longer claims the Unix account erin2 (single sign-on)"


def test_a_trusted_directory_sets_the_account_and_settles_the_same_claim(settings):
    erin = linked("erin", unix_account_claim="erin")
    identity_sync(user=erin, groups=None, unix_account="erin", source="ldap")
    assert (own(erin), claim(erin)) == ("erin", None)

    settings.OIDC_UNIX_ACCOUNT_TRUSTED = True
    identity_sync(user=erin, groups=None, unix_account="ewalker", source="oidc")
    assert own(erin) == "ewalker"


def test_an_untrusted_ldap_attribute_is_only_a_claim(settings):
    settings.LDAP_UNIX_ACCOUNT_TRUSTED = False
    dave = linked("dave", source="ldap")
    identity_sync(user=dave, groups=None, unix_account="dave", source="ldap")
    assert (Profile.objects.get(user=dave).unix_account, claim(dave)) == (None, "dave")
    assert unix_account_name(dave) is None


# --- A username from a source not trusted for it ----------------------------------------------


def test_a_username_a_provider_gave_stands_in_for_no_unix_account():
    """mallory picked preferred_username "bob" at the provider: the portal's "bob" is hers."""
    bob = linked("bob")
    assert unix_account_name(bob) is None
    assert users_by_unix_name(["bob"]) == {}


def test_without_a_unix_account_the_username_is_held_as_the_claim():
    bob = linked("bob")
    identity_sync(user=bob, groups=None, unix_account=None, source="oidc")
    assert claim(bob) == "bob"
    assert audited() == [
        "bob claims the Unix account bob by their username, awaiting an admin to confirm it (single sign-on)"
    ]
    identity_sync(user=bob, groups=None, unix_account=None, source="oidc")
    assert len(audited()) == 1


def test_the_username_is_no_claim_for_someone_with_a_unix_account():
    erin = linked("erin", unix_account="ewalker")
    identity_sync(user=erin, groups=None, unix_account=None, source="oidc")
    assert claim(erin) is None and not audited()


@pytest.mark.parametrize(
    ("source", "ldap_trusted", "oidc_trusted", "stands_in"),
    [
        (None, False, False, True),  # a local account: admins chose the name
        ("ldap", True, False, True),
        ("ldap", False, False, False),
        ("oidc", True, False, False),
        ("oidc", True, True, True),
    ],
)
def test_the_worker_and_the_watchdog_share_one_rule(settings, source, ldap_trusted, oidc_trusted, stands_in):
    settings.LDAP_UNIX_ACCOUNT_TRUSTED, settings.OIDC_UNIX_ACCOUNT_TRUSTED = ldap_trusted, oidc_trusted
    user = linked("frank", source) if source else UserFactory(username="frank")
    assert unix_account_name(user) == ("frank" if stands_in else None)
    assert users_by_unix_name(["frank"]) == ({"frank": user.pk} if stands_in else {})


def test_a_user_also_bound_to_an_untrusted_directory_has_no_username_to_stand_in():
    frank = linked("frank", "ldap")
    ExternalAccount.objects.create(user=frank, source="oidc", issuer="https://sso", subject="f")
    assert unix_account_name(frank) is None
    assert users_by_unix_name(["frank"]) == {}


def test_the_worker_runs_no_job_as_a_claimed_account(settings):
    settings.JOB_USER = "@owner"
    mallory = linked("mallory", unix_account_claim="nobody")
    with pytest.raises(JobSetupError):
        _job_account(Job(owner=mallory))
    nobody = linked("nobody")  # named like a host account, by the provider
    with pytest.raises(JobSetupError):
        _job_account(Job(owner=nobody))


# --- The admin confirms -------------------------------------------------------------------------


def test_an_admin_confirms_a_claim(admin_user, settings):
    settings.JOB_USER = "@owner"
    mallory = linked("mallory", unix_account_claim="nobody")
    assert unix_account_claim_confirm(user=mallory, by=admin_user) == "nobody"
    assert (own(mallory), claim(mallory)) == ("nobody", None)
    assert _job_account(Job(owner=User.objects.get(pk=mallory.pk))).pw_name == "nobody"
    assert users_by_unix_name(["nobody"]) == {"nobody": mallory.pk}
    entry = AuditEntry.objects.get()
    assert entry.actor == admin_user and entry.target == "user mallory"
    assert entry.message == "admin confirmed mallory's claimed Unix account nobody, was none"


def test_confirming_never_takes_an_account_someone_has(admin_user):
    UserFactory(username="carol")
    mallory = linked("mallory", unix_account_claim="carol")
    with pytest.raises(Invalid, match="which is carol's"):
        unix_account_claim_confirm(user=mallory, by=admin_user)
    with pytest.raises(Invalid, match="claims no Unix account"):
        unix_account_claim_confirm(user=linked("erin"), by=admin_user)
    assert claim(mallory) == "carol" and own(mallory) is None


def test_the_user_admin_shows_claims_and_confirms_them(client, admin_user):
    mallory = linked("mallory", unix_account_claim="mjones")
    linked("erin", unix_account="ewalker")
    client.force_login(admin_user)
    changelist = reverse("admin:auth_user_changelist")

    page = client.get(changelist, {"profile__unix_account_claim__isempty": "0"}).content.decode()
    assert "mjones" in page and "Confirm claimed Unix account" in page
    assert "By unix account claim" in page
    assert ">erin<" not in page
    assert "mjones" in client.get(reverse("admin:auth_user_change", args=[mallory.pk])).content.decode()

    action = {"action": "confirm_unix_account_claim", "_selected_action": [mallory.pk]}
    response = client.post(changelist, action, follow=True)
    assert "Confirmed: mallory&#x27;s Unix account is now mjones." in response.content.decode()
    assert (own(mallory), claim(mallory)) == ("mjones", None)
    assert AuditEntry.objects.get().actor == admin_user


def test_giving_the_claimed_account_by_hand_settles_the_claim(client, admin_user):
    mallory = linked("mallory", unix_account_claim="mjones")
    client.force_login(admin_user)
    url = reverse("admin:auth_user_change", args=[mallory.pk])
    form = {
        "username": "mallory",
        "date_joined_0": "2026-01-01",
        "date_joined_1": "00:00:00",
        "is_active": "on",
        "profile-TOTAL_FORMS": "1",
        "profile-INITIAL_FORMS": "1",
        "profile-0-user": str(mallory.pk),
        "profile-0-unix_account": "mjones",
        "external_accounts-TOTAL_FORMS": "1",
        "external_accounts-INITIAL_FORMS": "1",
        "external_accounts-0-id": str(ExternalAccount.objects.get(user=mallory).pk),
        "external_accounts-0-user": str(mallory.pk),
        "external_accounts-0-source": "oidc",
        "external_accounts-0-issuer": "https://sso.lab.example",
        "external_accounts-0-subject": "mallory",
    }
    response = client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert (own(mallory), claim(mallory)) == ("mjones", None)
