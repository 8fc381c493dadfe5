from csp.decorators import csp_update
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from gpus import calendar_api, team_api
from gpus.api import (
    GPUViewSet,
    ImageViewSet,
    ReservationViewSet,
    ServerViewSet,
    UsageViewSet,
    ViolationViewSet,
)
from jobs.api import JobViewSet, QueueViewSet
from jobs.sessions.api import SessionViewSet
from portal import api as portal_api
from portal import channel_api

router = DefaultRouter()
router.register("servers", ServerViewSet, basename="server")
router.register("gpus", GPUViewSet, basename="gpu")
router.register("images", ImageViewSet, basename="image")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("violations", ViolationViewSet, basename="violation")
router.register("usage", UsageViewSet, basename="usage")
router.register("jobs", JobViewSet, basename="job")
router.register("queue", QueueViewSet, basename="queue")
router.register("sessions", SessionViewSet, basename="session")
router.register("notifications", portal_api.NotificationViewSet, basename="notification")
router.register(
    "notification-channels", channel_api.NotificationChannelViewSet, basename="notification-channel"
)

urlpatterns = [
    path("token/", portal_api.TokenObtain.as_view(), name="api_token"),
    path("token/current/", portal_api.TokenCurrent.as_view(), name="api_token_current"),
    path("schema/", SpectacularAPIView.as_view(), name="api_schema"),
    # The split view serves its start-up script as a file of its own: the pages run no inline
    # script. Swagger UI adds <style> elements as it draws, so that page alone allows inline style.
    path(
        "docs/",
        csp_update({"style-src": ["'unsafe-inline'"]})(
            SpectacularSwaggerSplitView.as_view(url_name="api_schema")
        ),
        name="api_docs",
    ),
    path("", include(router.urls)),
    *portal_api.team_urlpatterns,
    *team_api.team_urlpatterns,
    *calendar_api.me_urlpatterns,  # me/, me/calendar/: who is asking, their calendar feeds
]
