"""Teams and their members, made and changed by admins: on the portal's pages (portal/team_views.py)
and with `manage.py team_create`, which call these services. Each change is one transaction with
its entry in the team's audit log; a refused change writes nothing and names every bad field.

A team's quotas and fair-share shares are gpus' (gpus/quotas.py, the team page). A directory may
manage a team's members too (IDENTITY_GROUP_TEAMS, docs/identity.md): a change made here to such
a team lasts until the person's next sign-in, and the pages say so (`directory_managed`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils.text import slugify

from portal.errors import Conflict, Errors, Invalid
from portal.models import AuditEntry, Membership, Team

User = get_user_model()

SLUG = re.compile(r"[a-z0-9]+(?:[-_][a-z0-9]+)*\Z")
NAME_MAX = Team._meta.get_field("name").max_length
SLUG_MAX = Team._meta.get_field("slug").max_length
ROLES = {Membership.Role.MEMBER: "member", Membership.Role.LEADER: "leader"}


def name_from_slug(slug: str) -> str:
    """A team's name from its slug, as the directory's teams are named: "vision-lab" → "Vision Lab"."""
    return " ".join(word.capitalize() for word in re.split(r"[-_]+", slug) if word) or slug


def directory_managed(team: Team) -> bool:
    """Whether the lab's directory sets this team's members at each sign-in (IDENTITY_GROUP_TEAMS)."""
    return any(
        grant.slug == team.slug for grants in settings.IDENTITY_GROUP_TEAMS.values() for grant in grants
    )


def users_named(names: Sequence[str], *, field: str) -> list[AbstractBaseUser]:
    """The active portal users of these usernames, in order; Invalid naming every unknown or
    deactivated one (and who a wrongly cased name may have meant)."""
    wanted = [name.strip() for name in names if name.strip()]
    found = {u.username: u for u in User.objects.filter(username__in=wanted)}
    problems = []
    for name in wanted:
        user = found.get(name)
        if user is None:
            near = User.objects.filter(username__iexact=name).values_list("username", flat=True).first()
            hint = f" (did you mean {near}?)" if near else ""
            problems.append(f"no portal user is named {name!r}{hint}")
        elif not user.is_active:
            problems.append(f"the account of {name} is deactivated")
    if problems:
        said = "; ".join(problems)
        raise Invalid(
            f"{said[0].upper()}{said[1:]}. People get an account when they first sign in with the "
            "lab's directory, or when an admin adds them (Admin → Users → Add user).",
            field=field,
        )
    return [found[name] for name in dict.fromkeys(wanted)]


def _check_name(name: str, slug: str) -> tuple[str, str]:
    errors = Errors()
    name = " ".join(name.split())
    slug = (slug.strip() or slugify(name)).lower()
    if not name:
        errors.add("name", "Give the team a name, e.g. Vision Lab.")
    elif len(name) > NAME_MAX:
        errors.add("name", f"Keep the name to {NAME_MAX} characters at most.")
    elif Team.objects.filter(name__iexact=name).exists():
        errors.add("name", f"A team named {name!r} exists already: pick another name, or change its members.")
    if name and not slug:  # slugify keeps only the letters a URL can use (Latin ones, digits)
        errors.add("slug", "The name has no letters a URL can use: give a slug, e.g. vision-lab.")
    elif name and not SLUG.match(slug):
        errors.add(
            "slug",
            f"{slug!r} cannot be a slug: use lower-case letters, digits and single '-' or '_' "
            "between them, e.g. vision-lab.",
        )
    elif len(slug) > SLUG_MAX:
        errors.add("slug", f"The slug has {len(slug)} characters: keep it to {SLUG_MAX} at most.")
    elif slug and Team.objects.filter(slug=slug).exists():
        errors.add("slug", f"A team with the slug {slug!r} exists already: pick another slug.")
    errors.raise_any()
    return name, slug


@transaction.atomic
def team_create(
    *,
    actor: AbstractBaseUser | None,
    name: str,
    slug: str = "",
    leaders: Sequence[str] = (),
    members: Sequence[str] = (),
) -> Team:
    """A new team with its leaders and members (usernames), no quota limits and equal shares, as
    a team made by the directory starts. Every problem at once (a taken name or slug, each unknown
    user, someone listed twice); nothing is written unless all is well. `actor` None: the command."""
    errors = Errors()
    checked = errors.check(_check_name, name, slug)
    leader_users = errors.check(users_named, leaders, field="leaders") or []
    member_users = errors.check(users_named, members, field="members") or []
    both = sorted({n.strip() for n in leaders} & {n.strip() for n in members} - {""})
    if both:
        errors.add("members", f"{', '.join(both)} listed as leader and as member: list each person once.")
    errors.raise_any()
    name, slug = checked
    try:
        with transaction.atomic():
            team = Team.objects.create(name=name, slug=slug)
    except IntegrityError:  # made by someone else between the check and now
        raise Conflict(
            f"A team named {name!r} or with the slug {slug!r} was just made.", field="slug"
        ) from None
    for users, role in ((leader_users, Membership.Role.LEADER), (member_users, Membership.Role.MEMBER)):
        Membership.objects.bulk_create([Membership(team=team, user=user, role=role) for user in users])
    who = "; ".join(
        f"{label}: {', '.join(u.username for u in users)}"
        for label, users in (("leaders", leader_users), ("members", member_users))
        if users
    )
    _audit(
        actor,
        team,
        AuditEntry.Action.TEAM_CREATE,
        f"{_by(actor)} created team {team} ({team.slug}){'; ' + who if who else ''}",
        leaders=[u.username for u in leader_users],
        members=[u.username for u in member_users],
    )
    return team


@transaction.atomic
def team_member_add(*, actor: AbstractBaseUser, team: Team, username: str, role: str) -> Membership:
    """Add someone to the team as member or leader; refused when they are in it already (change
    their role instead) or unknown."""
    role = _check_role(role)
    user = users_named([username], field="username")[0] if username.strip() else None
    if user is None:
        raise Invalid("Give the username of the person to add.", field="username")
    current = Membership.objects.filter(team=team, user=user).first()
    if current is not None:
        raise Invalid(
            f"{user} is in {team} already, as {current.get_role_display().lower()}: "
            "change their role instead.",
            field="username",
        )
    try:
        with transaction.atomic():  # a savepoint: the refusal below leaves the transaction usable
            membership = Membership.objects.create(team=team, user=user, role=role)
    except IntegrityError:  # another admin added them between the check and now
        raise Invalid(
            f"{user} is in {team} already: someone added them just now. Reload the page to see "
            "their role, and change it there if need be.",
            field="username",
        ) from None
    _audit(
        actor,
        team,
        AuditEntry.Action.TEAM_MEMBERS,
        f"{actor} added {user} to {team} as {role}",
        user=user.username,
        role=role,
    )
    return membership


@transaction.atomic
def team_member_remove(*, actor: AbstractBaseUser, membership: Membership) -> bool:
    """Take someone out of the team. Their member quota goes with the membership, and new bookings
    for this team are refused them. Their queued jobs of this team that have not started are
    cancelled at once, saying why (jobs.leavers.membership_deleted, on this delete: the queue
    could never start them); their bookings and the jobs running or waiting on their own
    bookings stay as they are (a leader or admin cancels them if need be). False (and nothing
    written) when they are out already: another admin's tab, or a second click, removed them."""
    role = _membership_locked(membership)
    if role is None:
        return False
    team, user = membership.team, membership.user
    membership.delete()
    _audit(
        actor,
        team,
        AuditEntry.Action.TEAM_MEMBERS,
        f"{actor} removed {user} ({role}) from {team}",
        user=user.username,
        was=role,
    )
    return True


