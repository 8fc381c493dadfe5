"""Sign-in with the lab's accounts: what LDAP / Active Directory and OpenID Connect share.

Both backends (portal.ldap, portal.oidc) find the portal user of a person the directory
vouched for through `external_account_link`, by the directory's stable id for them, never by a
name; then hand their group names (an LDAP group's cn, the values of the OIDC groups claim) and
Unix account to `identity_sync`, which keeps the portal in step with the directory: admin rights,
memberships and roles of the teams that IDENTITY_GROUP_TEAMS names, and Profile.unix_account
(docs/identity.md): taken from a directory trusted for it, else held as a claim for an admin to
confirm (`unix_account_claim_confirm`). The configuration is read by portal.identity_env.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Callable, Iterable

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.http import HttpRequest
from django.utils import timezone

from portal.accounts import unix_account_trusted, users_by_unix_name
from portal.errors import Invalid
from portal.identity_env import MEMBER, ROLE_RANK, GroupTeams
from portal.models import AuditEntry, ExternalAccount, Membership, Profile, Team
from portal.teams import name_from_slug

logger = logging.getLogger(__name__)

# POSIX's portable user names (letters, digits, '.', '_', '-'; no leading '-'), not all digits
# so they cannot be read as a uid, and at most 32 characters like Linux and Profile.unix_account.
_UNIX_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")
SOURCE_LABELS = {"ldap": "LDAP", "oidc": "single sign-on"}
# What a directory's username may become here: ASCII only, so that no two names that look or
# compare alike (PostgreSQL's UPPER maps the dotless "ı" to "I") can reach the same account.
_USERNAME = re.compile(r"[a-z0-9._-]{1,150}")
# Writes one audit entry: (message, team=None, **data).
_Audit = Callable[..., None]


def _audit(user: AbstractBaseUser, source: str, message: str, team: object = None, **data: object) -> None:
    label = SOURCE_LABELS[source]
    logger.info("%s: %s", label, message)
    AuditEntry.objects.create(
        actor=None,
        team=team,
        action=AuditEntry.Action.IDENTITY_SYNC,
        target=f"user {user.get_username()}",
        message=f"{message} ({label})",
        data={"by": "portal", "source": source, **data},
    )


# --- Which portal user a directory sign-in is -------------------------------------------------


class ExternalAccountRefused(Exception):
    """A directory sign-in that may not reach a portal account; the message is for the person."""


def directory_username(value: object) -> str | None:
    """The portal username for a directory's username: NFKC-normalised and lower-cased, and
    None unless it is then only ASCII letters, digits, '.', '_' and '-'."""
    if not isinstance(value, str):
        return None
    name = unicodedata.normalize("NFKC", value).strip().lower()
    return name if _USERNAME.fullmatch(name) else None


class ActiveUsersOnly:
    """For the directory backends: each request's user, refused once deactivated (signed out), as
    Django's own ModelBackend does; django-auth-ldap and mozilla-django-oidc do not."""

    def get_user(self, user_id):  # type: ignore[no-untyped-def]
        user = super().get_user(user_id)  # type: ignore[misc]
        return user if user is not None and user.is_active else None


