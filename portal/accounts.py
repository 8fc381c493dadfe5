"""Portal users behind OS accounts: how the GPU watchdog names the person running a process,
and which account a job runs as (JOB_USER=@owner). One rule serves both: `users_by_unix_name`."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Exists, OuterRef, Q

from portal.models import ExternalAccount, Profile

# JOB_USER's value for "each job runs as its owner's Unix account".
JOB_USER_OWNER = "@owner"


def unix_account_trusted(source: str) -> bool:
    """Whether a directory's word is taken for a Unix account (`source`: "ldap" or "oidc"):
    LDAP_UNIX_ACCOUNT_TRUSTED, OIDC_UNIX_ACCOUNT_TRUSTED. Its value is then the person's Unix
    account, and the username of someone bound to it may stand in for one; else the value is a
    claim an admin confirms, and no such username stands in (docs/identity.md)."""
    trusted = {
        ExternalAccount.Source.LDAP: settings.LDAP_UNIX_ACCOUNT_TRUSTED,
        ExternalAccount.Source.OIDC: settings.OIDC_UNIX_ACCOUNT_TRUSTED,
    }
    return trusted[source]


def unix_account_name(user: AbstractBaseUser) -> str | None:
    """The person's login name on the GPU hosts: their profile's Unix account (from a trusted
    directory, or set or confirmed by admins), else their portal username where that stands in
    for one (`users_by_unix_name`'s rule); None otherwise, so that nothing runs as, or is blamed
    on, the wrong person."""
    own = _profile_unix_account(user)
    if own:
        return own
    username = user.get_username()
    return username if users_by_unix_name([username]).get(username) == user.pk else None


def unix_account_candidate(user: AbstractBaseUser) -> str:
    """The only name `unix_account_name` can answer for the person (their profile's Unix account,
    else their username), without asking whether a username stands in: a process run by any
    other OS user is not theirs, and that is told without the question (gpus.selectors)."""
    return _profile_unix_account(user) or user.get_username()


def _profile_unix_account(user: AbstractBaseUser) -> str | None:
    try:
        return user.profile.unix_account
    except Profile.DoesNotExist:
        return None


def users_by_unix_name(names: Iterable[str]) -> dict[str, int]:
    """{OS user name: portal user id} for the names that belong to someone: a user's Unix account
    (Profile.unix_account), else a portal username, for users without a Unix account of their own
    (the OS user "bob" is not the portal's bob when bob logs in as "rsmith").

    A username stands in only where whoever chose it may name a host account: a local account
    (admins made it), or one a trusted directory made or signs in to. A name from a directory
    people can edit (an OIDC preferred_username) would hand the first person to claim it the host
    account of someone not in the portal yet. A claimed, unconfirmed Unix account
    (Profile.unix_account_claim) never counts; for a user bound to no directory, one waiting
    stops their username standing in too: a user an untrusted sign-in made before
    ExternalAccount existed has only that claim to say so (migration 0013)."""
    wanted = {name for name in names if name and name != "?"}
    if not wanted:
        return {}
    bound = ExternalAccount.objects.filter(user=OuterRef("pk"))
    found = dict(Profile.objects.filter(unix_account__in=wanted).values_list("unix_account", "user_id"))
    by_username = (
        get_user_model()
        .objects.filter(username__in=wanted - set(found))
        .exclude(profile__unix_account__isnull=False)
        .exclude(Q(profile__unix_account_claim__isnull=False) & ~Exists(bound))
    )
    untrusted = [source for source in ExternalAccount.Source.values if not unix_account_trusted(source)]
    if untrusted:
        by_username = by_username.exclude(external_accounts__source__in=untrusted)
    return {**dict(by_username.values_list("username", "pk")), **found}