@transaction.atomic
def team_member_role_set(*, actor: AbstractBaseUser, membership: Membership, role: str) -> bool:
    """Make a member a leader or a leader a member; False (and nothing written) when it is so already."""
    role = _check_role(role)
    current = _membership_locked(membership)
    if current is None:
        raise Conflict(
            f"{membership.user} is no longer in {membership.team}: someone removed them just now. "
            "Add them again to give them a role."
        )
    membership.role = current  # as it is now: another tab may have changed it since this page was read
    if membership.role == role:
        return False
    old, membership.role = membership.role, role
    membership.save(update_fields=["role"])
    _audit(
        actor,
        membership.team,
        AuditEntry.Action.TEAM_MEMBERS,
        f"{actor} made {membership.user} {role} of {membership.team}, was {old}",
        user=membership.user.username,
        role=role,
        was=old,
    )
    return True


def _membership_locked(membership: Membership) -> str | None:
    """The membership's role as its row stands now, the row locked until the transaction ends; None
    when it is gone. A page read it a moment ago, and two admins' tabs (or a double click) act on
    it at once: each change is judged on the row, never on what the page read."""
    rows = Membership.objects.select_for_update(of=("self",)).filter(pk=membership.pk)
    return rows.values_list("role", flat=True).first()


def team_locked(team_id: int) -> Team:
    """The team's row, locked until the transaction ends, read as it stands once locked: every
    booking takes it after its member's row (gpus.quotas.membership_locked), and so does whatever
    changes the team's limits. NO KEY: a commit whose rows refer to the team (a job, a booking, a
    member) checks their keys with FOR KEY SHARE, which FOR UPDATE would hold up, and in a cycle
    (tests/test_lock_modes.py); a delete takes FOR UPDATE itself when it comes."""
    return Team.objects.select_for_update(no_key=True).get(pk=team_id)


def team_locked_with_members(team_id: int) -> Team:
    """The team's row, locked, with every member's row locked first: the order bookings take them,
    for a change that writes members' rows too (the admin's team form); the other way round, a
    booking holding a member's row and waiting for the team's deadlocks with it."""
    members = Membership.objects.select_for_update(no_key=True).filter(team_id=team_id).order_by("pk")
    list(members.values_list("pk"))
    return team_locked(team_id)


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise Invalid(f"Role {role!r}: choose member or leader.", field="role")
    return role


def _by(actor: AbstractBaseUser | None) -> str:
    return str(actor) if actor is not None else "manage.py team_create"


def _audit(actor: AbstractBaseUser | None, team: Team, action: str, message: str, **data: object) -> None:
    AuditEntry.objects.create(
        actor=actor, team=team, action=action, target=f"team {team.slug}", message=message, data=data
    )
