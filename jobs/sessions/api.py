"""/api/v1/sessions/: interactive work on a booking (jobs.sessions.services). `gpu exec` and `gpu shell`
create a session (POST), record its command's pid (PATCH), beat while it runs and say when it
ended (finish); DELETE ends it from anywhere (the command sees it at its next beat).

Visible to the owner, leaders of the booking's team and admins (404 for everyone else); driven by
its owner only (403); ended by the owner, a leader or an admin.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from jobs.filters import SessionFilter
from jobs.models import InteractiveSession, lab_path
from jobs.sessions.services import (
    session_beat,
    session_end_request,
    session_finish,
    session_running,
    session_start,
    session_times,
)
from portal.api_fields import KnownFieldsOnly
from portal.pagination import PagePagination
from portal.permissions import ActionPermissionsMixin, IsOwner, IsOwnerOrTeamManager


class SessionSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    server = serializers.CharField(source="server.name", read_only=True)
    image = serializers.CharField(source="image.name", read_only=True, default=None)
    url = serializers.SerializerMethodField(
        help_text="JupyterLab: the address a browser opens to reach it (a portal path that signs the owner"
        " in on the labs' own origin, LAB_ORIGIN, and goes on there)."
    )

    def get_url(self, session: InteractiveSession) -> str:
        return lab_path(session.pk) if session.kind == InteractiveSession.Kind.JUPYTERLAB else ""

    class Meta:
        model = InteractiveSession
        fields = [
            "id",
            "kind",
            "status",
            "owner",
            "reservation",
            "server",
            "gpu_uuids",
            "command",
            "image",
            "pid",
            "created_at",
            "started_at",
            "finished_at",
            "exit_code",
            "message",
            "end_requested_at",
            "url",
        ]
        read_only_fields = fields


class SessionStartSerializer(KnownFieldsOnly):
    reservation = serializers.IntegerField(
        required=False, allow_null=True, help_text="The booking; none: your one booking active now on `host`."
    )
    kind = serializers.ChoiceField(choices=InteractiveSession.Kind.choices)
    host = serializers.CharField(
        required=False, default="", allow_blank=True, help_text="exec, shell: the host the command runs on."
    )
    command = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False),
        required=False,
        default=list,
        help_text="exec, shell: the command's argv.",
    )
    image = serializers.CharField(
        required=False,
        allow_blank=True,
        allow_null=True,
        help_text=(
            "jupyterlab: open it in this container image (GET images/, has_jupyterlab) on the"
            " booking's server; none: on the host. exec, shell: refused (400 naming `image`)."
        ),
    )


class SessionStartedSerializer(SessionSerializer):
    env = serializers.DictField(child=serializers.CharField(), help_text="The booking's variables.")
    ends_at = serializers.DateTimeField()
    warn_at = serializers.DateTimeField()
    beat_seconds = serializers.IntegerField()
    grace_seconds = serializers.IntegerField()
    launcher = serializers.BooleanField(help_text="Run a Python script through the job launcher.")

    class Meta(SessionSerializer.Meta):
        fields = [
            *SessionSerializer.Meta.fields,
            "env",
            "ends_at",
            "warn_at",
            "beat_seconds",
            "grace_seconds",
            "launcher",
        ]
        read_only_fields = fields


PID_MAX = 2**22  # Linux's pid_max ceiling (PID_MAX_LIMIT)


class SessionPidSerializer(KnownFieldsOnly):
    pid = serializers.IntegerField(min_value=2, max_value=PID_MAX, help_text="Linux pids are below 2**22.")
    pid_started = serializers.FloatField(
        required=False, allow_null=True, default=None, min_value=0, max_value=2**40
    )


class SessionBeatSerializer(serializers.Serializer):
    status = serializers.CharField()
    ends_at = serializers.DateTimeField()
    warn_at = serializers.DateTimeField()
    end_requested = serializers.BooleanField()
    message = serializers.CharField(allow_blank=True)


class SessionFinishSerializer(KnownFieldsOnly):
    exit_code = serializers.IntegerField(allow_null=True, min_value=-(2**31), max_value=2**31 - 1)
    message = serializers.CharField(allow_blank=True, required=False, default="", max_length=2000)


class SessionViewSet(
    ActionPermissionsMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = SessionSerializer
    permission_classes = [IsAuthenticated]
    action_permissions = {
        "partial_update": [IsOwner],
        "beat": [IsOwner],
        "finish": [IsOwner],
        "destroy": [IsOwnerOrTeamManager],
    }
    pagination_class = PagePagination
    filterset_class = SessionFilter

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # the schema's look at the view: no user
            return InteractiveSession.objects.none()
        return InteractiveSession.objects.restrict(self.request.user).select_related(
            "owner", "server", "reservation", "image"
        )

    @extend_schema(request=SessionStartSerializer, responses={201: SessionStartedSerializer})
    def create(self, request: Request, format: str | None = None) -> Response:
        """Start a session on your booking active now on `host` (gpu exec, gpu shell)."""
        data = SessionStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session, env = session_start(user=request.user, **data.validated_data)
        ends_at, warn_at = session_times(session)
        times = serializers.DateTimeField()
        body = {
            **SessionSerializer(session).data,
            "env": env,
            "ends_at": times.to_representation(ends_at),
            "warn_at": times.to_representation(warn_at),
            "beat_seconds": settings.SESSION_BEAT_SECONDS,
            "grace_seconds": settings.JOB_KILL_GRACE_SECONDS,
            "launcher": True,
        }
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=SessionPidSerializer, responses=SessionSerializer)
    def partial_update(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        """The command runs: its pid (its session's leader) and that process's start time."""
        session = self.get_object()  # 404 and 403 before any word about the body
        data = SessionPidSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = session_running(session=session, **data.validated_data)
        return Response(SessionSerializer(session).data)

    @extend_schema(request=None, responses=SessionBeatSerializer)
    @action(detail=True, methods=["post"])
    def beat(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        """The command is alive; the answer is the booking's end as it stands and whether to stop."""
        return Response(SessionBeatSerializer(session_beat(session=self.get_object())).data)

    @extend_schema(request=SessionFinishSerializer, responses=SessionSerializer)
    @action(detail=True, methods=["post"])
    def finish(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        """The command ended: its exit code, and why where `gpu` stopped it."""
        session = self.get_object()
        data = SessionFinishSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = session_finish(session=session, **data.validated_data)
        return Response(SessionSerializer(session).data)

    def destroy(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        """End the session: its command stops at its next beat."""
        session = session_end_request(session=self.get_object(), by=request.user)
        return Response(SessionSerializer(session).data)
