"""/api/v1/jobs/: submit, list (filters), retrieve, cancel, the log (streamed text) and the training
curves (JSON or CSV); and size-hint/, from the caller's own runs (jobs/rightsizing.py).

Visible to the owner, leaders of the job's team and admins; everyone else gets 404 (the queryset
is Job.objects.restrict, and DRF's get_object looks the job up in it). Every rule is in jobs.submit and
jobs.services, shared with the web form; filters are jobs.filters.JobFilter, shared with the pages.
"""

from __future__ import annotations

import json
import shlex

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils import html

from jobs.filters import JobFilter
from jobs.logs.store import log_response, parse_offset
from jobs.metrics import metric_records, metrics_csv_response, parse_since
from jobs.models import Job
from jobs.queue.scheduler import queue_plan
from jobs.rightsizing import size_hint_for
from jobs.selectors import queue_rows
from jobs.services import ONLY_MANAGERS_CANCEL, job_cancel
from jobs.submit import ScriptUpload, job_submit
from portal.api_fields import LocalDateTimeField
from portal.errors import Invalid
from portal.forms import CARDS_ERRORS, MIB_ERRORS
from portal.pagination import PagePagination
from portal.parsers import JSONParser
from portal.permissions import ActionPermissionsMixin, IsOwnerOrTeamManager


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    team = serializers.CharField(source="team.slug", read_only=True)
    server = serializers.CharField(source="server.name", read_only=True, allow_null=True, default=None)
    requested_server = serializers.CharField(source="request_server.name", read_only=True, default=None)
    image = serializers.CharField(
        source="image.name", read_only=True, default=None, help_text="Its container image; null: on the host."
    )
    reason = serializers.CharField(
        source="pending_reason", read_only=True, help_text="Why a pending job waits."
    )
    array_id = serializers.IntegerField(read_only=True, allow_null=True)
    script = serializers.SerializerMethodField()
    command = serializers.SerializerMethodField()
    duration_seconds = serializers.SerializerMethodField()
    requeued_at = serializers.DateTimeField(
        read_only=True,
        allow_null=True,
        help_text="When it last went back to the queue from a run (preempted); its started_at, "
        "finished_at and duration_seconds are its last run's. Null: it never did.",
    )
    mean_utilization_pct = serializers.FloatField(read_only=True)
    exit_label = serializers.CharField(
        read_only=True, help_text='exit_code in words: "-15 (SIGTERM)" for one a signal ended; "" for none.'
    )
    cancelled_by = serializers.CharField(
        source="cancelled_by.username", read_only=True, default=None, help_text="Who asked to cancel it."
    )

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
            "queued",
            "gpu_count",
            "memory_mb",
            "requested_server",
            "nice",
            "begin_at",
            "preemptible",
            "preemptions",
            "requeued_at",
            "reason",
            "array_id",
            "array_index",
            "script",
            "args",
            "command",
            "workdir",
            "interpreter",
            "image",
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
            "exit_label",
            "message",
            "cancel_requested_at",
            "cancelled_by",
            "cancel_reason",
            "worker",
            "peak_memory_mb",
            "mean_utilization_pct",
            "log_bytes",
            "log_dropped_bytes",
            "partition",
            "slurm_job_id",
            "slurm_state",
            "slurm_reason",
            "notify",
        ]

    def get_script(self, job: Job) -> str:
        return job.script_path or f"uploaded: {job.name}"

    def get_command(self, job: Job) -> str:
        return shlex.join([job.script_path or job.name, *job.args])

    def get_duration_seconds(self, job: Job) -> float | None:
        return round(job.duration.total_seconds(), 1) if job.duration else None


class PassThroughField(serializers.Field):
    """A string or a structure as sent; the service parses and checks it (args, env)."""

    joiner = ","  # a form field given twice, as its text joins it (notify: "end,fail")

    def get_value(self, dictionary):  # type: ignore[no-untyped-def]
        # A form field given twice (-F notify=end -F notify=fail) is both, not the last.
        if html.is_html_input(dictionary) and len(dictionary.getlist(self.field_name)) > 1:
            return self.joiner.join(dictionary.getlist(self.field_name))
        return super().get_value(dictionary)

    def to_internal_value(self, data: object) -> object:
        return data

    def to_representation(self, value: object) -> object:
        return value


