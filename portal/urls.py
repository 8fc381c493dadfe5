from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from portal import channel_views, event_views, notification_views, team_views, views

urlpatterns = [
    path("", include("gpus.urls")),
    path("", include("jobs.urls")),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("oidc/", include("portal.oidc")),  # single sign-on; 404 unless OIDC_ISSUER is set
    path("profile/", views.profile, name="profile"),
    path("profile/time-zone/", views.profile_time_zone, name="profile_time_zone"),
    path("profile/job-notices/", views.profile_job_notify, name="profile_job_notify"),
    path("profile/tokens/", views.token_create, name="token_create"),
    path("profile/tokens/<int:pk>/revoke/", views.token_revoke, name="token_revoke"),
    path("profile/channels/", channel_views.profile_channels, name="profile_channels"),
    path("profile/channels/<int:pk>/test/", channel_views.channel_test_send, name="channel_test"),
    path("profile/channels/<int:pk>/delete/", channel_views.channel_remove, name="channel_delete"),
    path("teams/", views.teams, name="teams"),
    path("teams/<slug:slug>/channels/", channel_views.team_channels, name="team_channels"),
    path("teams/<slug:slug>/members/", team_views.team_members, name="team_members"),
    path(
        "teams/<slug:slug>/members/<str:username>/role/", team_views.team_member_role, name="team_member_role"
    ),
    path(
        "teams/<slug:slug>/members/<str:username>/remove/",
        team_views.team_member_remove_view,
        name="team_member_remove",
    ),
    path("events/", event_views.events, name="events"),
    path("notifications/", notification_views.notifications, name="notifications"),
    path("notifications/bell/", notification_views.notification_bell, name="notification_bell"),
    path("notifications/read-all/", notification_views.notifications_read_all, name="notifications_read_all"),
    path("notifications/<int:pk>/read/", notification_views.notification_read, name="notification_read"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("portal.api_urls")),
]

# An outage inside a middleware (the session, the user, axes) reaches only this: 503, not 500.
handler500 = "portal.outage.server_error"
