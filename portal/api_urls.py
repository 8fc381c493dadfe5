from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.authtoken.views import obtain_auth_token
from rest_framework.routers import DefaultRouter

from gpus import team_api
from gpus.api import GPUViewSet, ReservationViewSet, ServerViewSet
from jobs.api import JobViewSet
from portal import api as portal_api

router = DefaultRouter()
router.register("servers", ServerViewSet, basename="server")
router.register("gpus", GPUViewSet, basename="gpu")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("jobs", JobViewSet, basename="job")

urlpatterns = [
    path("token/", obtain_auth_token, name="api_token"),
    path("schema/", SpectacularAPIView.as_view(), name="api_schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api_schema"), name="api_docs"),
    path("", include(router.urls)),
    *portal_api.team_urlpatterns,
    *team_api.team_urlpatterns,
]
