"""Reads for pages and the API: a fixed number of queries, however many servers and GPUs."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from gpus.models import GPU, GPUProcess, Server, TelemetrySample


def gpus_with_processes() -> QuerySet[GPU]:
    return GPU.objects.select_related("server").prefetch_related(
        Prefetch("processes", queryset=GPUProcess.objects.order_by("-used_memory_mb", "pid"))
    )


def servers_for_dashboard() -> QuerySet[Server]:
    return Server.objects.prefetch_related(
        Prefetch("gpus", queryset=GPU.objects.order_by("index").prefetch_related("processes"))
    )


def gpu_history(gpu: GPU, *, minutes: int = 60) -> QuerySet[TelemetrySample]:
    since = timezone.now() - timedelta(minutes=minutes)
    return gpu.samples.filter(at__gte=since).order_by("at")