@transaction.atomic
def external_account_link(*, source: str, issuer: str, subject: str, username: object) -> AbstractBaseUser:
    """The portal user who signs in as `subject` at `issuer` (`source`: "ldap" or "oidc").

    Found by its ExternalAccount when it has one. Otherwise linked by `username`, normalised
    by `directory_username` and matched exactly: a new user when nobody has that name, else the
    existing account, if `_link_refusal` finds nothing against it. A link (and a new user) is
    audited, and leaves the account with no usable local password: the directory is now how
    they sign in. Raises ExternalAccountRefused, logging why, when the sign-in must fail."""
    now = timezone.now()
    account = (
        ExternalAccount.objects.select_related("user")
        .filter(source=source, issuer=issuer, subject=subject)
        .first()
    )
    if account is not None:
        ExternalAccount.objects.filter(pk=account.pk).update(last_login_at=now)
        return account.user

    label = SOURCE_LABELS[source]
    name = directory_username(username)
    if name is None:
        logger.warning(
            "%s sign-in refused: the username %r of %r at %s is not a-z, 0-9, '.', '_' and '-' only",
            label,
            username,
            subject,
            issuer,
        )
        if not isinstance(username, str) or not username.strip():
            raise ExternalAccountRefused(
                f"Your {label} account gives no username; ask an admin to link your account."
            )
        raise ExternalAccountRefused(
            f"Your {label} username {username!r} cannot be used here: a username may hold only "
            "a-z, 0-9, '.', '_' and '-'. Ask an admin to link your account."
        )
    user_model = get_user_model()
    # NO KEY: two first sign-ins under one name still take turns, while a commit that only refers
    # to the user (a team form adding them, their booking in another tab) does not wait for it and
    # cannot deadlock with the memberships this sign-in locks next (tests/test_lock_modes.py).
    user = user_model.objects.select_for_update(no_key=True).filter(username=name).first()
    if user is None:
        user = user_model.objects.create_user(name)  # no usable password
        linked = f"{user} created and linked to {subject} at {issuer}"
    else:
        refusal = _link_refusal(user, source, issuer)
        if refusal:
            logger.warning(
                "%s sign-in refused: %r at %s would take over the account %s, which %s; an admin "
                "can link it by hand (docs/identity.md)",
                label,
                subject,
                issuer,
                user,
                refusal,
            )
            raise ExternalAccountRefused(
                f"An account named {name} already exists here; ask an admin to link it."
            )
        linked = f"{user} linked to {subject} at {issuer}"
    ExternalAccount.objects.create(
        user=user, source=source, issuer=issuer, subject=subject, last_login_at=now
    )
    if user.has_usable_password():
        user.set_unusable_password()
        user.save(update_fields=["password"])
        linked += "; its local password no longer works"
    _audit(user, source, linked, issuer=issuer, subject=subject)
    return user


def _link_refusal(user: AbstractBaseUser, source: str, issuer: str) -> str | None:
    """Why a directory sign-in may not take over this existing account by its name, or None.

    A name is something a directory's users may choose (an OIDC provider's preferred_username
    often is), so an account with something to lose is never linked on a name alone."""
    if user.is_staff or user.is_superuser:
        return "is an admin"
    # Linked at the same directory already: its name now belongs to someone else there. Linked
    # by the other kind of sign-in: one directory's names say nothing of the other's.
    # The same source at another issuer is a re-configured server (a new URI): allowed.
    if ExternalAccount.objects.filter(user=user).filter(~Q(source=source) | Q(issuer=issuer)).exists():
        return "is linked to another directory account"
    if user.has_usable_password() and not settings.IDENTITY_LINK_LOCAL_ACCOUNTS:
        return "has a local password (IDENTITY_LINK_LOCAL_ACCOUNTS is off)"
    return None


def signin_refusal_show(request: HttpRequest | None, message: str) -> None:
    """Say on the login page why a directory sign-in failed; portal.oidc's failure page then
    leaves out its generic message."""
    if request is None:
        return
    messages.error(request, message, fail_silently=True)
    request.signin_refused = True  # type: ignore[attr-defined]


# --- Keeping a person in step with the directory ---------------------------------------------


def unix_account_valid(name: str) -> bool:
    return bool(_UNIX_ACCOUNT.fullmatch(name)) and not name.isdigit()


def team_roles_for(groups: Iterable[str], mapping: GroupTeams) -> dict[str, tuple[str, list[str]]]:
    """{team slug: (role, the groups that give it)} for a person in `groups`; leader wins."""
    roles: dict[str, tuple[str, list[str]]] = {}
    for group in sorted(set(groups)):
        for grant in mapping.get(group.casefold(), ()):
            role, why = roles.get(grant.slug, (MEMBER, []))
            if not why or ROLE_RANK[grant.role] > ROLE_RANK[role]:
                role = grant.role
            roles[grant.slug] = (role, [*why, group])
    return roles


