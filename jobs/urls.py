from django.urls import path

from jobs import page_events, views
from jobs.logs import stream as log_stream
from jobs.prometheus import views as prometheus_views
from jobs.sessions import views as session_views

urlpatterns = [
    # Prometheus' scrape, at the root where it looks by default (404 unless METRICS_TOKEN is set).
    path("metrics", prometheus_views.metrics, name="prometheus_metrics"),
    # The jobs API is portal/api_urls.py's router; this one answers async, so it sits beside it.
    path("api/v1/jobs/<int:pk>/log/stream/", log_stream.JobLogStream.as_view(), name="job_log_stream"),
    path("jobs/", views.my_jobs, name="my_jobs"),
    path("jobs/new/", views.job_new, name="job_new"),
    path("jobs/example/", views.job_example, name="job_example"),
    path("jobs/history/", views.job_history, name="job_history"),
    path("jobs/size-hint/", views.job_size_hint, name="job_size_hint"),
    path("teams/<slug:slug>/right-sizing/", views.team_rightsizing, name="team_rightsizing"),
    path("queue/", views.queue, name="queue"),
    path("reservations/<int:pk>/take-back/", views.booking_take_back, name="booking_take_back"),
    path("jobs/<int:pk>/", views.job_detail, name="job_detail"),
    path("jobs/<int:pk>/events/", page_events.job_events, name="job_events"),
    path("jobs/<int:pk>/log/", views.job_log_tail, name="job_log_tail"),
    path("jobs/<int:pk>/log.txt", views.job_log_download, name="job_log_download"),
    path("jobs/<int:pk>/metrics.csv", views.job_metrics_csv, name="job_metrics_csv"),
    path("jobs/<int:pk>/usage.json", views.job_usage_json, name="job_usage_json"),
    path("jobs/<int:pk>/cancel/", views.job_cancel_view, name="job_cancel"),
    # /sessions/<pk>/lab/… on the portal sends the owner to the lab on LAB_ORIGIN (jobs.sessions.lab_proxy);
    # lab-ticket/ is where the labs' origin comes back for a ticket (jobs.sessions.lab_handoff).
    path("sessions/new/", session_views.session_new, name="session_new"),
    path("sessions/<int:pk>/", session_views.session_detail, name="session_detail"),
    path("sessions/<int:pk>/lab-ticket/", session_views.lab_ticket, name="lab_ticket"),
    path("sessions/<int:pk>/end/", session_views.session_end, name="session_end"),
]
