"""GET /metrics: the portal's state for Prometheus (jobs/prometheus/metrics.py), behind a bearer token.

No session and no API token: Prometheus sends `Authorization: Bearer <METRICS_TOKEN>` (its scrape
config's `authorization: credentials_file:`). With METRICS_TOKEN empty the URL does not exist
(404); with it set, a missing or wrong token is a 401 that says what to send.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jobs.prometheus.metrics import PortalCollector

# The view's own registry, with the one collector: never the process-wide default one, whose
# per-process counters would differ from one gunicorn worker to the next.
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(PortalCollector())


@csrf_exempt  # GET only; any other method is a 405, never a CSRF 403
def metrics(request: HttpRequest) -> HttpResponse:
    token = settings.METRICS_TOKEN
    if not token:
        raise Http404("No /metrics: METRICS_TOKEN is not set.")
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    if not _bearer_matches(request.headers.get("Authorization", ""), token):
        response = HttpResponse(
            "Send the metrics token: Authorization: Bearer <METRICS_TOKEN>.\n",
            status=401,
            content_type="text/plain; charset=utf-8",
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _bearer_matches(header: str, token: str) -> bool:
    scheme, _, given = header.partition(" ")
    # compare_digest on bytes: its time does not tell how much of the token was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