@transaction.atomic
def identity_sync(
    *, user: AbstractBaseUser, groups: Iterable[str] | None, unix_account: str | None, source: str
) -> None:
    """Bring a person who just signed in through the directory (`source`: "ldap" or "oidc") in
    step with it, every change in the audit log by "the portal":

    - `groups` None (the directory's groups are not read) leaves teams and admin rights alone;
    - memberships of the teams IDENTITY_GROUP_TEAMS names follow the groups: joined, role
      changed, or left; a named team that does not exist yet is created; teams the mapping does
      not name are never touched;
    - with IDENTITY_ADMIN_GROUPS set, admin rights (is_staff and is_superuser) follow membership
      of one of those groups;
    - a valid `unix_account` from a directory trusted for it (portal.accounts.unix_account_trusted)
      replaces the profile's; from one that is not, it is only held as the profile's
      unix_account_claim, which nothing uses until an admin confirms it. Either way it is
      refused when someone else has it (held on their profile, or their username standing in
      for one): the profile is left as it is, and the conflict is logged and audited for an
      admin to resolve. A sign-in never takes a Unix account: a claim or attribute the person
      can edit must never hand them anyone's;
    - no `unix_account` from a directory not trusted for it: the username it gave them no longer
      stands in for one (portal.accounts.users_by_unix_name), so, if they have none, the
      username is held as their claim.

    Running it again with the same arguments changes nothing (a refused Unix account is audited
    again, until an admin resolves it)."""
    label = SOURCE_LABELS[source]

    def audit(message: str, team: object = None, **data: object) -> None:
        _audit(user, source, message, team, **data)

    if groups is not None:
        groups = [str(group) for group in groups]
        _sync_memberships(user, groups, settings.IDENTITY_GROUP_TEAMS, audit)
        if settings.IDENTITY_ADMIN_GROUPS:
            _sync_admin(user, groups, settings.IDENTITY_ADMIN_GROUPS, audit)
    trusted = unix_account_trusted(source)
    name = unix_account.strip() if unix_account else ""
    if name:
        _sync_unix_account(user, name, label, audit, trusted=trusted)
    elif not trusted:
        _claim_username(user, label, audit)


def _sync_memberships(user: AbstractBaseUser, groups: list[str], mapping: GroupTeams, audit: _Audit) -> None:

    wanted = team_roles_for(groups, mapping)
    managed = {grant.slug for grants in mapping.values() for grant in grants}
    held = {
        m.team.slug: m
        for m in Membership.objects.select_for_update(of=("self",))
        .select_related("team")
        .filter(user=user, team__slug__in=managed)
    }
    for slug, membership in sorted(held.items()):
        if slug not in wanted:
            membership.delete()
            audit(
                f"{user} left {membership.team}: in no group for it now",
                membership.team,
                role=membership.role,
            )
    for slug, (role, why) in sorted(wanted.items()):
        membership = held.get(slug)
        if membership is None:
            team = _team_for(slug, why, audit)
            Membership.objects.create(team=team, user=user, role=role)
            audit(f"{user} joined {team} as {role}: group {', '.join(why)}", team, role=role, groups=why)
        elif membership.role != role:
            old, membership.role = membership.role, role
            membership.save(update_fields=["role"])
            audit(
                f"{user} is now {role} of {membership.team}, was {old}: group {', '.join(why)}",
                membership.team,
                role=role,
                was=old,
                groups=why,
            )


def _team_for(slug: str, why: list[str], audit: _Audit) -> Team:
    """The team with this slug; made on first need, named after it ("vision-lab" → "Vision Lab"),
    so mapping a new group is all an admin does to give a lab group its team."""

    team = Team.objects.filter(slug=slug).first()
    if team:
        return team
    name = name_from_slug(slug)
    if Team.objects.filter(name=name).exists():
        name = f"{name} ({slug})"
    team, created = Team.objects.get_or_create(slug=slug, defaults={"name": name})
    if created:
        audit(f"team {team} created for group {', '.join(why)}", team)
    return team


def _sync_admin(
    user: AbstractBaseUser, groups: list[str], admin_groups: frozenset[str], audit: _Audit
) -> None:
    matched = sorted(group for group in groups if group.casefold() in admin_groups)
    admin = bool(matched)
    if user.is_staff == admin and user.is_superuser == admin:
        return
    user.is_staff = user.is_superuser = admin
    user.save(update_fields=["is_staff", "is_superuser"])
    if admin:
        audit(f"{user} is now an admin: group {', '.join(matched)}", admin=True, groups=matched)
    else:
        audit(f"{user} is no longer an admin: in no admin group now", admin=False)


def _sync_unix_account(
    user: AbstractBaseUser, name: str, label: str, audit: _Audit, *, trusted: bool
) -> None:
    if not unix_account_valid(name):
        logger.warning(
            "%s gives %s the Unix account %r, which is not a POSIX user name: ignored", label, user, name
        )
        return
    profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
    if profile.unix_account == name:
        # What this directory claimed before is moot now; another's claim stands, unless the same.
        if profile.unix_account_claim and (not trusted or profile.unix_account_claim == name):
            _withdraw_claim(user, profile, audit)
        return
    if not trusted and profile.unix_account_claim == name:
        return
    if _held_by_someone_else(user, name, label, profile, audit):
        return
    if not trusted:
        _hold_claim(user, profile, name, audit)
        return
    old, profile.unix_account = profile.unix_account, name
    profile.save(update_fields=["unix_account"])
    audit(f"{user}'s Unix account is now {name}, was {old or 'none'}", unix_account=name, was=old)
    if profile.unix_account_claim == name:
        _withdraw_claim(user, profile, audit)


