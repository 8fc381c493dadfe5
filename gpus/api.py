"""Inventory (/api/v1/servers/, /api/v1/gpus/, /api/v1/images/, read-only), bookings
(/api/v1/reservations/) and usage (/api/v1/usage/, read-only)."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.fields import SkipField
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from gpus import booking
from gpus.api_rows import gpu_rows
from gpus.booking import (
    request_problems,
    reservation_cancel,
    reservation_create,
    reservation_extend,
    reservation_release,
)
from gpus.filters import GPUFilter, ImageFilter, ReservationFilter, UsageFilter, ViolationFilter
from gpus.hooks import job_images
from gpus.image_models import IMAGE_NAME
from gpus.models import (
    GPU,
    Allocation,
    ContainerImage,
    GPUProcess,
    Reservation,
    Server,
    UsageDay,
    Violation,
)
from gpus.reports import UsageScope, usage_queryset, usage_rows
from gpus.selectors import (
    CommandLines,
    bookings_now,
    command_lines_for,
    gpus_with_processes,
    program_name,
    violation_command,
)
from gpus.slurm_booking import slurm_nodes_book
from portal.api_fields import KnownFieldsOnly, LocalDateTimeField
from portal.errors import Invalid
from portal.forms import CARDS_ERRORS, MIB_ERRORS
from portal.pagination import PagePagination
from portal.permissions import ActionPermissionsMixin, IsOwner, IsOwnerOrTeamManager


class GPUProcessSerializer(serializers.ModelSerializer):
    job = serializers.CharField(source="job_label", read_only=True)
    interactive_session = serializers.IntegerField(
        source="interactive_id",
        read_only=True,
        allow_null=True,
        help_text="Its gpu exec or JupyterLab session.",
    )
    command = serializers.SerializerMethodField(
        help_text="The whole command line for admins and the process's owner, else the program's name."
    )
    image = serializers.SerializerMethodField(help_text="Its job's container image; null: none.")

    class Meta:
        model = GPUProcess
        fields = [
            "pid",
            "username",
            "command",
            "used_memory_mb",
            "session_id",
            "job",
            "image",
            "interactive_session",
        ]

    def get_image(self, process: GPUProcess) -> str | None:
        return self.context.get("job_images", {}).get(process.job_id)

    def get_command(self, process: GPUProcess) -> str:
        commands: CommandLines | None = self.context.get("command_lines")
        if commands is None:  # no viewer to decide for: the program only
            return program_name(process.command)
        return commands.shown(process.command, username=process.username, job_id=process.job_id)


class GPUSerializer(serializers.ModelSerializer):
    """Memory fields are MiB, as NVML counts them."""

    server = serializers.SlugRelatedField(slug_field="name", read_only=True)
    memory_bookable_mb = serializers.IntegerField(
        read_only=True, help_text="MiB that bookings may share: total − driver-reserved − context headroom."
    )
    simulated = serializers.BooleanField(source="server.simulated", read_only=True)
    processes = GPUProcessSerializer(many=True, read_only=True)
    booked = serializers.SerializerMethodField(
        help_text="Who holds the card now: [{who, memory, until, lent}], named as the privacy rule allows; "
        "lent: 'lent to the queue since 14:02: job 812' for a booking lent to the queue, else empty "
        "(the queue's loan on it is not listed apart)."
    )

    class Meta:
        model = GPU
        fields = [
            "uuid",
            "server",
            "index",
            "name",
            "pci_bus_id",
            "memory_total_mb",
            "memory_reserved_mb",
            "memory_bookable_mb",
            "memory_used_mb",
            "utilization_pct",
            "temperature_c",
            "power_w",
            "power_limit_w",
            "mig_mode",
            "state",
            "processes_known",
            "processes",
            "booked",
            "simulated",
            "updated_at",
        ]

    def get_booked(self, gpu: GPU) -> list[dict[str, str]]:
        return self.context.get("booked", {}).get(gpu.uuid, [])


class ServerSerializer(serializers.ModelSerializer):
    status = serializers.CharField(read_only=True)
    queue = serializers.CharField(read_only=True)
    gpu_count = serializers.IntegerField(source="gpus.count", read_only=True)

    class Meta:
        model = Server
        fields = [
            "name",
            "hostname",
            "status",
            "draining",
            "simulated",
            "queue",
            "driver_version",
            "cuda_version",
            "cpu_count",
            "ram_mb",
            "gpu_count",
            "last_seen",
            "containers_ok",
            "containers_detail",
        ]


class ServerViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = ServerSerializer
    lookup_field = "name"
    queryset = Server.objects.prefetch_related("gpus")


class GPUViewSet(viewsets.ReadOnlyModelViewSet):
    """Every card with its live telemetry and processes. Filter: ?server=."""

    serializer_class = GPUSerializer
    lookup_field = "uuid"
    filterset_class = GPUFilter

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return gpus_with_processes()

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """What `GPUSerializer(many=True)` says of the filtered cards, from plain rows (gpus/api_rows.py):
        through the serializer, 512 cards took 80 ms of CPU in model instances, per-card prefetch
        querysets and 18,000 field lookups (issue 40). tests/test_api_rows.py holds the two equal."""
        cards = self.filter_queryset(GPU.objects.all())
        serializer = self.get_serializer_class()(context=super().get_serializer_context())
        return Response(gpu_rows(cards, viewer=request.user, serializer=serializer))

    def get_serializer_context(self) -> dict:
        context = super().get_serializer_context()
        if not getattr(self, "swagger_fake_view", False):
            context["booked"] = bookings_now(
                self.request.user, timezone.now()
            )  # one query (three with loans)
            context["command_lines"] = command_lines_for(self.request.user)
            jobs = GPUProcess.objects.exclude(job_id=None).values_list("job_id", flat=True).distinct()
            context["job_images"] = job_images(jobs)  # the jobs on cards now: each once
        return context


class ImageSerializer(serializers.ModelSerializer):
    servers = serializers.SlugRelatedField(
        slug_field="name", many=True, read_only=True, help_text="The servers that have it."
    )
    containers_ok = serializers.SerializerMethodField(
        help_text="Per server that has it: whether containers work there now, as its worker last found."
    )

    class Meta:
        model = ContainerImage
        fields = ["name", "reference", "description", "servers", "network", "has_jupyterlab", "containers_ok"]

    def get_containers_ok(self, image: ContainerImage) -> dict[str, bool]:
        return {server.name: server.containers_ok for server in image.servers.all()}


class ImageViewSet(viewsets.ReadOnlyModelViewSet):
    """The container images jobs and labs may run in (docs/containers.md), chosen by admins; a job
    names one by `name`. Filter: ?server=."""

    serializer_class = ImageSerializer
    lookup_field = "name"
    lookup_value_regex = IMAGE_NAME.removeprefix("^").removesuffix("\\Z")  # names have dots: tf-2.17
    filterset_class = ImageFilter
    queryset = ContainerImage.objects.prefetch_related("servers")


# --- reservations -------------------------------------------------------------------


class AllocationSerializer(serializers.ModelSerializer):
    gpu = serializers.CharField(source="gpu_id", read_only=True)
    server = serializers.CharField(source="gpu.server.name", read_only=True)
    index = serializers.IntegerField(source="gpu.index", read_only=True)
    whole_card = serializers.BooleanField(source="whole", read_only=True)

    class Meta:
        model = Allocation
        fields = ["gpu", "server", "index", "memory_mb", "whole_card"]


class ReservationSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    team = serializers.CharField(source="team.slug", read_only=True)
    status = serializers.CharField(read_only=True)
    cancelled_by = serializers.CharField(source="cancelled_by.username", read_only=True, default=None)
    allocations = AllocationSerializer(many=True, read_only=True)

    class Meta:
        model = Reservation
        fields = [
            "id",
            "owner",
            "team",
            "status",
            "start",
            "end",
            "booked_end",
            "note",
            "allocations",
            "created_at",
            "released_at",
            "cancelled_at",
            "cancelled_by",
            "cancel_reason",
            "idle_since",
            "idle_minutes",
            "slurm_reservation",
            "slurm_error",
        ]
        # The idle checker's (gpus/idle.py), and a Slurm cluster's worker's (gpus/slurm_booking.py).
        read_only_fields = ["idle_since", "idle_minutes", "slurm_reservation", "slurm_error"]


class ReservationCreateSerializer(KnownFieldsOnly):
    """Types only; the rules are checked by gpus.booking.reservation_create."""

    gpus = serializers.ListField(child=serializers.CharField(max_length=64), required=False, max_length=64)
    count = serializers.IntegerField(required=False, allow_null=True, error_messages=CARDS_ERRORS)
    server = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    memory_mb = serializers.IntegerField(
        required=False,
        allow_null=True,
        error_messages=MIB_ERRORS,
        help_text="MiB per card (NVML's unit); null: whole cards",
    )
    start = LocalDateTimeField(required=False, allow_null=True, help_text="Default: now")
    end = LocalDateTimeField(required=False, allow_null=True, help_text="Default: start + default length")
    note = serializers.CharField(required=False, allow_blank=True, max_length=500)
    team = serializers.SlugField(required=False, allow_null=True, help_text="Default: your first team")
    nodes = serializers.ListField(
        child=serializers.CharField(max_length=64),
        required=False,
        max_length=256,
        help_text="A Slurm cluster (server): these whole nodes, every card of them; Slurm holds them as a "
        "reservation for you. Not with gpus, count or memory_mb.",
    )


class ExtendSerializer(KnownFieldsOnly):
    end = LocalDateTimeField()


class ReservationCancelSerializer(KnownFieldsOnly):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=500)


def _nodes_book(user: object, fields: dict, nodes: list[str]) -> Reservation:
    """A booking of whole nodes of a Slurm cluster (gpus/slurm_booking.py): no cards or memory."""
    if given := [name for name in ("gpus", "count", "memory_mb") if fields.get(name)]:
        raise Invalid(
            f"A Slurm cluster is booked by whole nodes: drop {', '.join(given)}, or nodes.", field=given[0]
        )
    team = fields.get("team")
    return slurm_nodes_book(
        user=user,
        server=fields.get("server") or "",
        nodes=nodes,
        start=fields.get("start"),
        end=fields.get("end"),
        note=fields.get("note", ""),
        team=team,
    )


class MayCancel(IsOwnerOrTeamManager):
    message = booking.ONLY_OWNER_OR_MANAGER_CANCELS


class MayRelease(IsOwner):
    message = booking.ONLY_OWNER_RELEASES


class MayExtend(IsOwner):
    message = booking.ONLY_OWNER_EXTENDS


class ReservationViewSet(
    ActionPermissionsMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Own bookings and your teams' (admins: all; others: 404). Filters: ?status=, ?server=, ?team=, ?mine=1.

    DELETE cancels (the owner's active booking is released instead); leaders and admins
    cancelling someone else's booking give `reason` (query parameter or body).
    """

    serializer_class = ReservationSerializer
    pagination_class = PagePagination
    filterset_class = ReservationFilter
    permission_classes = [IsAuthenticated]
    # 403 for what a user sees but may not do; gpus/booking.py checks the same rules.
    action_permissions = {
        "destroy": [MayCancel],
        "cancel": [MayCancel],
        "release": [MayRelease],
        "extend": [MayExtend],
    }

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Reservation.objects.none()
        queryset = Reservation.objects.restrict(self.request.user).select_related(
            "owner", "team", "cancelled_by"
        )
        return queryset.prefetch_related("allocations__gpu__server").order_by("-start", "-id")

    # Every handler takes `format`: the router also routes `….json` and passes the
    # suffix on; without it such a request is a TypeError, a 500.
    @extend_schema(request=ReservationCreateSerializer, responses={201: ReservationSerializer})
    def create(self, request: Request, format: str | None = None) -> Response:
        data = ReservationCreateSerializer(data=request.data)
        if not data.is_valid():
            raise ValidationError(_every_problem(data, request.data))
        fields = dict(data.validated_data)
        nodes = fields.pop("nodes", None)
        if nodes is None:
            reservation = reservation_create(user=request.user, **fields)
        else:
            reservation = _nodes_book(request.user, fields, nodes)
        return Response(self._show(reservation.pk), status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[OpenApiParameter("reason", str, required=False)], responses=ReservationSerializer
    )
    def destroy(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        reservation = self.get_object()
        # The body is read as POST cancel/ reads it: a list, a number or a misspelt key is a 400.
        data = ReservationCancelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reason = request.query_params.get("reason") or data.validated_data.get("reason", "")
        reservation_cancel(user=request.user, reservation=reservation, reason=reason)
        return Response(self._show(reservation.pk))

    @extend_schema(request=ReservationCancelSerializer, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        reservation = self.get_object()
        data = ReservationCancelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reservation_cancel(
            user=request.user, reservation=reservation, reason=data.validated_data.get("reason", "")
        )
        return Response(self._show(reservation.pk))

    @extend_schema(request=None, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def release(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        reservation = self.get_object()
        reservation_release(user=request.user, reservation=reservation)
        return Response(self._show(reservation.pk))

    @extend_schema(request=ExtendSerializer, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def extend(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        reservation = self.get_object()
        data = ExtendSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reservation_extend(user=request.user, reservation=reservation, end=data.validated_data["end"])
        return Response(self._show(reservation.pk))

    def _show(self, pk: int) -> dict:
        return ReservationSerializer(self.get_queryset().get(pk=pk)).data


class ViolationSerializer(serializers.ModelSerializer):
    """What the GPU watchdog found: one process of one kind. Memory in MiB."""

    gpu = serializers.CharField(source="gpu_id", read_only=True, help_text="The card's UUID.")
    server = serializers.SlugRelatedField(slug_field="name", read_only=True)
    user = serializers.SlugRelatedField(
        slug_field="username", read_only=True, help_text="The portal user behind the process, if known."
    )
    command = serializers.SerializerMethodField(
        help_text="Whole for admins and the process's own user; the program's name for everyone else."
    )
    job = serializers.IntegerField(source="job_id", read_only=True, allow_null=True)
    reservation = serializers.IntegerField(source="reservation_id", read_only=True, allow_null=True)

    class Meta:
        model = Violation
        fields = [
            "id",
            "kind",
            "gpu",
            "server",
            "pid",
            "os_user",
            "user",
            "job",
            "reservation",
            "command",
            "memory_mb",
            "booked_mb",
            "first_seen",
            "last_seen",
            "ended_at",
            "action",
            "action_at",
            "warned_at",
            "stopped_at",
            "message",
        ]
        read_only_fields = fields

    def get_command(self, violation: Violation) -> str:
        request = self.context.get("request")
        return violation_command(violation, request.user if request else None)


class ViolationViewSet(viewsets.ReadOnlyModelViewSet):
    """Violations you caused, those on your bookings and those of the teams you lead (admins: all).

    Filters: ?kind=, ?action=, ?server=, ?open=, ?mine=, ?since=, ?until=."""

    serializer_class = ViolationSerializer
    pagination_class = PagePagination
    filterset_class = ViolationFilter
    permission_classes = [IsAuthenticated]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Violation.objects.none()
        return (
            Violation.objects.restrict(self.request.user)
            .select_related("server", "user")
            .order_by("-first_seen", "-id")
        )


# --- usage ------------------------------------------------------------------------------------


class UsageRowSerializer(serializers.Serializer):
    """One group's usage. GPU-hours: a card for an hour; a memory share counts its fraction of the card."""

    key = serializers.CharField(
        allow_null=True,
        help_text="The group: a username, team slug, server name, card UUID, or the period's first day "
        "(YYYY-MM-DD; a month: YYYY-MM). null: the time nobody booked.",
    )
    label = serializers.CharField()
    gpu_hours_booked = serializers.FloatField()
    gpu_hours_used = serializers.FloatField(
        help_text="Utilization-weighted: a card at 50 % for an hour is 0.5."
    )
    gpu_hours_unbooked = serializers.FloatField(help_text="Card time nobody had booked (admins only see it).")
    idle_hours = serializers.FloatField(help_text="GPU-hours booked while the card was idle.")
    memory_gb_hours_booked = serializers.FloatField()
    peak_memory_mb = serializers.IntegerField(
        allow_null=True,
        help_text="The most memory in use on the booked cards meanwhile, MiB: everyone's processes and the "
        "driver's included, so on a shared card not the booker's own. A job's own: /api/v1/jobs/{id}/.",
    )
    jobs = serializers.IntegerField(help_text="Jobs that finished, on their first card.")
    jobs_succeeded = serializers.IntegerField()
    jobs_failed = serializers.IntegerField()
    jobs_other = serializers.IntegerField(help_text="Cancelled, timed out or lost.")
    sessions = serializers.IntegerField(help_text="Interactive sessions that ended, on their first card.")
    utilization_pct = serializers.FloatField(
        allow_null=True, help_text="Used over booked (on unbooked time: over the free card time)."
    )


class UsageViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """GPU-hours booked, used and idle, one row per ?group_by= (user, team, server, gpu, day, week,
    month; default user). Your own usage; leaders: their teams'; admins: everything.

    Filters: ?since=, ?until= (default: this month so far), ?team=, ?user=, ?server=: the Reports
    page's, and its CSV export's."""

    serializer_class = UsageRowSerializer
    pagination_class = PagePagination
    filterset_class = UsageFilter
    permission_classes = [IsAuthenticated]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return UsageDay.objects.none()
        return usage_queryset(UsageScope.of(self.request.user), self._group_by())

    def list(self, request: Request, format: str | None = None) -> Response:
        rows = usage_rows(self.filter_queryset(self.get_queryset()), self._group_by())  # a bad value: 400
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def _group_by(self) -> str:
        return self.request.query_params.get("group_by") or "user"


def _every_problem(data: ReservationCreateSerializer, raw: Any) -> dict[str, Any]:
    """A request's parsing errors and the booking rules' problems with what did parse (as the
    booking form shows them): one 400 names every bad field. A body that is no object (a list, a
    number) has no fields to read: DRF's own answer says an object is expected."""
    if not isinstance(raw, dict):  # a QueryDict (a form) is a dict too
        return dict(data.errors)
    parsed: dict[str, Any] = {}
    for name, field in data.fields.items():
        if name not in data.errors:
            try:
                parsed[name] = field.run_validation(field.get_value(raw))
            except (ValidationError, SkipField):  # not given, or not parsed: the rules take their default
                continue
    problems = request_problems(
        gpus=parsed.get("gpus") or None,
        count=parsed.get("count"),
        memory_mb=parsed.get("memory_mb"),
        note=parsed.get("note") or "",
        start=parsed.get("start"),
        end=parsed.get("end"),
        unread=set(data.errors),
    )
    return {**problems, **data.errors}