@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]})
class ArgsField(PassThroughField):
    """The script's arguments: a list of strings, or one string split like a shell."""

    joiner = " "  # -F args=--lr -F args=0.1: each part split like a shell, in order


@extend_schema_field(
    {"oneOf": [{"type": "object", "additionalProperties": {"type": "string"}}, {"type": "string"}]}
)
class EnvField(PassThroughField):
    """Extra environment variables: {"NAME": "value"}, or NAME=value lines (multipart forms)."""

    joiner = "\n"  # -F env=A=1 -F env=B=2: two lines, not A="1,B=2"


@extend_schema_field(
    {
        "oneOf": [
            {"type": "array", "items": {"type": "string", "enum": ["start", "end", "fail"]}},
            {"type": "string"},
        ]
    }
)
class NotifyField(PassThroughField):
    """What its owner is told: ["end", "fail", "start"], or "end,fail" (multipart); [] or "none":
    nothing; left out or null: their preference (GET /api/v1/me/)."""


class PlainTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):  # type: ignore[no-untyped-def]
        """Only error bodies come through here; the log itself is a streamed response."""
        if isinstance(data, dict):
            return str(data.get("detail", data)).encode()
        return str(data).encode()


class CSVRenderer(PlainTextRenderer):
    """?format=csv of the training curves; the CSV itself is a streamed response, errors come here."""

    media_type = "text/csv"
    format = "csv"


class JobCreateSerializer(serializers.Serializer):
    """Types only; jobs.submit.job_submit checks every rule."""

    reservation = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=2**63 - 1,
        help_text="The booking to run on; leave it out to queue the job.",
        error_messages={
            "min_value": "Give the id of one of your bookings (GET /api/v1/reservations/), or leave it out.",
            "max_value": "Give the id of one of your bookings (GET /api/v1/reservations/), or leave it out.",
        },
    )
    gpu_count = serializers.IntegerField(
        required=False, allow_null=True, error_messages=CARDS_ERRORS, help_text="Queued: how many cards."
    )
    memory_mb = serializers.IntegerField(
        required=False,
        allow_null=True,
        error_messages=MIB_ERRORS,
        help_text="Queued: MiB per card; null: whole cards.",
    )
    server = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="Queued: a server's name; a Slurm cluster's sends it to Slurm.",
    )
    partition = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="On a Slurm cluster: its partition; empty: the first shown.",
    )
    array = serializers.CharField(required=False, allow_blank=True, help_text='Queued: "0-99" or "0-99%8".')
    nice = serializers.IntegerField(required=False, default=0, help_text="Queued: lowers its priority.")
    begin_at = LocalDateTimeField(required=False, allow_null=True, help_text="Queued: not before this.")
    team = serializers.CharField(
        required=False, allow_blank=True, help_text="Queued: your team's slug, if several."
    )
    preemptible = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Queued: may be stopped and requeued at its old place (PORTAL_CHECKPOINT_DIR keeps state).",
    )
    script = serializers.FileField(required=False, help_text="A .py file (multipart).")
    script_path = serializers.CharField(
        required=False, allow_blank=True, help_text="A .py under the job roots."
    )
    args = ArgsField(required=False, help_text="A list of strings, or one string split like a shell.")
    workdir = serializers.CharField(required=False, allow_blank=True)
    interpreter = serializers.CharField(required=False, default="default")
    image = serializers.CharField(
        required=False,
        allow_blank=True,
        allow_null=True,
        help_text="A container image's name (GET /api/v1/images/); empty: on the host.",
    )
    env = EnvField(required=False, help_text='{"NAME": "value"} (JSON), or NAME=value lines (multipart).')
    time_limit_minutes = serializers.IntegerField(required=False, allow_null=True)
    memory_mode = serializers.ChoiceField(choices=Job.MemoryMode.choices, required=False, allow_null=True)
    intra_op_threads = serializers.IntegerField(required=False, allow_null=True)
    inter_op_threads = serializers.IntegerField(required=False, allow_null=True)
    soft_placement = serializers.BooleanField(required=False, default=True)
    log_placement = serializers.BooleanField(required=False, default=False)
    mirrored = serializers.BooleanField(required=False, default=False)
    notify = NotifyField(
        required=False,
        allow_null=True,
        help_text='Of "start", "end", "fail": what you are told of it (e.g. ["end", "fail"]); [] nothing; '
        "left out: your preference.",
    )

    def to_internal_value(self, data):  # type: ignore[no-untyped-def]
        # A typo ("time", "mem") is named, not dropped: the job would run with the default.
        if hasattr(data, "keys"):
            # A session's HTML form posts Django's CSRF token beside the fields (SessionAuthentication).
            unknown = sorted(set(data.keys()) - set(self.fields) - {"csrfmiddlewaretoken"})
            if unknown:
                raise serializers.ValidationError(
                    {unknown[0]: [f"Unknown field; use {', '.join(self.fields)} (GET /api/v1/schema/)."]}
                )
        return super().to_internal_value(data)

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


