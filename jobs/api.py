"""/api/v1/jobs/: submit, list (filters), retrieve, cancel, and the log (streamed text).

Visible to the owner, leaders of the job's team and admins; everyone else gets 404 (the queryset
is jobs_visible_to, and DRF's get_object looks the job up in it). Every rule is in jobs.services,
shared with the web form; filters are jobs.filters.JobFilter, shared with the pages.
"""

from __future__ import annotations

import json
import shlex

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from jobs.filters import JobFilter
from jobs.logs import log_response, parse_offset
from jobs.models import Job
from jobs.selectors import jobs_visible_to
from jobs.services import ScriptUpload, job_cancel, job_submit
from portal.errors import Invalid
from portal.pagination import PagePagination
from portal.permissions import ActionPermissionsMixin, IsOwnerOrTeamManager


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    team = serializers.CharField(source="team.slug", read_only=True)
    server = serializers.CharField(source="server.name", read_only=True)
    script = serializers.SerializerMethodField()
    command = serializers.SerializerMethodField()
    duration_seconds = serializers.SerializerMethodField()
    mean_utilization_pct = serializers.FloatField(read_only=True)

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "status",
            "owner",
            "team",
            "reservation",
            "server",
            "gpu_uuids",
            "script",
            "args",
            "command",
            "workdir",
            "interpreter",
            "env",
            "time_limit_minutes",
            "memory_mode",
            "intra_op_threads",
            "inter_op_threads",
            "soft_placement",
            "log_placement",
            "mirrored",
            "env_applied",
            "launcher_line",
            "created_at",
            "not_before",
            "started_at",
            "finished_at",
            "duration_seconds",
            "exit_code",
            "message",
            "worker",
            "peak_memory_mb",
            "mean_utilization_pct",
            "log_bytes",
            "log_dropped_bytes",
        ]

    def get_script(self, job: Job) -> str:
        return job.script_path or f"uploaded: {job.name}"

    def get_command(self, job: Job) -> str:
        return shlex.join([job.script_path or job.name, *job.args])

    def get_duration_seconds(self, job: Job) -> float | None:
        return round(job.duration.total_seconds(), 1) if job.duration else None


class PassThroughField(serializers.Field):
    """A string or a structure as sent; the service parses and checks it (args, env)."""

    def to_internal_value(self, data: object) -> object:
        return data

    def to_representation(self, value: object) -> object:
        return value


class PlainTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):  # type: ignore[no-untyped-def]
        """Only error bodies come through here; the log itself is a streamed response."""
        if isinstance(data, dict):
            return str(data.get("detail", data)).encode()
        return str(data).encode()


class JobCreateSerializer(serializers.Serializer):
    """Types only; jobs.services.job_submit checks every rule."""

    reservation = serializers.IntegerField()
    script = serializers.FileField(required=False, help_text="A .py file (multipart).")
    script_path = serializers.CharField(
        required=False, allow_blank=True, help_text="A .py under the job roots."
    )
    args = PassThroughField(required=False, help_text="A list of strings, or one string split like a shell.")
    workdir = serializers.CharField(required=False, allow_blank=True)
    interpreter = serializers.CharField(required=False, default="default")
    env = PassThroughField(
        required=False, help_text='{"NAME": "value"} (JSON), or NAME=value lines (multipart).'
    )
    time_limit_minutes = serializers.IntegerField(required=False, allow_null=True)
    memory_mode = serializers.ChoiceField(choices=Job.MemoryMode.choices, required=False, allow_null=True)
    intra_op_threads = serializers.IntegerField(required=False, allow_null=True)
    inter_op_threads = serializers.IntegerField(required=False, allow_null=True)
    soft_placement = serializers.BooleanField(required=False, default=True)
    log_placement = serializers.BooleanField(required=False, default=False)
    mirrored = serializers.BooleanField(required=False, default=False)

    def service_kwargs(self) -> dict:
        data = dict(self.validated_data)
        upload = data.pop("script", None)
        if upload is not None:
            data["script"] = ScriptUpload.from_file(upload)
        if not isinstance(data.get("args", []), str | list):
            raise Invalid("Arguments: give a list of strings or one command-line string.", field="args")
        env = data.get("env")
        if isinstance(env, str) and env.lstrip().startswith("{"):
            try:
                data["env"] = json.loads(env)
            except ValueError:
                raise Invalid('Environment: not valid JSON; send {"NAME": "value"}.', field="env") from None
        return data


class MayCancelJob(IsOwnerOrTeamManager):
    message = "Only the job's owner, leaders of its team and admins can cancel it."


class JobViewSet(
    ActionPermissionsMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Your jobs, your led teams' jobs (admins: all), newest first.

    Filters: ?user= ?team= ?server= ?status= ?since=YYYY-MM-DD ?until=YYYY-MM-DD ?mine=1.
    """

    serializer_class = JobSerializer
    pagination_class = PagePagination
    parser_classes = [JSONParser, MultiPartParser, FormParser]
    filterset_class = JobFilter
    permission_classes = [IsAuthenticated]
    # 403 for what a user sees but may not do; jobs/services.py checks the same rule.
    action_permissions = {"cancel": [MayCancelJob]}

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Job.objects.none()
        return jobs_visible_to(self.request.user).order_by("-created_at", "-id")

    def _show(self, pk: int) -> dict:
        return JobSerializer(self.get_queryset().get(pk=pk)).data

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request: Request) -> Response:
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_submit(user=request.user, **data.service_kwargs())
        return Response(self._show(job.pk), status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=JobSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = job_cancel(user=request.user, job=self.get_object())
        return Response(self._show(job.pk))

    @extend_schema(
        parameters=[OpenApiParameter("offset", int, required=False, description="Bytes from this offset.")],
        responses={(200, "text/plain"): OpenApiTypes.STR},
    )
    @action(detail=True, methods=["get"], renderer_classes=[PlainTextRenderer, JSONRenderer])
    def log(self, request: Request, pk: str | None = None):  # type: ignore[no-untyped-def]
        """The log as text/plain, streamed. X-Log-Next-Offset says where to continue tailing."""
        job = self.get_object()
        offset = parse_offset(request.query_params.get("offset"))
        return log_response(job, offset=offset, attachment=request.query_params.get("download") == "1")
