"""Chat and webhook channels: /api/v1/notification-channels/… (the services: portal.channels).

Who may do what:
  GET    notification-channels/            yours and those of the teams you lead (admins: all)
  POST   notification-channels/            {"url", "events"?, "label"?, "team"?}: yours, or a team's
                                            (its leaders and admins; anyone else 403 on `team`)
  GET    notification-channels/{id}/       one of those; anyone else's: 404
  PATCH  notification-channels/{id}/       {"events"?, "label"?}; a new URL is a new channel
  DELETE notification-channels/{id}/
  POST   notification-channels/{id}/test/  send a test now: {"ok", "detail"}

No answer holds a channel's URL in clear: `url` is its masked form.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from portal.access import VIEW
from portal.api_fields import KnownFieldsOnly
from portal.channels import (
    channel_create,
    channel_delete,
    channel_test,
    channel_update,
    channels_manageable_by,
    url_readable,
)
from portal.errors import Invalid
from portal.models import NotificationChannel, Team


class ChannelSerializer(serializers.ModelSerializer):
    url = serializers.CharField(source="url_masked", help_text="The URL with its secrets masked.")
    user = serializers.CharField(source="user.username", default=None, help_text="A person's own channel.")
    team = serializers.CharField(source="team.slug", default=None, help_text="A team's channel.")
    created_by = serializers.CharField(source="created_by.username", default=None)
    readable = serializers.SerializerMethodField(
        help_text="False when the portal's keys changed and it cannot be sent to: add it again."
    )

    class Meta:
        model = NotificationChannel
        fields = [
            "id",
            "label",
            "url",
            "user",
            "team",
            "events",
            "created_by",
            "created_at",
            "last_sent_at",
            "last_error",
            "readable",
        ]
        read_only_fields = fields

    def get_readable(self, channel: NotificationChannel) -> bool:
        return url_readable(channel.url_encrypted)


class ChannelCreateSerializer(KnownFieldsOnly):
    url = serializers.CharField(
        write_only=True,
        trim_whitespace=True,
        help_text="An apprise URL, e.g. slack://TokenA/TokenB/TokenC/#channel or json://host/path.",
    )
    events = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="Event kinds; empty or left out: all."
    )
    label = serializers.CharField(required=False, allow_blank=True, max_length=100)
    team = serializers.SlugField(
        required=False, allow_null=True, help_text="A team's slug: a channel for the team (its leaders)."
    )


class ChannelUpdateSerializer(KnownFieldsOnly):
    events = serializers.ListField(child=serializers.CharField(), required=False)
    label = serializers.CharField(required=False, allow_blank=True, max_length=100)


class ChannelTestSerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    detail = serializers.CharField(help_text="'sent', or why the service refused (secrets masked).")


def _team(user: Any, slug: str | None) -> Team | None:
    if not slug:
        return None
    team = Team.objects.restrict(user, VIEW).filter(slug=slug).first()
    if team is None:
        raise Invalid(f"You are in no team {slug!r}; give the slug of a team you lead.", field="team")
    return team


class NotificationChannelViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Your chat and webhook channels, and those of the teams you lead (admins: every one)."""

    serializer_class = ChannelSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return NotificationChannel.objects.none()
        return channels_manageable_by(self.request.user).select_related("created_by")

    @extend_schema(request=ChannelCreateSerializer, responses={201: ChannelSerializer})
    def create(self, request: Request, format: str | None = None) -> Response:
        data = ChannelCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        channel = channel_create(
            by=request.user,
            url=fields["url"],
            events=fields.get("events"),
            label=fields.get("label", ""),
            team=_team(request.user, fields.get("team")),
        )
        return Response(ChannelSerializer(channel).data, status=201)

    @extend_schema(request=ChannelUpdateSerializer, responses=ChannelSerializer)
    def partial_update(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        channel = self.get_object()
        given = request.data if isinstance(request.data, dict) else {}  # a list or a number: DRF's 400 below
        if "url" in given or "team" in given:
            field = "url" if "url" in given else "team"
            raise ValidationError(
                {field: [f"A channel's {field} cannot change: delete it and add a new one."]}
            )
        data = ChannelUpdateSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        channel = channel_update(channel=channel, events=fields.get("events"), label=fields.get("label"))
        return Response(ChannelSerializer(channel).data)

    def perform_destroy(self, instance: NotificationChannel) -> None:
        channel_delete(channel=instance)

    @extend_schema(request=None, responses=ChannelTestSerializer)
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        """Send a test message now and wait for the service's answer (CHANNEL_TIMEOUT_SECONDS)."""
        ok, reason = channel_test(channel=self.get_object(), by=request.user)
        return Response({"ok": ok, "detail": "sent" if ok else reason})
