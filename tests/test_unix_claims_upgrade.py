"""Upgrading to trusted sources for Unix accounts (docs/identity.md, "Upgrading"): migration 0013
holds for an admin what a source not trusted for them gave before the trust settings existed, a
Unix account a sign-in set and the username of a user a sign-in made before ExternalAccount, and
leaves what admins set alone. Built with the models as they were at 0012."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model

from portal.accounts import unix_account_name, users_by_unix_name
from portal.models import AuditEntry, Profile
from tests.migrating import fresh_database, leaves, migrate, migrated_template, models_at

pytestmark = pytest.mark.django_db(transaction=True)
User = get_user_model()

BEFORE = ("portal", "0012_audit_job_cancel")
AFTER = ("portal", "0013_hold_untrusted_unix_accounts")


class Old:
    """The rows as a sign-in and admins left them before the upgrade, written as they were."""

    def __init__(self, apps) -> None:  # type: ignore[no-untyped-def]
        self.apps = apps

    def user(self, username: str, *, password: str = "!unusable", bound: tuple[str, ...] = (), **fields):  # type: ignore[no-untyped-def]
        user = self.apps.get_model("auth", "User").objects.create(
            username=username, password=password, **fields
        )
        for source in bound:
            self.apps.get_model("portal", "ExternalAccount").objects.create(
                user_id=user.pk, source=source, issuer="https://sso.lab.example", subject=username
            )
        return user

    def profile(self, user, **fields) -> None:  # type: ignore[no-untyped-def]
        self.apps.get_model("portal", "Profile").objects.create(user_id=user.pk, **fields)

    def synced(self, user, source: str, message: str, **data: object) -> None:  # type: ignore[no-untyped-def]
        """An entry as portal.identity's `_audit` wrote it."""
        self.apps.get_model("portal", "AuditEntry").objects.create(
            actor=None,
            action="identity.sync",
            target=f"user {user.username}",
            message=message,
            data={"by": "portal", "source": source, **data},
        )

    def set_by(self, user, source: str, name: str, was: str | None = None) -> None:  # type: ignore[no-untyped-def]
        self.synced(
            user,
            source,
            f"{user.username}'s Unix account is now {name}, was {was or 'none'}",
            unix_account=name,
            was=was,
        )


at_0012 = migrated_template([BEFORE])


@pytest.fixture
def old(at_0012) -> Iterator[Old]:
    """A database of its own at 0012 (tests/migrating.py: a copy of one migrated forwards from
    nothing, not the test database backwards), which the test upgrades."""
    with fresh_database(template=at_0012):
        yield Old(models_at([BEFORE]))


@pytest.fixture(autouse=True)
def _defaults(settings) -> None:
    settings.LDAP_UNIX_ACCOUNT_TRUSTED = True
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = False


def upgrade() -> None:
    """0013, and portal's migrations since (none touches these rows): the portal models below
    are today's. Only portal's: no other app's migration touches portal's rows, and the other
    apps' tables are not read here (all of them would be 90 migrations, 4 s of CPU a test)."""
    migrate(leaves("portal"))


def accounts(username: str) -> tuple[str | None, str | None]:
    # Two columns, not the model: read at 0012 as well, before later columns exist.
    found = Profile.objects.filter(user__username=username).values_list("unix_account", "unix_account_claim")
    return found.first() or (None, None)


def messages(username: str) -> list[str]:
    entries = AuditEntry.objects.filter(target=f"user {username}", data__migration=AFTER[1])
    return list(entries.values_list("message", flat=True))


def test_it_holds_a_unix_account_single_sign_on_set(old):
    alice = old.user("alice", bound=("oidc",))
    old.profile(alice, unix_account="asmith")
    old.set_by(alice, "oidc", "asmith")
    # Made by a sign-in before ExternalAccount: once the account is only claimed, the username
    # must not stand in for one either.
    hank = old.user("hank")
    old.profile(hank, unix_account="hsmith")
    old.set_by(hank, "oidc", "hsmith")
    upgrade()

    assert accounts("alice") == (None, "asmith")
    assert accounts("hank") == (None, "hsmith")
    for username in ("alice", "hank"):
        user = User.objects.get(username=username)
        assert unix_account_name(user) is None
    assert users_by_unix_name(["asmith", "alice", "hsmith", "hank"]) == {}
    assert messages("alice") == [
        "alice's Unix account asmith, set by single sign-on, which is not trusted for it now"
        " (OIDC_UNIX_ACCOUNT_TRUSTED), is only claimed, awaiting an admin to confirm it (single sign-on)"
    ]
    entry = AuditEntry.objects.get(target="user alice", data__migration=AFTER[1])
    assert entry.actor is None and entry.action == AuditEntry.Action.IDENTITY_SYNC
    assert entry.data["by"] == "portal" and entry.data["claim"] == "asmith"


