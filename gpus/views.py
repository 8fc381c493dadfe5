from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_GET

from gpus.calendar_views import calendar_panel
from gpus.card_rows import card_rows_html
from gpus.models import GPU
from gpus.selectors import dashboard_servers as select_dashboard_servers
from gpus.selectors import gpu_history
from gpus.servers import HOST_JOIN
from portal.access import is_admin


def _servers_html(request: HttpRequest) -> str:
    servers = select_dashboard_servers(request.user)
    reserve_url = reverse("reservation_new")
    for server in servers:
        server["rows_html"] = card_rows_html(server["cards"], reserve_url=reserve_url)
    context = {
        "servers": servers,
        # An admin with no server yet is told what to run on a GPU host (members, to ask one).
        "host_join": HOST_JOIN if is_admin(request.user) else "",
    }
    return render_to_string("gpus/_servers.html", context, using="jinja2")


@require_GET
@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "gpus/dashboard.html", {"servers_html": _servers_html(request)})


@require_GET
@login_required
def dashboard_servers(request: HttpRequest) -> HttpResponse:
    """The live part of the dashboard, polled by htmx and swapped in place."""
    return HttpResponse(_servers_html(request))


@require_GET
@login_required
def gpu_detail(request: HttpRequest, uuid: str) -> HttpResponse:
    gpu = get_object_or_404(GPU.objects.select_related("server"), uuid=uuid)
    if request.GET.get("part") == "facts":  # read again after a telemetry round (static/js/live.js)
        return render(request, "gpus/_gpu_facts.html", {"gpu": gpu})
    # Admins' feed of every booking of the card's server (gpus/calendars.py).
    calendar = calendar_panel(request, server=gpu.server) if is_admin(request.user) else None
    return render(request, "gpus/gpu_detail.html", {"gpu": gpu, "calendar": calendar})


@require_GET
@login_required
def gpu_history_json(request: HttpRequest, uuid: str) -> JsonResponse:
    gpu = get_object_or_404(GPU, uuid=uuid)
    points = gpu_history(gpu).values_list("at", "utilization_pct", "memory_used_mb")
    return JsonResponse(
        {
            "memory_total_mb": gpu.memory_total_mb,
            "points": [{"at": at.isoformat(), "util": util, "mem": mem} for at, util, mem in points],
        }
    )
