"""Who is asking, and their calendar feeds: /api/v1/me/… (gpus/calendars.py has the rules).

  GET   me/            anyone signed in: who they are, their teams and roles, the addresses
                       of their calendar feeds: their own (`calendar_url`), each team they lead
                       (`team_calendar_urls`), and for admins each server (`server_calendar_urls`),
                       and what they are told of their jobs (`job_notify`). Feeds are made on first ask.
  PATCH me/            {"job_notify": ["end", "fail", "start"]}: what they are told of their jobs
                       (portal.notifications.job_notify_set); 400 naming the field, nothing written.
  POST  me/calendar/   a new secret for one feed: {} their own, {"team": slug} a team they lead,
                       {"server": name} a server (admins). The old address answers 404 at once.
                       403 naming the field when not theirs to have; 400 naming it when unknown.

It lives in gpus, beside the feeds, because a feed reads bookings; portal/api_urls.py routes it.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.urls import URLPattern, path
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils import html
from rest_framework.views import APIView

from gpus.calendars import (
    calendar_feed_get,
    calendar_feed_renew,
    calendar_feed_url,
    calendar_scope_from,
    server_feeds_for_admin,
)
from portal.access import is_admin
from portal.models import JOB_NOTIFY_EVENTS, Membership, Profile, Team
from portal.notifications import job_notify_of, job_notify_set


class MeTeamSerializer(serializers.Serializer):
    slug = serializers.CharField()
    name = serializers.CharField()
    role = serializers.CharField(help_text="member or leader")


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    name = serializers.CharField(help_text="First and last name; empty if the portal has none.")
    email = serializers.CharField()
    is_admin = serializers.BooleanField()
    time_zone = serializers.CharField(help_text="Their profile's time zone, else the portal's.")
    teams = MeTeamSerializer(many=True)
    calendar_url = serializers.URLField(help_text="Their own bookings as a secret iCalendar address.")
    team_calendar_urls = serializers.DictField(
        child=serializers.URLField(), help_text="Each team they lead (by slug): its bookings."
    )
    server_calendar_urls = serializers.DictField(
        child=serializers.URLField(), help_text="Admins: each server (by name): every booking of it. Else {}."
    )
    job_notify = serializers.ListField(
        child=serializers.ChoiceField(choices=JOB_NOTIFY_EVENTS),
        help_text='What you are told of your jobs: "start" (a queued job started), "end" (it succeeded, '
        'after JOB_END_NOTIFY_MIN_MINUTES or more), "fail" (failed, timed out, lost). A job\'s own '
        '"notify" wins.',
    )


@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]})
class JobNotifyField(serializers.Field):
    """A list, or text such as end,fail (a form: `curl -X PATCH -d job_notify=end,fail`), or null,
    as sent: portal.notifications.job_notify_parse reads it and refuses it naming the field."""

    def get_value(self, dictionary):  # type: ignore[no-untyped-def]
        if html.is_html_input(dictionary) and len(dictionary.getlist(self.field_name)) > 1:
            return ",".join(dictionary.getlist(self.field_name))  # -d job_notify=end -d job_notify=fail
        return super().get_value(dictionary)

    def to_internal_value(self, data: object) -> object:
        return data

    def to_representation(self, value: object) -> object:
        return value


class MeChangeSerializer(serializers.Serializer):
    job_notify = JobNotifyField(
        required=False,
        allow_null=True,
        help_text='Any of "start", "end", "fail" as a list (or "end,fail"); [] for nothing; '
        "null: the defaults.",
    )

    # A typo ("jobnotify") is named, rather than answered with "job_notify is required".
    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            return super().to_internal_value(data)  # DRF's own answer: an object is expected
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise ValidationError({unknown[0]: ["Unknown field: only job_notify can be changed here."]})
        if "job_notify" not in data:
            raise ValidationError({"job_notify": ['Give it, e.g. {"job_notify": ["end", "fail"]}.']})
        return super().to_internal_value(data)


class CalendarRenewInputSerializer(serializers.Serializer):
    team = serializers.CharField(required=False, help_text="A team you lead, by slug.")
    server = serializers.CharField(required=False, help_text="A server, by name (admins).")

    # Unknown keys are refused, so a typo ("teams") is an error rather than renewing the wrong feed.
    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise ValidationError({unknown[0]: ["Unknown field: give team, server or neither."]})
        return attrs


class CalendarRenewSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=["user", "team", "server"])
    team = serializers.CharField(allow_null=True)
    server = serializers.CharField(allow_null=True)
    calendar_url = serializers.URLField(help_text="The new address; the old one answers 404.")


def _time_zone(user: Any) -> str:
    chosen = Profile.objects.filter(user_id=user.pk).values_list("time_zone", flat=True).first()
    return chosen or settings.TIME_ZONE


def _team_feed_url(user: Any, team: Team) -> str:
    return calendar_feed_url(calendar_feed_get(user=user, team=team))


class Me(APIView):
    """Who you are, your teams, and your calendar addresses (made on first ask)."""

    permission_classes = [IsAuthenticated]

    @extend_schema(responses=MeSerializer)
    def get(self, request: Request) -> Response:
        user = request.user
        memberships = list(Membership.objects.filter(user=user).select_related("team").order_by("team__name"))
        led = [m.team for m in memberships if m.role == Membership.Role.LEADER]
        servers = server_feeds_for_admin(user) if is_admin(user) else {}
        body = {
            "username": user.username,
            "name": user.get_full_name(),
            "email": user.email,
            "is_admin": is_admin(user),
            "time_zone": _time_zone(user),
            "teams": [{"slug": m.team.slug, "name": m.team.name, "role": m.role} for m in memberships],
            "calendar_url": calendar_feed_url(calendar_feed_get(user=user)),
            "team_calendar_urls": {t.slug: _team_feed_url(user, t) for t in led},
            "server_calendar_urls": {name: calendar_feed_url(feed) for name, feed in servers.items()},
            "job_notify": job_notify_of(user),
        }
        return Response(MeSerializer(body).data)

    @extend_schema(request=MeChangeSerializer, responses=MeSerializer)
    def patch(self, request: Request) -> Response:
        """Change what you are told of your jobs; the answer is GET's."""
        given = MeChangeSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        job_notify_set(user=request.user, events=given.validated_data["job_notify"])
        return self.get(request)


class CalendarRenew(APIView):
    """A new secret for one of your calendar feeds; the old address answers 404 from now on."""

    permission_classes = [IsAuthenticated]

    @extend_schema(request=CalendarRenewInputSerializer, responses=CalendarRenewSerializer)
    def post(self, request: Request) -> Response:
        given = CalendarRenewInputSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        team, server = calendar_scope_from(request.user, given.validated_data)
        feed = calendar_feed_renew(user=request.user, team=team, server=server)
        body = {
            "scope": feed.scope,
            "team": team.slug if team else None,
            "server": server.name if server else None,
            "calendar_url": calendar_feed_url(feed),
        }
        return Response(CalendarRenewSerializer(body).data)


me_urlpatterns: list[URLPattern] = [
    path("me/", Me.as_view(), name="api_me"),
    path("me/calendar/", CalendarRenew.as_view(), name="api_me_calendar"),
]
