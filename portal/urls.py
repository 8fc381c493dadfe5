from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from portal import views

urlpatterns = [
    path("", include("gpus.urls")),
    path("", include("jobs.urls")),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("profile/", views.profile, name="profile"),
    path("profile/token/", views.regenerate_token, name="regenerate_token"),
    path("teams/", views.teams, name="teams"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("portal.api_urls")),
]
