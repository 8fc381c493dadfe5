from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Accounts and teams"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in

        import portal.checks  # noqa: F401 - registers the portal's system checks
        from portal.log_filters import redact_request_logs
        from portal.time_zones import remember_on_sign_in

        redact_request_logs()  # no log line names a calendar feed's secret (portal/log_filters.py)

        # The person's time zone into their session at sign-in (portal/time_zones.py).
        user_logged_in.connect(remember_on_sign_in, dispatch_uid="portal_time_zone")
