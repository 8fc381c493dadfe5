"""Per-server 7-day timeline (placeholder; being built)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_GET


@require_GET
@login_required
def server_timeline(request: HttpRequest, name: str) -> HttpResponse:
    raise Http404("not built yet")
