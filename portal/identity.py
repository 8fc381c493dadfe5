"""Sign-in with the lab's accounts: what LDAP / Active Directory and OpenID Connect share.

Both backends (portal.ldap, portal.oidc) hand a signed-in person's group names (an LDAP group's
cn, the values of the OIDC groups claim) and Unix account to `identity_sync`, which keeps the
portal in step with the directory: admin rights, memberships and roles of the teams that
IDENTITY_GROUP_TEAMS names, and Profile.unix_account (docs/identity.md). The configuration is
read by portal.identity_env.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction

from portal.identity_env import MEMBER, ROLE_RANK, GroupTeams
from portal.models import AuditEntry, Membership, Profile, Team

logger = logging.getLogger(__name__)

# POSIX's portable user names (letters, digits, '.', '_', '-'; no leading '-'), not all digits
# so they cannot be read as a uid, and at most 32 characters like Linux and Profile.unix_account.
_UNIX_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")
SOURCE_LABELS = {"ldap": "LDAP", "oidc": "single sign-on"}
# Writes one audit entry: (message, team=None, **data).
_Audit = Callable[..., None]

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
    - a valid `unix_account` replaces the profile's, and is taken from another profile holding it.

    Running it again with the same arguments changes nothing."""
    label = SOURCE_LABELS[source]

    def audit(message: str, team: object = None, **data: object) -> None:
        logger.info("%s: %s", label, message)
        AuditEntry.objects.create(
            actor=None,
            team=team,
            action=AuditEntry.Action.IDENTITY_SYNC,
            target=f"user {user.get_username()}",
            message=f"{message} ({label})",
            data={"by": "portal", "source": source, **data},
        )

    if groups is not None:
        groups = [str(group) for group in groups]
        _sync_memberships(user, groups, settings.IDENTITY_GROUP_TEAMS, audit)
        if settings.IDENTITY_ADMIN_GROUPS:
            _sync_admin(user, groups, settings.IDENTITY_ADMIN_GROUPS, audit)
    if unix_account:
        _sync_unix_account(user, unix_account.strip(), label, audit)


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
    name = " ".join(word.capitalize() for word in re.split(r"[-_]+", slug) if word) or slug
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


def _sync_unix_account(user: AbstractBaseUser, name: str, label: str, audit: _Audit) -> None:

    if not unix_account_valid(name):
        logger.warning(
            "%s gives %s the Unix account %r, which is not a POSIX user name: ignored", label, user, name
        )
        return
    profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
    if profile.unix_account == name:
        return
    for other in Profile.objects.select_for_update().filter(unix_account=name).exclude(pk=profile.pk):
        # The directory knows whose account it is; a hand-set copy on someone else is the mistake.
        logger.warning("%s gives the Unix account %r to %s: taken from %s", label, name, user, other.user)
        other.unix_account = None
        other.save(update_fields=["unix_account"])
        audit(f"{other.user} lost the Unix account {name}: it is {user}'s", unix_account=None, was=name)
    old, profile.unix_account = profile.unix_account, name
    profile.save(update_fields=["unix_account"])
    audit(f"{user}'s Unix account is now {name}, was {old or 'none'}", unix_account=name, was=old)
