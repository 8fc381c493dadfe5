"""Teams API: /api/v1/teams/… (the pages' rules: portal.access, through portal.permissions).

Who may do what:
  GET   teams/                           your teams (admins: all)
  GET   teams/{slug}/audit/              leaders and admins (paginated, newest first; outsiders 404)

A team's quota, its members' quotas and their use (teams/{slug}/, teams/{slug}/members/…)
are counted from bookings, so they are served by gpus/team_api.py.
"""

from __future__ import annotations

from typing import Any

from django.urls import URLPattern, URLResolver, path
from rest_framework import generics, serializers
from rest_framework.permissions import IsAuthenticated

from portal.access import roles_of
from portal.filters import AuditEntryFilter
from portal.models import AuditEntry, Team
from portal.pagination import PagePagination
from portal.permissions import IsTeamManager, TeamLookupMixin, teams_visible_to


class TeamSerializer(serializers.ModelSerializer):
    your_role = serializers.SerializerMethodField(help_text="member, leader, or null (an admin outside it)")

    class Meta:
        model = Team
        fields = ["name", "slug", "max_cards", "max_gb", "gpu_hours_per_week", "your_role"]
        read_only_fields = fields

    def get_your_role(self, team: Team) -> str | None:
        return self.context["roles"].get(team.pk)


class AuditEntrySerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor.username", read_only=True, default=None)

    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor", "action", "target", "message", "data"]
        read_only_fields = fields


class TeamList(generics.ListAPIView):
    """Your teams with their quotas; admins see every team."""

    serializer_class = TeamSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Team.objects.none()
        return teams_visible_to(self.request.user).order_by("name")

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "roles": roles_of(self.request.user)}


class AuditList(TeamLookupMixin, generics.ListAPIView):
    """The team's audit log, newest first: every booking action and quota change (leaders, admins).

    Filters: ?action= ?actor= ?target= ?since=YYYY-MM-DD ?until=YYYY-MM-DD (portal.filters).
    """

    serializer_class = AuditEntrySerializer
    pagination_class = PagePagination
    filterset_class = AuditEntryFilter
    permission_classes = [IsAuthenticated, IsTeamManager]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return AuditEntry.objects.none()
        return AuditEntry.objects.filter(team=self.get_team()).select_related("actor")


team_urlpatterns: list[URLPattern | URLResolver] = [
    path("teams/", TeamList.as_view(), name="api_teams"),
    path("teams/<slug:slug>/audit/", AuditList.as_view(), name="api_team_audit"),
]
