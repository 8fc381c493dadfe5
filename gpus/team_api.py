"""Team quota API: /api/v1/teams/{slug}/… (the team page's rules and services).

Who may do what (outsiders get 404 everywhere: the team is looked up among those they may see,
Team.objects.restrict(user, VIEW); the 403s are the permission classes named here):
  GET   teams/{slug}/                    members and admins
  PATCH teams/{slug}/                    quota fields: admins → quota_team_set; auto_release_idle:
                                         leaders and admins → team_auto_release_set (MayChangeTeam)
  GET   teams/{slug}/members/            leaders and admins (IsTeamManager: plain members 403)
  GET   teams/{slug}/members/{username}/ leaders, admins and that member (IsTeamManagerOrSelfReadOnly)
  PATCH teams/{slug}/members/{username}/ leaders and admins → quota_member_set

The team list and the audit log are portal's (portal/api.py). Serializers check types only;
every rule is in gpus/quotas.py and gpus/idle.py, whose errors the exception handler (portal/api_errors.py)
turns into {"detail", "code", "errors"}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction
from django.urls import URLPattern, URLResolver, path
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import generics, serializers
from rest_framework.permissions import SAFE_METHODS, BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from gpus.idle import team_auto_release_set, team_lend_idle_set
from gpus.quota_usage import team_use, team_use_total
from gpus.quotas import QUOTA_FIELDS, QUOTA_MAX, quota_member_set, quota_team_set
from portal.access import VIEW, can_manage_team, is_admin, only_managers, roles_of
from portal.api import TeamSerializer
from portal.models import Membership, Team
from portal.permissions import (
    IsTeamManager,
    IsTeamManagerOrSelfReadOnly,
    TeamLookupMixin,
)


def _limit(help_text: str) -> serializers.IntegerField:
    return serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=QUOTA_MAX,
        help_text=f"{help_text} null: no limit.",
        error_messages={
            "invalid": "Give a whole number, e.g. 4, or null for no limit.",
            "min_value": "Give 0 or more (0 allows none), or null for no limit.",
            "max_value": f"Give at most {QUOTA_MAX}, or null for no limit.",
        },
    )


class QuotaInputSerializer(serializers.Serializer):
    # Unknown keys are refused, so a typo ("max_card") is an error rather than a silent no-op.
    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            allowed = ", ".join(self.fields)
            raise serializers.ValidationError(
                {
                    name: [f"Not a quota setting you can change here; use one of {allowed}."]
                    for name in unknown
                }
            )
        return attrs


class TeamInputSerializer(QuotaInputSerializer):
    max_cards = _limit("Whole cards the team holds at once. Admins only.")
    max_gb = _limit("GiB of GPU memory the team holds at once. Admins only.")
    gpu_hours_per_week = _limit("GPU-hours per calendar week for the whole team. Admins only.")
    shares = serializers.IntegerField(
        required=False, min_value=1, help_text="Fair share among the teams. Admins only."
    )
    auto_release_idle = serializers.BooleanField(
        required=False,
        help_text="Release the team's idle bookings IDLE_RELEASE_MINUTES after their owner was warned. "
        "Leaders and admins.",
    )
    lend_idle = serializers.BooleanField(
        required=False,
        help_text="Lend the team's bookings idle for LEND_AFTER_MINUTES to preemptible queued jobs. "
        "Leaders and admins.",
    )


class MemberQuotaInputSerializer(QuotaInputSerializer):
    max_cards = _limit("Whole cards the member holds at once; at most the team's.")
    max_gb = _limit("GiB of GPU memory the member holds at once; at most the team's.")
    gpu_hours_per_week = _limit("GPU-hours per calendar week; at most the team's.")
    max_booking_hours = _limit("Longest single booking in hours (null: the portal's limit).")
    shares = serializers.IntegerField(required=False, min_value=1, help_text="Fair share within the team.")


class QuotaUseSerializer(serializers.Serializer):
    cards_now = serializers.IntegerField()
    gb_now = serializers.FloatField()
    # Booked, never used: the figure the weekly quota counts. "Used" GPU-hours (utilization-
    # weighted) are /api/v1/usage/'s gpu_hours_used; the same two words mean the same on every page.
    gpu_hours_booked_week = serializers.FloatField(
        source="gpu_hours_week",
        help_text="GPU-hours booked in this calendar week (Monday to Sunday in the portal's TIME_ZONE), "
        "including what is booked for later this week: what gpu_hours_per_week limits, three decimals. "
        "Used hours: /api/v1/usage/ gpu_hours_used.",
    )
    gpu_hours_week = serializers.FloatField(help_text="Deprecated: the same as gpu_hours_booked_week.")


NO_USE = {"cards_now": 0, "gb_now": 0.0, "gpu_hours_week": 0.0}


class TeamDetailSerializer(TeamSerializer):
    use = serializers.SerializerMethodField()

    class Meta(TeamSerializer.Meta):
        fields = [*TeamSerializer.Meta.fields, "auto_release_idle", "lend_idle", "use"]
        read_only_fields = fields

    @extend_schema_field(QuotaUseSerializer)
    def get_use(self, team: Team) -> dict[str, Any]:
        return QuotaUseSerializer(team_use_total(team_use(team))).data


class MemberSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", read_only=True)
    team = serializers.CharField(source="team.slug", read_only=True)
    use = serializers.SerializerMethodField()

    class Meta:
        model = Membership
        fields = [
            "username",
            "team",
            "role",
            "max_cards",
            "max_gb",
            "gpu_hours_per_week",
            "max_booking_hours",
            "use",
        ]
        read_only_fields = fields

    @extend_schema_field(QuotaUseSerializer)
    def get_use(self, membership: Membership) -> dict[str, Any]:
        use = self.context["use"].get(membership.user_id)
        return QuotaUseSerializer(use or NO_USE).data


class MayChangeTeam(BasePermission):
    """Whoever sees the team reads it. A PATCH that sets its quota: admins; one that only turns its
    auto-release on or off: its leaders and admins. The services check the same."""

    def has_object_permission(self, request: Request, view: Any, team: Team) -> bool:
        if request.method in SAFE_METHODS:
            return True
        if isinstance(request.data, Mapping) and set(request.data) & set(QUOTA_FIELDS):
            self.message = "Only admins set team quotas; ask one."
            return is_admin(request.user)
        self.message = only_managers(team)
        return can_manage_team(request.user, team)


class TeamDetail(generics.GenericAPIView):
    """A team, its quota, its auto-release of idle bookings and its use now / this week.
    PATCH sets the quota (admins) or the auto-release (leaders and admins)."""

    serializer_class = TeamDetailSerializer
    permission_classes = [IsAuthenticated, MayChangeTeam]
    lookup_field = "slug"

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Team.objects.none()
        return Team.objects.restrict(self.request.user, VIEW)

    def _show(self, team: Team) -> Response:
        return Response(TeamDetailSerializer(team, context={"roles": roles_of(self.request.user)}).data)

    def get(self, request: Request, slug: str) -> Response:
        return self._show(self.get_object())

    @extend_schema(request=TeamInputSerializer, responses=TeamDetailSerializer)
    def patch(self, request: Request, slug: str) -> Response:
        team = self.get_object()
        data = TeamInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        limits = dict(data.validated_data)
        auto_release = limits.pop("auto_release_idle", None)
        lend = limits.pop("lend_idle", None)
        with transaction.atomic():  # all or nothing
            # The auto-release first: it writes the team's bookings, and the booking services'
            # lock order is the bookings' rows, then the team's (which quota_team_set locks).
            if auto_release is not None:
                team = team_auto_release_set(actor=request.user, team=team, on=auto_release)
            if limits:
                team = quota_team_set(actor=request.user, team=team, **limits)
            if lend is not None:
                team = team_lend_idle_set(actor=request.user, team=team, on=lend)
        return self._show(team)


class MemberList(TeamLookupMixin, generics.GenericAPIView):
    """The team's members with their quotas and use (leaders and admins)."""

    serializer_class = MemberSerializer
    queryset = Membership.objects.none()
    permission_classes = [IsAuthenticated, IsTeamManager]

    @extend_schema(responses=MemberSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        team = self.get_team()
        members = team.memberships.select_related("user", "team").order_by("role", "user__username")
        return Response(MemberSerializer(members, many=True, context={"use": team_use(team)}).data)


class MemberDetail(TeamLookupMixin, generics.GenericAPIView):
    """One member's quota and use: leaders, admins and the member; PATCH: leaders and admins."""

    serializer_class = MemberSerializer
    permission_classes = [IsAuthenticated, IsTeamManagerOrSelfReadOnly]
    lookup_field = "user__username"
    lookup_url_kwarg = "username"

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Membership.objects.none()
        # The membership is the object whose permissions count; its team only has to be visible.
        team = self.get_team(check_permissions=False)
        return team.memberships.select_related("user", "team")

    def _show(self, membership: Membership) -> Response:
        return Response(MemberSerializer(membership, context={"use": team_use(membership.team)}).data)

    def get(self, request: Request, slug: str, username: str) -> Response:
        return self._show(self.get_object())

    @extend_schema(request=MemberQuotaInputSerializer, responses=MemberSerializer)
    def patch(self, request: Request, slug: str, username: str) -> Response:
        membership = self.get_object()
        data = MemberQuotaInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return self._show(quota_member_set(actor=request.user, membership=membership, **data.validated_data))


team_urlpatterns: list[URLPattern | URLResolver] = [
    path("teams/<slug:slug>/", TeamDetail.as_view(), name="api_team"),
    path("teams/<slug:slug>/members/", MemberList.as_view(), name="api_team_members"),
    path("teams/<slug:slug>/members/<str:username>/", MemberDetail.as_view(), name="api_team_member"),
]
