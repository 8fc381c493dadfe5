"""DRF permission classes for what a user who can *see* an object may *do* with it.

Who may see an object is the view's queryset (scoped by visibility), so DRF's `get_object`
answers 404 for the rest. These classes answer 403 for what is visible but not the user's to do.
The services check the same rules (they raise Forbidden); these keep the API's answer declared.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from portal.access import can_manage_team


class IsOwner(BasePermission):
    """The object's owner (`owner_id`) only."""

    message = "Only the owner can do this."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return obj.owner_id == request.user.pk


class IsOwnerOrTeamManager(BasePermission):
    """The owner, leaders of the object's team (`team_id`) and admins."""

    message = "Only the owner, leaders of its team and admins can do this."

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return obj.owner_id == request.user.pk or can_manage_team(request.user, obj.team_id)


class ActionPermissionsMixin:
    """For viewsets: `action_permissions = {"cancel": [IsOwner]}` adds permission classes for one
    action on top of `permission_classes` (destroy included, which `@action` cannot decorate)."""

    action_permissions: dict[str, list[type[BasePermission]]] = {}

    def get_permissions(self) -> list[BasePermission]:
        extra = self.action_permissions.get(getattr(self, "action", None) or "", [])
        return [*super().get_permissions(), *(permission() for permission in extra)]  # type: ignore[misc]
