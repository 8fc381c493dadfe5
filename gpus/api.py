"""Read-only inventory API: /api/v1/servers/ and /api/v1/gpus/."""

from __future__ import annotations

from rest_framework import serializers, viewsets

from gpus.models import GPU, GPUProcess, Server
from gpus.selectors import gpus_with_processes


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
    serializer_class = GPUSerializer
    lookup_field = "uuid"

    def get_queryset(self):  # type: ignore[no-untyped-def]
        queryset = gpus_with_processes()
        server = self.request.query_params.get("server")
        return queryset.filter(server__name=server) if server else queryset
