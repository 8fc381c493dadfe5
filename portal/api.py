"""Teams API: /api/v1/teams/… (the pages' rules: portal.access, through portal.permissions), and
each person's notifications: /api/v1/notifications/….

Who may do what:
  POST  token/                           anyone with a username and password: a new API token
  GET   teams/                           your teams (admins: all)
  GET   teams/{slug}/audit/              leaders and admins (paginated, newest first; outsiders 404)
  GET   notifications/                   your own only, admins too (paginated, newest first)
  POST  notifications/{id}/read/         yours (anyone else's: 404)
  POST  notifications/read-all/          all of yours

A team's quota, its members' quotas and their use (teams/{slug}/, teams/{slug}/members/…)
are counted from bookings, so they are served by gpus/team_api.py.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import authenticate
from django.urls import URLPattern, URLResolver, path
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import generics, mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.access import VIEW, roles_of
from portal.filters import AuditEntryFilter
from portal.models import ApiToken, AuditEntry, Notification, Team
from portal.notifications import NotificationFilter, notifications_mark_read
from portal.pagination import PagePagination
from portal.permissions import IsTeamManager, TeamLookupMixin
from portal.services import api_token_create, api_token_revoke
from portal.tokens import api_token_expiry, expiry_days_help, expiry_days_max


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
        return Team.objects.restrict(self.request.user, VIEW).order_by("name")

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


# --- notifications --------------------------------------------------------------------------


class NotificationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Notification
        fields = ["id", "kind", "subject", "body", "url", "created_at", "read_at"]
        read_only_fields = fields


class ReadAllSerializer(serializers.Serializer):
    marked = serializers.IntegerField(help_text="How many were unread.")


class NotificationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Your own notifications, newest first; anyone else's are 404, admins' included.

    Filters: ?unread= ?kind= (portal.notifications.NotificationFilter, shared with /notifications/).
    """

    serializer_class = NotificationSerializer
    pagination_class = PagePagination
    filterset_class = NotificationFilter

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Notification.objects.none()
        return Notification.objects.filter(user=self.request.user).order_by("-created_at", "-id")

    @extend_schema(request=None, responses=NotificationSerializer)
    @action(detail=True, methods=["post"])
    def read(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        notification = self.get_object()
        notifications_mark_read(user=request.user, ids=[notification.pk])
        notification.refresh_from_db(fields=["read_at"])
        return Response(NotificationSerializer(notification).data)

    @extend_schema(request=None, responses=ReadAllSerializer)
    @action(detail=False, methods=["post"], url_path="read-all")
    def read_all(self, request: Request, format: str | None = None) -> Response:
        return Response({"marked": notifications_mark_read(user=request.user)})


# --- API tokens -------------------------------------------------------------------------------


class TokenRequestSerializer(serializers.Serializer):
    username = serializers.CharField()
    password = serializers.CharField(trim_whitespace=False, write_only=True, style={"input_type": "password"})
    name = serializers.CharField(
        required=False, max_length=100, help_text="Shown on your profile page. Default: 'API sign-in <date>'."
    )
    expires_in_days = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="API_TOKEN_DEFAULT_DAYS when left out."
    )

    def validate_expires_in_days(self, days: int | None) -> int | None:
        # The limit is a setting, so it is checked here rather than fixed as max_value.
        if days is not None and days > expiry_days_max():
            raise ValidationError(f"At most {expiry_days_max()} days on this portal. {expiry_days_help()}")
        return days


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField(
        help_text="The key, for `Authorization: Token <key>`; it is never shown again."
    )
    name = serializers.CharField()
    prefix = serializers.CharField(help_text="The key's first characters, as the profile page lists it.")
    expires_at = serializers.DateTimeField(allow_null=True)


class TokenObtain(APIView):
    """A new API token for a username and password (`gpu login` calls it). Each call makes another
    token; list and revoke them on the profile page. Failed tries count towards the sign-in limit:
    past it the answer is 429 (code `locked_out`) until the lock lifts, even for the right password."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(request=TokenRequestSerializer, responses=TokenSerializer, auth=[])
    def post(self, request: Request) -> Response:
        serializer = TokenRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        # The HttpRequest, not DRF's wrapper: django-axes marks the request it is given, and its
        # middleware, which answers a lockout with 429, only sees the HttpRequest.
        user = authenticate(request._request, username=data["username"], password=data["password"])
        if user is None:
            raise ValidationError({"non_field_errors": ["Unable to log in with provided credentials."]})
        token, key = api_token_create(
            user=user,
            name=data.get("name") or f"API sign-in {timezone.localtime():%Y-%m-%d %H:%M}",
            expires_at=api_token_expiry(data.get("expires_in_days")),
        )
        body = {"token": key, "name": token.name, "prefix": token.prefix, "expires_at": token.expires_at}
        return Response(TokenSerializer(body).data)


class TokenCurrent(APIView):
    """DELETE /api/v1/token/current/: revoke the token this request is signed with (`gpu logout`).
    Other tokens are listed and revoked on the profile page."""

    permission_classes = [IsAuthenticated]

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request) -> Response:
        if not isinstance(request.auth, ApiToken):
            raise ValidationError(
                {
                    "non_field_errors": [
                        "This request is not signed with an API token: revoke tokens on your profile page."
                    ]
                }
            )
        api_token_revoke(token=request.auth, by=request.user)
        return Response(status=204)
