"""DRF permission classes for what a user who can *see* an object may *do* with it.

Who may see an object is the view's queryset (scoped by visibility), so DRF's `get_object`
answers 404 for the rest. These classes answer 403 for what is visible but not the user's to do.
The services check the same rules (they raise Forbidden); these keep the API's answer declared.
The rules themselves are portal.access's, which the pages use too.
"""

from __future__ import annotations

from typing import Any

from rest_framework.generics import get_object_or_404
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from portal.access import VIEW, can_manage, can_manage_team, is_admin, only_managers
from portal.models import Team


class IsOwner(BasePermission):
    """The object's owner (`owner_id`) only."""

    message = "Only the owner can do this."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return obj.owner_id == request.user.pk


class IsOwnerOrTeamManager(BasePermission):
    """The owner, leaders of the object's team (`team_id`) and admins."""

    message = "Only the owner, leaders of its team and admins can do this."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return can_manage(request.user, obj)


class ActionPermissionsMixin:
    """For viewsets: `action_permissions = {"cancel": [IsOwner]}` adds permission classes for one
    action on top of `permission_classes` (destroy included, which `@action` cannot decorate)."""

    action_permissions: dict[str, list[type[BasePermission]]] = {}

    def get_permissions(self) -> list[BasePermission]:
        extra = self.action_permissions.get(getattr(self, "action", None) or "", [])
        return [*super().get_permissions(), *(permission() for permission in extra)]  # type: ignore[misc]


# --- teams ---------------------------------------------------------------------------------


def _team_of(obj: Team | Any) -> Team:
    """A team is its own team; anything else (a membership) names its `team`."""
    return obj if isinstance(obj, Team) else obj.team


class IsAdminOrReadOnly(BasePermission):
    """Whoever may see the object reads it; only admins change it."""

    message = "Only admins can change this; ask one."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return request.method in SAFE_METHODS or is_admin(request.user)


class IsTeamManager(BasePermission):
    """Leaders of the team (the object itself, or the object's `team`) and admins."""

    message = "Only leaders of the team and admins manage it."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        team = _team_of(obj)
        self.message = only_managers(team)
        return can_manage_team(request.user, team)


class IsTeamManagerOrSelfReadOnly(IsTeamManager):
    """A membership: its own user reads it; leaders of its team and admins read and change it."""

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        if request.method in SAFE_METHODS and obj.user_id == request.user.pk:
            return True
        return super().has_object_permission(request, view, obj)


class TeamLookupMixin:
    """For API views under teams/{slug}/…: `get_team()` finds the team in the URL the way DRF's
    `get_object` finds an object, among `Team.objects.restrict(user, VIEW)` (others: 404), then through the
    view's permission classes (403). One lookup for every nested route, so they cannot disagree."""

    def get_team(self, *, check_permissions: bool = True) -> Team:
        """check_permissions=False where the team only leads to the view's object (a membership),
        whose permissions `get_object` checks instead."""
        request = self.request  # type: ignore[attr-defined]
        team = get_object_or_404(Team.objects.restrict(request.user, VIEW), slug=self.kwargs["slug"])  # type: ignore[attr-defined]
        if check_permissions:
            self.check_object_permissions(request, team)  # type: ignore[attr-defined]
        return team
