from django.apps import AppConfig


class GpusConfig(AppConfig):
    name = "gpus"
    verbose_name = "Servers and GPUs"

    def ready(self) -> None:
        """gpus' answers to portal's questions (portal/hooks.py)."""
        from gpus import signals  # noqa: F401 - connects the worker signals
        from gpus.calendar_views import profile_calendar
        from gpus.hosts import worker_servers
        from gpus.slots import slots_fill
        from portal.hooks import PROFILE_CALENDAR, host_discovery_register, slot_fill

        host_discovery_register(worker_servers)  # what `make run` starts host workers for
        slots_fill()  # the quotas on portal's profile
        # The profile's "Calendar": the viewer's own booking feed (gpus/calendar_views.py).
        slot_fill(PROFILE_CALENDAR, "gpus/_calendar.html", profile_calendar)