class SizeHintSerializer(serializers.Serializer):
    """What to book per card for a script, from your own recent runs of it (docs/rightsizing.md)."""

    script = serializers.CharField(help_text="The script's file name.")
    runs = serializers.IntegerField(help_text="How many of your recent runs of it were measured (3 to 10).")
    peak_mb = serializers.IntegerField(help_text="Their highest peak per card, MiB.")
    booked_mb = serializers.IntegerField(help_text="What the latest of them booked per card, MiB.")
    suggested_mb = serializers.IntegerField(help_text="What would do per card, MiB.")
    text = serializers.CharField()


class JobCancelSerializer(serializers.Serializer):
    whole_array = serializers.BooleanField(
        required=False, default=False, help_text="Every task of its array."
    )
    # Checked by the service (jobs.services.job_cancel_reason_check), the page's rule too.
    reason = serializers.CharField(
        required=False,
        default="",
        allow_blank=True,
        trim_whitespace=False,
        help_text="Why; required to cancel someone else's job (its owner sees it). At most 500 characters.",
    )


class MayCancelJob(IsOwnerOrTeamManager):
    message = ONLY_MANAGERS_CANCEL


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
        return (
            Job.objects.restrict(self.request.user)
            .select_related("owner", "team", "server", "request_server", "image", "cancelled_by")
            .order_by("-created_at", "-id")
        )

    def filter_queryset(self, queryset):  # type: ignore[no-untyped-def]
        # The list's filters are not the records' (?since= is a date there, a record number here).
        if self.action == "metrics":
            return queryset
        return super().filter_queryset(queryset)

    def _show(self, pk: int) -> dict:
        return JobSerializer(self.get_queryset().get(pk=pk)).data

    # Every handler takes `format`: the router also routes `….json` (and `.csv`) and passes the
    # suffix on; without it such a request is a TypeError, a 500.
    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request: Request, format: str | None = None) -> Response:
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_submit(user=request.user, **data.service_kwargs())
        return Response(self._show(job.pk), status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "script", str, required=False, description="A file name or path; empty: your most frequent."
            )
        ],
        responses={200: SizeHintSerializer, 204: None},
    )
    @action(detail=False, methods=["get"], url_path="size-hint", filter_backends=[], pagination_class=None)
    def size_hint(self, request: Request, format: str | None = None) -> Response:
        """A size to book per card for ?script=, from your own recent runs of it; 204 when there is
        none (fewer than 3 measured runs, or they already book about that much)."""
        hint = size_hint_for(request.user, request.query_params.get("script"))
        if hint is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response(SizeHintSerializer(hint).data)

    @extend_schema(request=JobCancelSerializer, responses=JobSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        data = JobCancelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_cancel(user=request.user, job=self.get_object(), **data.validated_data)
        return Response(self._show(job.pk))

    @extend_schema(
        parameters=[OpenApiParameter("offset", int, required=False, description="Bytes from this offset.")],
        responses={(200, "text/plain"): OpenApiTypes.STR},
    )
    @action(detail=True, methods=["get"], renderer_classes=[PlainTextRenderer, JSONRenderer])
    def log(self, request: Request, pk: str | None = None, format: str | None = None):  # type: ignore[no-untyped-def]
        """The log as text/plain, streamed. X-Log-Next-Offset says where to continue tailing."""
        job = self.get_object()
        offset = parse_offset(request.query_params.get("offset"))
        return log_response(job, offset=offset, attachment=request.query_params.get("download") == "1")

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "since", int, required=False, description="Only records after this seq (0: from the first)."
            ),
            OpenApiParameter("format", str, required=False, enum=["json", "csv"]),
        ],
        responses={
            (200, "application/json"): {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "seq": {"type": "integer"},
                        "kind": {"type": "string", "enum": ["epoch", "batch"]},
                        "epoch": {"type": "integer", "nullable": True},
                        "step": {"type": "integer", "nullable": True},
                        "at": {"type": "string", "format": "date-time"},
                    },
                    "additionalProperties": {"type": "number", "nullable": True},
                },
            },
            (200, "text/csv"): OpenApiTypes.STR,
        },
    )
    @action(detail=True, methods=["get"], renderer_classes=[JSONRenderer, CSVRenderer])
    def metrics(self, request: Request, pk: str | None = None, format: str | None = None):  # type: ignore[no-untyped-def]
        """The training curves: what the job's Keras fit() reported, oldest first, at most 10,000
        records an answer (ask again with ?since= the last seq). X-Job-Status says whether more may
        come. ?format=csv: all of them, one column per metric name."""
        job = self.get_object()
        if request.accepted_renderer.format == "csv":
            return metrics_csv_response(job)
        records = metric_records(job.pk, since=parse_since(request.query_params.get("since")))
        return Response(records, headers={"X-Job-Status": job.status, "Cache-Control": "no-store"})