def _claim_username(user: AbstractBaseUser, label: str, audit: _Audit) -> None:
    """For a person of a directory not trusted for Unix accounts that names none: the username it
    gave them, which no longer stands in for one, held as their claim while they have none."""
    name = user.get_username()
    if not unix_account_valid(name):
        return
    profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
    if profile.unix_account or profile.unix_account_claim == name:
        return
    if not _held_by_someone_else(user, name, label, profile, audit):
        _hold_claim(user, profile, name, audit, by_username=True)


def _held_by_someone_else(
    user: AbstractBaseUser, name: str, label: str, profile: Profile, audit: _Audit
) -> bool:
    """Whether `name` is someone else's, by the GPU watchdog's own rule (a profile's Unix account,
    else the username of someone with none of their own); if so, logged and audited."""
    holder_id = users_by_unix_name([name]).get(name)
    if holder_id in (None, user.pk):
        return False
    holder = get_user_model().objects.get(pk=holder_id)
    logger.warning(
        "%s gives %s the Unix account %r, which is %s's: refused, an admin must resolve it",
        label,
        user,
        name,
        holder,
    )
    audit(
        f"{user} was not given the Unix account {name}: it is {holder}'s; an admin must resolve it",
        unix_account=profile.unix_account,
        refused=name,
        held_by=holder.get_username(),
    )
    return True


def _hold_claim(
    user: AbstractBaseUser, profile: Profile, name: str, audit: _Audit, *, by_username: bool = False
) -> None:
    old, profile.unix_account_claim = profile.unix_account_claim, name
    profile.save(update_fields=["unix_account_claim"])
    how = " by their username" if by_username else ""
    audit(
        f"{user} claims the Unix account {name}{how}, awaiting an admin to confirm it",
        unix_account=profile.unix_account,
        claim=name,
        was_claim=old,
    )


def _withdraw_claim(user: AbstractBaseUser, profile: Profile, audit: _Audit) -> None:
    old, profile.unix_account_claim = profile.unix_account_claim, None
    profile.save(update_fields=["unix_account_claim"])
    audit(
        f"{user} no longer claims the Unix account {old}",
        unix_account=profile.unix_account,
        was_claim=old,
    )


@transaction.atomic
def unix_account_claim_confirm(*, user: AbstractBaseUser, by: AbstractBaseUser) -> str:
    """Give `user` the Unix account their directory claims (Profile.unix_account_claim), as the
    admin `by` confirms it: jobs run as it and the watchdog names them by it from now on.
    Audited. Returns the account; raises Invalid when they claim none, or when it is someone
    else's by the watchdog's rule (an admin then resolves that first)."""
    profile = Profile.objects.select_for_update().filter(user=user).first()
    name = profile.unix_account_claim if profile else None
    if not name:
        raise Invalid(f"{user} claims no Unix account.")
    holder_id = users_by_unix_name([name]).get(name)
    if holder_id not in (None, user.pk):
        holder = get_user_model().objects.get(pk=holder_id)
        raise Invalid(
            f"{user} claims the Unix account {name}, which is {holder}'s: change or clear {holder}'s "
            "Unix account first, or give them one of their own."
        )
    old, profile.unix_account, profile.unix_account_claim = profile.unix_account, name, None
    try:
        with transaction.atomic():
            profile.save(update_fields=["unix_account", "unix_account_claim"])
    except IntegrityError:  # taken meanwhile: the unique constraint guards the race
        raise Invalid(f"{user} claims the Unix account {name}, which someone was just given.") from None
    AuditEntry.objects.create(
        actor=by,
        action=AuditEntry.Action.IDENTITY_SYNC,
        target=f"user {user.get_username()}",
        message=f"{by} confirmed {user}'s claimed Unix account {name}, was {old or 'none'}",
        data={"by": by.get_username(), "unix_account": name, "was": old, "confirmed": True},
    )
    return name
