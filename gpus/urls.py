from django.urls import path

from gpus import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/servers/", views.dashboard_servers, name="dashboard_servers"),
    path("gpus/<str:uuid>/", views.gpu_detail, name="gpu_detail"),
    path("gpus/<str:uuid>/history.json", views.gpu_history_json, name="gpu_history"),
]
