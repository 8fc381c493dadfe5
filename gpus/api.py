"""Inventory (/api/v1/servers/, /api/v1/gpus/, read-only) and bookings (/api/v1/reservations/)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from gpus import booking
from gpus.booking import reservation_cancel, reservation_create, reservation_extend, reservation_release
from gpus.filters import GPUFilter, ReservationFilter
from gpus.models import GPU, Allocation, GPUProcess, Reservation, Server
from gpus.selectors import gpus_with_processes
from portal.pagination import PagePagination
from portal.permissions import ActionPermissionsMixin, IsOwner, IsOwnerOrTeamManager


class GPUProcessSerializer(serializers.ModelSerializer):
    job = serializers.CharField(source="job_label", read_only=True)

    class Meta:
        model = GPUProcess
        fields = ["pid", "username", "command", "used_memory_mb", "job"]


class GPUSerializer(serializers.ModelSerializer):
    server = serializers.SlugRelatedField(slug_field="name", read_only=True)
    memory_bookable_mb = serializers.IntegerField(read_only=True)
    simulated = serializers.BooleanField(source="server.simulated", read_only=True)
    processes = GPUProcessSerializer(many=True, read_only=True)

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
            "processes",
            "simulated",
            "updated_at",
        ]


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
        ]


class ReservationCreateSerializer(serializers.Serializer):
    """Types only; the rules are checked by gpus.booking.reservation_create."""

    gpus = serializers.ListField(child=serializers.CharField(max_length=64), required=False, max_length=64)
    count = serializers.IntegerField(required=False, allow_null=True)
    server = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    memory_mb = serializers.IntegerField(required=False, allow_null=True, help_text="null: whole cards")
    start = serializers.DateTimeField(required=False, allow_null=True, help_text="Default: now")
    end = serializers.DateTimeField(
        required=False, allow_null=True, help_text="Default: start + default length"
    )
    note = serializers.CharField(required=False, allow_blank=True, max_length=500)
    team = serializers.SlugField(required=False, allow_null=True, help_text="Default: your first team")


class ExtendSerializer(serializers.Serializer):
    end = serializers.DateTimeField()


class CancelSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=500)


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
        queryset = Reservation.objects.visible_to(self.request.user).select_related(
            "owner", "team", "cancelled_by"
        )
        return queryset.prefetch_related("allocations__gpu__server").order_by("-start", "-id")

    @extend_schema(request=ReservationCreateSerializer, responses={201: ReservationSerializer})
    def create(self, request: Request) -> Response:
        data = ReservationCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reservation = reservation_create(user=request.user, **data.validated_data)
        return Response(self._show(reservation.pk), status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[OpenApiParameter("reason", str, required=False)], responses=ReservationSerializer
    )
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        reservation = self.get_object()
        reason = request.query_params.get("reason") or request.data.get("reason", "")
        reservation_cancel(user=request.user, reservation=reservation, reason=reason)
        return Response(self._show(reservation.pk))

    @extend_schema(request=CancelSerializer, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        reservation = self.get_object()
        data = CancelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reservation_cancel(
            user=request.user, reservation=reservation, reason=data.validated_data.get("reason", "")
        )
        return Response(self._show(reservation.pk))

    @extend_schema(request=None, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def release(self, request: Request, pk: str | None = None) -> Response:
        reservation = self.get_object()
        reservation_release(user=request.user, reservation=reservation)
        return Response(self._show(reservation.pk))

    @extend_schema(request=ExtendSerializer, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def extend(self, request: Request, pk: str | None = None) -> Response:
        reservation = self.get_object()
        data = ExtendSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        reservation_extend(user=request.user, reservation=reservation, end=data.validated_data["end"])
        return Response(self._show(reservation.pk))

    def _show(self, pk: int) -> dict:
        return ReservationSerializer(self.get_queryset().get(pk=pk)).data
