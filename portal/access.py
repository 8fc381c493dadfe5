"""Who may see and change what. One place, so pages and the API agree."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404

from portal.errors import Forbidden, Invalid
from portal.models import Membership, Team
from portal.restrict import ACTIONS as ACTIONS
from portal.restrict import CHANGE as CHANGE
from portal.restrict import VIEW as VIEW
from portal.restrict import check_action as check_action
from portal.restrict import is_admin as is_admin


def leads_team(user: AbstractBaseUser, team: Team | int) -> bool:
    team_id = team if isinstance(team, int) else team.pk
    return Membership.objects.filter(team_id=team_id, user=user, role=Membership.Role.LEADER).exists()


def can_manage_team(user: AbstractBaseUser, team: Team | int) -> bool:
    """Leaders of the team and admins: edit member quotas, cancel the team's bookings. The rule is
    Team's `restrict(user, "change")`; an admin is answered without a query."""
    team_id = team if isinstance(team, int) else team.pk
    return is_admin(user) or Team.objects.restrict(user, CHANGE).filter(pk=team_id).exists()


def permits(user: AbstractBaseUser, action: str, obj: Any) -> bool:
    """Whether the user may `action` this one object: its model's `restrict(user, action)`, asked
    of its row, so a page's button, a service's check and the API's permission class agree."""
    return type(obj)._default_manager.restrict(user, action).filter(pk=obj.pk).exists()


def can_manage(user: AbstractBaseUser, obj: Any) -> bool:
    """The owner of a team's object (a booking, a job, a session), leaders of its team and admins:
    cancel it, stop it. The rule is each model's `restrict(user, "change")`."""
    return permits(user, CHANGE, obj)


def owner_reason_check(*, user: AbstractBaseUser, obj: Any, reason: object, refused: str) -> str:
    """The reason given for cancelling a team's object (a booking, a job), normalised; asked by the
    service and by its confirm page before anything stops. Someone else's needs one: its owner
    sees it. One rule for bookings (gpus.booking.cancel_reason_check) and jobs
    (jobs.services.job_cancel_reason_check); Forbidden(`refused`) for who may not cancel it."""
    if not isinstance(reason, str):
        raise Invalid("Give the reason as text.", field="reason")
    if "\x00" in reason:
        raise Invalid("The reason holds a NUL character; write it without one.", field="reason")
    if not can_manage(user, obj):
        raise Forbidden(refused)
    reason = reason.strip()
    if obj.owner_id != user.pk and not reason:
        raise Invalid(f"Give a reason: {obj.owner} will see it.", field="reason")
    if len(reason) > 500:
        raise Invalid("Keep the reason to 500 characters.", field="reason")
    return reason


def teams_led_by(user: AbstractBaseUser | None) -> QuerySet[Team]:
    """The teams the user leads (none for no user), as a query: `team_id__in=teams_led_by(user)`
    is one subquery."""
    return Team.objects.led_by(user)


def team_ids_of(user: AbstractBaseUser) -> set[int]:
    # Unordered: Membership's ordering joins the teams and users only to sort a set (asked by
    # every page and poll that names booking owners).
    return set(Membership.objects.filter(user=user).order_by().values_list("team_id", flat=True))


def roles_of(user: AbstractBaseUser) -> dict[int, str]:
    """The user's role in each of their teams, by team id."""
    return dict(Membership.objects.filter(user=user).order_by().values_list("team_id", "role"))


def display_name(
    viewer: AbstractBaseUser, viewer_teams: set[int], owner_id: int, owner_name: str, team_id: int
) -> str:
    """Name a booking's owner: by name for teammates (and admins), else 'another user'.

    "Teammate" means the viewer belongs to the team the booking was made for.
    """
    if owner_id == viewer.pk:
        return "you"
    if team_id in viewer_teams or is_admin(viewer):
        return owner_name
    return "another user"


def only_managers(team: Team) -> str:
    """Why a member who does not lead `team` is refused (pages and API alike)."""
    return f"Only leaders of {team} and admins manage it."


def team_for_user(user: AbstractBaseUser, slug: str, *, manage: bool) -> Team:
    """The team if the user is a member or an admin, else 404 (outsiders never learn it exists).

    With manage=True, members who do not lead it get 403: they know the team, not its management.
    """
    team = Team.objects.restrict(user, VIEW).filter(slug=slug).first()
    if team is None:
        raise Http404("No such team.")
    if manage and not can_manage_team(user, team):
        raise PermissionDenied(only_managers(team))
    return team
