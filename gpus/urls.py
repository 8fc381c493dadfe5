from django.urls import path

from gpus import calendar_views, report_views, team_views, timeline_views, views
from gpus import reservation_views as rv
from gpus import violation_views as vv

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/servers/", views.dashboard_servers, name="dashboard_servers"),
    path("gpus/<str:uuid>/", views.gpu_detail, name="gpu_detail"),
    path("gpus/<str:uuid>/history.json", views.gpu_history_json, name="gpu_history"),
    path("servers/<slug:name>/timeline/", timeline_views.server_timeline, name="server_timeline"),
    path("servers/<slug:name>/drain/", timeline_views.server_drain, name="server_drain"),
    path("reservations/", rv.my_reservations, name="my_reservations"),
    path("reservations/new/", rv.reservation_new, name="reservation_new"),
    path("reservations/<int:pk>/", rv.reservation_detail, name="reservation_detail"),
    path("reservations/<int:pk>/cancel/", rv.reservation_cancel, name="reservation_cancel"),
    path("reservations/<int:pk>/release/", rv.reservation_release, name="reservation_release"),
    path("reservations/<int:pk>/extend/", rv.reservation_extend, name="reservation_extend"),
    path("violations/", vv.violations, name="violations"),
    path("violations/<int:pk>/", vv.violation_detail, name="violation_detail"),
    path("violations/<int:pk>/stop/", vv.violation_stop_now, name="violation_stop"),
    path("violations/<int:pk>/resolve/", vv.violation_mark_resolved, name="violation_resolve"),
    path("reports/", report_views.reports, name="reports"),
    path("reports/usage.csv", report_views.reports_csv, name="reports_csv"),
    # A secret iCalendar address for calendar apps: no sign-in (gpus/calendars.py).
    path("calendar/<slug:secret>.ics", calendar_views.calendar_feed, name="calendar_feed"),
    path("calendar/new-link/", calendar_views.calendar_renew, name="calendar_renew"),
    path("teams/<slug:slug>/", team_views.team_detail, name="team_detail"),
    path("teams/<slug:slug>/quota/", team_views.team_quota, name="team_quota"),
    path("teams/<slug:slug>/members/<str:username>/quota/", team_views.member_quota, name="member_quota"),
]