def test_it_leaves_what_an_admin_or_a_trusted_directory_gave(old):
    # Typed by an admin; a refused sign-in's entry names the account they had, not one it set.
    erin = old.user("erin", bound=("oidc",))
    old.profile(erin, unix_account="ewalker")
    old.synced(
        erin,
        "oidc",
        "erin was not given the Unix account carol",
        unix_account="ewalker",
        refused="carol",
        held_by="carol",
    )
    # Single sign-on set one, an admin then typed another.
    fay = old.user("fay", bound=("oidc",))
    old.profile(fay, unix_account="fwong")
    old.set_by(fay, "oidc", "fay")
    # Single sign-on set it, then the trusted LDAP set the same after another.
    gus = old.user("gus")
    old.profile(gus, unix_account="gsmith")
    old.set_by(gus, "oidc", "gsmith")
    old.set_by(gus, "ldap", "gus", was="gsmith")
    old.set_by(gus, "ldap", "gsmith", was="gus")
    # Bound to the trusted LDAP too: its sign-ins keep the account in step.
    ida = old.user("ida", bound=("ldap", "oidc"))
    old.profile(ida, unix_account="ida2")
    old.set_by(ida, "oidc", "ida2")
    upgrade()

    assert accounts("erin") == ("ewalker", None)
    assert accounts("fay") == ("fwong", None)
    assert accounts("gus") == ("gsmith", None)
    assert accounts("ida") == ("ida2", None)
    assert not AuditEntry.objects.filter(data__migration=AFTER[1]).exists()


def test_it_holds_the_username_of_a_user_single_sign_on_made_before_external_accounts(old):
    bob = old.user("bob")
    old.synced(bob, "oidc", "bob joined Vision Lab as member: group vision", role="member", groups=["vision"])
    old.user("carol", password="md5$salt$0123")  # a local account: admins chose the name
    sam = old.user("sam", is_staff=True, is_superuser=True)
    old.synced(sam, "oidc", "sam is now an admin: group admins", admin=True, groups=["admins"])
    lee = old.user("lee")  # made by the trusted LDAP
    old.synced(lee, "ldap", "lee joined Vision Lab as member: group vision", role="member")
    old.user("nora")  # no password, no sign-in on record: an admin made it
    rex = old.user("rex", bound=("oidc",))  # bound since: the rule already covers him
    old.synced(rex, "oidc", "rex joined Vision Lab as member: group vision", role="member")
    upgrade()

    assert accounts("bob") == (None, "bob")
    assert unix_account_name(User.objects.get(username="bob")) is None
    assert messages("bob") == [
        "bob claims the Unix account bob by their username, awaiting an admin to confirm it: a single"
        " sign-on sign-in made the account before OIDC_UNIX_ACCOUNT_TRUSTED (off) (single sign-on)"
    ]
    for username in ("carol", "sam", "lee", "nora", "rex"):
        assert accounts(username) == (None, None), username
    stand_in = {name: User.objects.get(username=name).pk for name in ("carol", "sam", "lee", "nora")}
    assert users_by_unix_name(["bob", "carol", "sam", "lee", "nora", "rex"]) == stand_in


def test_an_untrusted_ldap_is_held_the_same_way(old, settings):
    settings.LDAP_UNIX_ACCOUNT_TRUSTED = False
    dave = old.user("dave")
    old.profile(dave, unix_account="dsmith")
    old.set_by(dave, "ldap", "dsmith")
    lee = old.user("lee")
    old.synced(lee, "ldap", "lee joined Vision Lab as member: group vision", role="member")
    upgrade()

    assert accounts("dave") == (None, "dsmith")
    assert accounts("lee") == (None, "lee")
    assert users_by_unix_name(["dsmith", "dave", "lee"]) == {}


def test_nothing_is_held_from_a_trusted_source_and_backwards_changes_nothing(old, settings):
    settings.OIDC_UNIX_ACCOUNT_TRUSTED = True
    alice = old.user("alice", bound=("oidc",))
    old.profile(alice, unix_account="asmith")
    old.set_by(alice, "oidc", "asmith")
    bob = old.user("bob")
    old.synced(bob, "oidc", "bob joined Vision Lab as member: group vision", role="member")
    upgrade()
    assert accounts("alice") == ("asmith", None) and accounts("bob") == (None, None)
    assert not AuditEntry.objects.filter(data__migration=AFTER[1]).exists()

    settings.OIDC_UNIX_ACCOUNT_TRUSTED = False
    migrate([BEFORE])
    upgrade()
    assert accounts("alice") == (None, "asmith") and accounts("bob") == (None, "bob")
    migrate([BEFORE])
    assert accounts("alice") == (None, "asmith") and accounts("bob") == (None, "bob")