class QueueEntrySerializer(serializers.Serializer):
    """One pending job in the queue, in priority order."""

    job = serializers.IntegerField()
    name = serializers.CharField(help_text="Empty unless it is yours, a teammate's, or you are an admin.")
    owner = serializers.CharField()
    team = serializers.CharField()
    gpu_count = serializers.IntegerField()
    memory_mb = serializers.IntegerField(allow_null=True, help_text="MiB per card; null: whole cards.")
    server = serializers.CharField(help_text="The server asked for; empty: any.")
    time_limit_minutes = serializers.IntegerField()
    preemptible = serializers.BooleanField(
        help_text="It may be preempted: it can run on an idle booking lent to the queue, and leaves "
        "when the booking's owner comes back."
    )
    priority = serializers.FloatField()
    factors = serializers.DictField(child=serializers.FloatField(), help_text="fairshare, age and nice.")
    reason = serializers.CharField(help_text=f"Why it waits: {', '.join(Job.Reason.values)}.")
    estimated_start = serializers.DateTimeField(
        allow_null=True,
        help_text="When it should start, as far as the portal can tell; null: beyond QUEUE_BACKFILL_DEPTH "
        "or no server it may use takes work now.",
    )
    estimate_basis = serializers.CharField(
        help_text="What estimated_start rests on: begin_time (its --begin), lending (an idle booking "
        "lent to the queue, the next pass), plan (bookings, the running jobs' typical run times else "
        "their time limits, and the jobs ahead); empty when there is no estimate."
    )
    submitted_at = serializers.DateTimeField()
    array_id = serializers.IntegerField(allow_null=True)
    array_index = serializers.IntegerField(allow_null=True)


class QueueViewSet(viewsets.GenericViewSet):
    """GET /api/v1/queue/: the pending jobs in priority order, with their priority factors, the
    reason each waits and its estimated start (none beyond QUEUE_BACKFILL_DEPTH). Like `squeue`."""

    serializer_class = QueueEntrySerializer
    # The rows are computed (jobs.queue.rules), not a queryset; this names their model for the schema.
    queryset = Job.objects.none()
    pagination_class = PagePagination
    permission_classes = [IsAuthenticated]

    def list(self, request: Request, format: str | None = None) -> Response:
        rows = queue_rows(request.user, queue_plan(shared_usage=True, expected=True))
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(QueueEntrySerializer(page, many=True).data)
