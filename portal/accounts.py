"""Portal users behind OS accounts: how the GPU watchdog names the person running a process."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser

from portal.models import Profile

# JOB_USER's value for "each job runs as its owner's Unix account".
JOB_USER_OWNER = "@owner"


def unix_account_name(user: AbstractBaseUser) -> str | None:
    """The person's login name on the GPU hosts: their profile's Unix account (from the directory
    or set by admins), else their portal username, unless that name is someone else's Unix
    account: None then, so that nothing runs as, or is blamed on, the wrong person."""
    try:
        own = user.profile.unix_account
    except Profile.DoesNotExist:
        own = None
    if own:
        return own
    username = user.get_username()
    return None if Profile.objects.filter(unix_account=username).exists() else username


def users_by_unix_name(names: Iterable[str]) -> dict[str, int]:
    """{OS user name: portal user id} for the names that belong to someone: a user's Unix account
    (set by admins on their profile), else a portal username, for users without a Unix account
    of their own (the OS user "bob" is not the portal's bob when bob logs in as "rsmith")."""
    wanted = {name for name in names if name and name != "?"}
    if not wanted:
        return {}
    found = dict(Profile.objects.filter(unix_account__in=wanted).values_list("unix_account", "user_id"))
    by_username = (
        get_user_model()
        .objects.filter(username__in=wanted - set(found))
        .exclude(profile__unix_account__isnull=False)
        .values_list("username", "pk")
    )
    return {**dict(by_username), **found}
